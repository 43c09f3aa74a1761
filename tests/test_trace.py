"""Tests for timed spans, the Chrome trace export and the per-resource breakdown (runtime/trace.py).

Layout: hand-built spans with breakdowns worked out by hand, a hypothesis property test that the breakdown adds
up on random spans, then the Chrome trace export and the Tracer itself (threads, exceptions, disabled).
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime.trace import Breakdown, Span, Tracer, breakdown, resource_order

TOL = 1e-9


def make_tracer(*spans: tuple[str, str, float, float]) -> Tracer:
    tracer = Tracer()
    for name, resource, start, end in spans:
        tracer.add(name, resource, start, end)
    return tracer


def partition(b: Breakdown) -> dict[frozenset[str], float]:
    return dict(b.overlap)


def assert_adds_up(b: Breakdown) -> None:
    for usage in b.resources:
        assert usage.busy + usage.idle == pytest.approx(b.wall, abs=TOL)
        assert math.fsum(usage.by_name.values()) == pytest.approx(usage.busy, abs=TOL)
        containing = math.fsum(sec for busy_set, sec in b.overlap if usage.resource in busy_set)
        assert containing == pytest.approx(usage.busy, abs=TOL)
    assert math.fsum(sec for _, sec in b.overlap) == pytest.approx(b.wall, abs=TOL)


# ---- literal spans ------------------------------------------------------------------------------------------


def test_three_resources_by_hand() -> None:
    b = make_tracer(("load", "io", 0.0, 2.0), ("attention", "cpu", 1.0, 3.0), ("ffn", "device", 2.5, 4.0)).breakdown()
    assert b.wall == 4.0
    assert [u.resource for u in b.resources] == ["io", "cpu", "device"]
    assert [(u.busy, u.idle) for u in b.resources] == [(2.0, 2.0), (2.0, 2.0), (1.5, 2.5)]
    assert partition(b) == {
        frozenset({"io"}): 1.0,
        frozenset({"io", "cpu"}): 1.0,
        frozenset({"cpu"}): 0.5,
        frozenset({"cpu", "device"}): 0.5,
        frozenset({"device"}): 1.0,
    }
    assert b.serial_time == 5.5
    assert b.overlap_saving == 1.5
    assert b.overlap_efficiency == 0.5
    assert_adds_up(b)


def test_overlapping_spans_on_one_resource_count_once_and_go_to_the_earlier_span() -> None:
    # two device threads: ffn [0, 2] and draft [1, 3] overlap on [1, 2]; that second goes to ffn (started first)
    tracer = make_tracer(("ffn", "device", 0.0, 2.0), ("draft", "device", 1.0, 3.0), ("ffn", "device", 4.0, 5.0))
    b = tracer.breakdown(window=(0.0, 6.0))
    device = b.usage("device")
    assert device.busy == 4.0
    assert device.idle == 2.0
    assert device.by_name == {"ffn": 3.0, "draft": 1.0}
    assert partition(b) == {frozenset(): 2.0, frozenset({"device"}): 4.0}
    assert b.overlap_efficiency == pytest.approx(4.0 / 6.0)
    assert_adds_up(b)


def test_equal_starts_go_to_the_span_recorded_first() -> None:
    b = make_tracer(("a", "cpu", 0.0, 1.0), ("b", "cpu", 0.0, 2.0)).breakdown()
    assert b.usage("cpu").by_name == {"a": 1.0, "b": 1.0}
    b = make_tracer(("b", "cpu", 0.0, 2.0), ("a", "cpu", 0.0, 1.0)).breakdown()
    assert b.usage("cpu").by_name == {"b": 2.0}


def test_window_clips_spans() -> None:
    tracer = make_tracer(("load", "io", 0.0, 2.0), ("attention", "cpu", 1.0, 3.0), ("ffn", "device", 3.5, 4.0))
    b = tracer.breakdown(window=(1.5, 2.75))
    assert b.wall == 1.25
    assert [(u.resource, u.busy) for u in b.resources] == [("io", 0.5), ("cpu", 1.25), ("device", 0.0)]
    assert b.usage("device").by_name == {}
    assert partition(b) == {frozenset({"io", "cpu"}): 0.5, frozenset({"cpu"}): 0.75}
    # a window wider than the trace adds all-idle time at both ends
    wide = tracer.breakdown(window=(-1.0, 5.0))
    assert wide.wall == 6.0
    assert partition(wide)[frozenset()] == 1.0 + 0.5 + 1.0
    assert_adds_up(b)
    assert_adds_up(wide)


def test_resources_argument_selects_and_orders_tracks() -> None:
    tracer = make_tracer(("load", "io", 0.0, 2.0), ("attention", "cpu", 1.0, 3.0))
    b = tracer.breakdown(resources=["cpu", "gpu1"])
    assert [u.resource for u in b.resources] == ["cpu", "gpu1"]
    assert b.wall == 3.0  # the default window still spans every track
    assert b.usage("gpu1").busy == 0.0
    assert partition(b) == {frozenset(): 1.0, frozenset({"cpu"}): 2.0}
    with pytest.raises(KeyError):
        b.usage("io")


def test_empty_trace_and_bad_window() -> None:
    b = Tracer().breakdown()
    assert (b.wall, b.resources, b.overlap, b.overlap_efficiency) == (0.0, (), (), 0.0)
    with pytest.raises(ValueError, match="window"):
        make_tracer(("x", "io", 0.0, 1.0)).breakdown(window=(2.0, 1.0))


def test_table_and_dict() -> None:
    b = make_tracer(("load", "io", 0.0, 2.0), ("attention", "cpu", 1.0, 3.0), ("ffn", "device", 4.0, 5.0)).breakdown()
    text = b.table()
    assert "| io | 2.0000 | 3.0000 | 40.0 | load 2.0000s |" in text
    assert "| io + cpu | 1.0000 | 20.0 |" in text
    assert "| (all idle) | 1.0000 | 20.0 |" in text
    assert "check: max |busy + idle - wall| = 0.0e+00 s" in text
    d = json.loads(json.dumps(b.to_dict()))
    assert d["wall"] == 5.0
    assert d["serial_time"] == 5.0
    assert d["resources"][1] == {"resource": "cpu", "busy": 2.0, "idle": 3.0, "by_name": {"attention": 2.0}}
    assert {"resources": ["io", "cpu"], "seconds": 1.0} in d["overlap"]
    assert math.fsum(entry["seconds"] for entry in d["overlap"]) == 5.0


def test_resource_order() -> None:
    assert resource_order(["zeta", "device", "alpha", "io", "cpu", "io"]) == ["io", "cpu", "device", "alpha", "zeta"]


# ---- property: the breakdown always adds up -----------------------------------------------------------------

span_strategy = st.tuples(
    st.sampled_from(["ffn", "load", "draft", "attention"]),
    st.sampled_from(["io", "cpu", "device", "link"]),
    st.floats(0.0, 100.0, allow_nan=False),
    st.floats(1e-3, 10.0, allow_nan=False),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(span_strategy, min_size=1, max_size=30), st.none() | st.tuples(st.floats(-5, 60), st.floats(0, 60)))
def test_breakdown_adds_up_on_random_spans(
    raw: list[tuple[str, str, float, float]], window: tuple[float, float] | None
) -> None:
    tracer = make_tracer(*((name, res, start, start + dur) for name, res, start, dur in raw))
    b = tracer.breakdown()
    assert_adds_up(b)
    assert 0.0 < b.overlap_efficiency <= 1.0 + TOL
    assert b.overlap_saving == pytest.approx(b.serial_time - b.wall, abs=TOL)
    assert {u.resource for u in b.resources} == {res for _, res, _, _ in raw}
    assert all(sec > 0 for _, sec in b.overlap)
    if window is not None:
        lo, length = window
        clipped = tracer.breakdown(window=(lo, lo + length))
        assert clipped.wall == pytest.approx(length)
        assert_adds_up(clipped)
        for usage in clipped.resources:
            assert -TOL <= usage.busy <= b.usage(usage.resource).busy + TOL


# ---- Chrome trace export ------------------------------------------------------------------------------------


def test_chrome_trace_events(tmp_path) -> None:
    t0 = 1000.0
    tracer = Tracer()
    tracer.add("load", "io", t0, t0 + 0.002, layer=0, bytes=4096)
    tracer.add("attention", "cpu", t0 + 0.001, t0 + 0.003, layer=0)
    tracer.add("ffn", "device", t0 + 0.0025, t0 + 0.004, layer=0, step=7)
    tracer.add("rpc", "actor0", t0 + 0.0005, t0 + 0.0005)  # zero-length span on an extra track
    trace = json.loads(json.dumps(tracer.chrome_trace()))
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 4
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 1 for e in complete)
    load = next(e for e in complete if e["name"] == "load")
    ffn = next(e for e in complete if e["name"] == "ffn")
    assert (load["ts"], load["dur"]) == (pytest.approx(0.0), pytest.approx(2000.0, rel=1e-6))
    assert (ffn["ts"], ffn["dur"]) == (pytest.approx(2500.0, rel=1e-6), pytest.approx(1500.0, rel=1e-6))
    assert load["args"] == {"layer": 0, "bytes": 4096}
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "specoffload"}} in meta
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    sort_index = {e["tid"]: e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    ordered = [names[tid] for tid in sorted(names, key=sort_index.__getitem__)]
    assert ordered == ["io", "cpu", "device", "actor0"]
    assert all(names[e["tid"]] == e["cat"] for e in complete)

    path = tracer.save_chrome_trace(tmp_path / "nested" / "dir" / "trace.json")
    assert json.loads(path.read_text()) == trace


def test_chrome_trace_window_clips_and_rebases() -> None:
    tracer = make_tracer(("load", "io", 0.0, 2.0), ("attention", "cpu", 1.0, 3.0), ("ffn", "device", 3.5, 4.0))
    trace = tracer.chrome_trace(window=(1.5, 2.75))
    complete = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert set(complete) == {"load", "attention"}
    assert complete["load"]["ts"] == 0.0
    assert complete["load"]["dur"] == pytest.approx(0.5e6)
    assert complete["attention"]["dur"] == pytest.approx(1.25e6)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"io", "cpu"}


# ---- the Tracer -------------------------------------------------------------------------------------------


def test_span_context_times_the_body() -> None:
    tracer = Tracer()
    before = tracer.mark()
    with tracer.span("ffn", "device", layer=3):
        time.sleep(0.01)
    after = tracer.mark()
    (span,) = tracer.spans
    assert (span.name, span.resource, dict(span.args)) == ("ffn", "device", {"layer": 3})
    assert before <= span.start < span.end <= after
    assert span.duration >= 0.009
    tracer.clear()
    assert tracer.spans == []


def test_span_recorded_when_the_body_raises() -> None:
    tracer = Tracer()
    with pytest.raises(RuntimeError, match="boom"), tracer.span("load", "io"):
        raise RuntimeError("boom")
    assert [(s.name, s.resource) for s in tracer.spans] == [("load", "io")]


def test_disabled_tracer_records_nothing() -> None:
    tracer = Tracer(enabled=False)
    first = tracer.span("ffn", "device")
    with first:
        pass
    assert tracer.span("load", "io") is first  # one shared no-op context: no allocation per span
    tracer.add("load", "io", 0.0, 1.0)
    assert tracer.spans == []
    assert tracer.breakdown().resources == ()


def test_tracer_is_thread_safe() -> None:
    tracer = Tracer()
    threads, per_thread = 8, 250
    barrier = threading.Barrier(threads)

    def record(index: int) -> None:
        barrier.wait()
        for step in range(per_thread):
            with tracer.span(f"op{index}", ["io", "cpu", "device"][index % 3], step=step):
                pass

    workers = [threading.Thread(target=record, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    spans = tracer.spans
    assert len(spans) == threads * per_thread
    for i in range(threads):
        assert sorted(s.args["step"] for s in spans if s.name == f"op{i}") == list(range(per_thread))
    assert [s.start for s in spans] == sorted(s.start for s in spans)
    assert_adds_up(tracer.breakdown())


def test_span_validation_and_equality() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        Span("x", "io", 2.0, 1.0)
    args = {"layer": 1}
    a = Span("x", "io", 0.0, 1.0, args)
    args["layer"] = 2
    assert a.args == {"layer": 1}  # the span keeps its own copy
    assert a == Span("x", "io", 0.0, 1.0, {"layer": 9})  # args take no part in equality or hashing
    assert hash(a) == hash(Span("x", "io", 0.0, 1.0))
    assert breakdown([a]).usage("io").busy == 1.0
