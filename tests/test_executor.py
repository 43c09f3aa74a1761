"""The threaded op executor (runtime/offload/executor.py) with fake handlers that sleep (sleeps release the GIL).

Layout: a real schedule runs each op once after its deps (plus a hypothesis check on random graphs), real overlap
of io and device, priority order on one resource, failures, cancellation, tracing, and thread shutdown. Every
wait has a timeout, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime.offload.executor import OpExecutor, PipelineError
from specoffload.runtime.offload.schedule import KINDS, Op, PipelineSchedule
from specoffload.runtime.trace import Tracer

TIMEOUT = 5.0  # seconds: far above any test's real duration


class FakeOps:
    """Handlers for every op kind: sleep the op's duration, record (start, end, thread name), maybe raise."""

    def __init__(self, durations: dict[int, float] | None = None, default: float = 0.0) -> None:
        self.durations = durations or {}
        self.default = default
        self.fail: dict[int, BaseException] = {}
        self.started: defaultdict[int, threading.Event] = defaultdict(threading.Event)
        self.runs: defaultdict[int, list[tuple[float, float, str]]] = defaultdict(list)
        self.order: list[int] = []  # op ids in the order their handlers began
        self._lock = threading.Lock()

    @property
    def handlers(self) -> dict[str, Callable[[Op], None]]:
        return dict.fromkeys(KINDS, self)

    def __call__(self, op: Op) -> None:
        start = time.perf_counter()
        with self._lock:
            self.order.append(op.id)
            event = self.started[op.id]
        event.set()
        time.sleep(self.durations.get(op.id, self.default))
        with self._lock:
            self.runs[op.id].append((start, time.perf_counter(), threading.current_thread().name))
        if op.id in self.fail:
            raise self.fail[op.id]

    def wait_started(self, op_id: int) -> None:
        with self._lock:
            event = self.started[op_id]
        assert event.wait(TIMEOUT), f"op {op_id} never started"


def close_within(executor: OpExecutor, seconds: float = TIMEOUT) -> None:
    closer = threading.Thread(target=executor.close, daemon=True)
    closer.start()
    closer.join(seconds)
    assert not closer.is_alive(), "close() hangs"


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("specoffload-")]


def schedule_ops(steps: int, *args: object, **kwargs: object) -> list[Op]:
    sched = PipelineSchedule(*args, **kwargs)
    for _ in range(steps):
        sched.next_step()
    return sched.ops


def assert_ran_in_dependency_order(ops: Sequence[Op], fake: FakeOps) -> None:
    assert sorted(fake.runs) == sorted(op.id for op in ops)
    assert all(len(runs) == 1 for runs in fake.runs.values()), "an op ran twice"
    for op in ops:
        start, _, thread = fake.runs[op.id][0]
        assert thread == f"specoffload-{op.resource}"
        for d in op.deps:
            assert fake.runs[d][0][1] <= start, f"{op} started before its dep {d} ended"


# --- dependencies and overlap ----------------------------------------------------------------------------------


def test_schedule_runs_each_op_once_after_its_deps_one_at_a_time_per_resource() -> None:
    ops = schedule_ops(3, 3, [0, 1, 2, 3], num_buffers=2, draft_ops=2, attention_streamed=[1])
    fake = FakeOps(default=0.002)
    with OpExecutor(fake.handlers) as executor:
        executor.submit(ops)
        executor.wait_all(timeout=TIMEOUT)
    assert_ran_in_dependency_order(ops, fake)
    for resource in ("io", "cpu", "device"):
        spans = sorted(fake.runs[op.id][0][:2] for op in ops if op.resource == resource)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, f"two {resource} ops ran at once"


@st.composite
def random_graphs(draw: st.DrawFn) -> list[Op]:
    n = draw(st.integers(1, 25))
    ops = []
    for i in range(n):
        deps = draw(st.frozensets(st.integers(0, i - 1), max_size=3)) if i else frozenset()
        ops.append(Op(i, draw(st.sampled_from(KINDS)), step=0, deps=tuple(sorted(deps))))
    return ops


@settings(max_examples=25, deadline=None)
@given(random_graphs(), st.integers(1, 3))
def test_random_graphs_submitted_in_chunks_run_in_dependency_order(ops: list[Op], chunks: int) -> None:
    fake = FakeOps()
    with OpExecutor(fake.handlers) as executor:
        size = -(-len(ops) // chunks)
        for n in range(0, len(ops), size):
            executor.submit(ops[n : n + size])
        executor.wait_all(timeout=TIMEOUT)
    assert_ran_in_dependency_order(ops, fake)
    position = {op_id: n for n, op_id in enumerate(fake.order)}
    assert all(position[d] < position[op.id] for op in ops for d in op.deps)


def test_io_and_device_ops_overlap() -> None:
    fake = FakeOps({0: 0.2, 1: 0.2})
    with OpExecutor(fake.handlers) as executor:
        start = time.perf_counter()
        executor.submit([Op(0, "load", 0, layer=0, slot=0), Op(1, "draft", 0, batch=1, token=0)])
        executor.wait_all(timeout=TIMEOUT)
        elapsed = time.perf_counter() - start
    assert elapsed < 0.35, f"0.2 s of io and 0.2 s of device took {elapsed:.3f} s: no overlap"
    (load_start, load_end, _), (draft_start, draft_end, _) = fake.runs[0][0], fake.runs[1][0]
    assert load_start < draft_end and draft_start < load_end


def test_first_ready_op_of_a_resource_runs_first() -> None:
    # The device queue is [ffn (waits for a 0.1 s load), draft (ready)]: the draft runs while the ffn waits.
    fake = FakeOps({0: 0.1})
    ops = [
        Op(0, "load", 0, layer=0, slot=0),
        Op(1, "ffn", 0, layer=0, batch=0, slot=0, deps=(0,)),
        Op(2, "draft", 0, batch=1, token=0),
    ]
    with OpExecutor(fake.handlers) as executor:
        executor.submit(ops)
        executor.wait_all(timeout=TIMEOUT)
    assert fake.runs[2][0][0] < fake.runs[0][0][1] <= fake.runs[1][0][0]
    assert [i for i in fake.order if i != 0] == [2, 1]


def test_ready_ops_of_a_resource_run_in_list_order_not_id_order() -> None:
    fake = FakeOps({0: 0.05})
    with OpExecutor(fake.handlers) as executor:
        executor.submit([Op(0, "draft", 0, batch=1, token=0)])
        fake.wait_started(0)  # the device is busy while the next three queue up
        executor.submit([Op(3, "ffn", 0, layer=0, batch=0), Op(1, "head", 0, batch=0), Op(2, "draft", 0, batch=1)])
        executor.wait_all(timeout=TIMEOUT)
    assert fake.order == [0, 3, 1, 2]


def test_wait_returns_only_when_the_ops_are_done() -> None:
    fake = FakeOps({0: 0.1, 1: 0.05})
    with OpExecutor(fake.handlers) as executor:
        executor.submit([Op(0, "load", 0), Op(1, "ffn", 0, deps=(0,)), Op(2, "verify", 0, deps=(1,))])
        executor.wait([1], timeout=TIMEOUT)
        returned = time.perf_counter()
        assert fake.runs[1][0][1] <= returned
        executor.wait_all(timeout=TIMEOUT)
    assert sorted(fake.runs) == [0, 1, 2]


def test_wait_all_waits_for_the_ops_already_running() -> None:
    # Regression: wait_all used to wait only for queued ops, so it returned while an op was still running.
    fake = FakeOps({0: 0.15})
    with OpExecutor(fake.handlers) as executor:
        executor.submit([Op(0, "load", 0)])
        fake.wait_started(0)
        executor.wait_all(timeout=TIMEOUT)
        assert 0 in fake.runs, "wait_all returned before the running load finished"


def test_wait_times_out_on_an_op_that_cannot_run() -> None:
    with OpExecutor(FakeOps().handlers) as executor:
        executor.submit([Op(1, "ffn", 0, deps=(0,))])  # op 0 is never submitted
        with pytest.raises(TimeoutError, match=r"\[1\]"):
            executor.wait([1], timeout=0.05)


# --- failures ---------------------------------------------------------------------------------------------------


def test_failure_reaches_the_waiter_and_stops_every_worker() -> None:
    fake = FakeOps({0: 0.05, 2: 0.2})
    error = OSError("disk gone")
    fake.fail[0] = error
    ops = [
        Op(0, "load", 0, layer=0, slot=0),  # fails after 0.05 s
        Op(1, "ffn", 0, layer=0, batch=0, slot=0, deps=(0,)),  # depends on the failed load
        Op(2, "draft", 0, batch=1, token=0),  # running when the load fails: finishes
        Op(3, "draft", 0, batch=1, token=1),  # ready once op 2 ends, but the workers have stopped
        Op(4, "embed", 1, batch=1, deps=(2,)),  # the cpu worker stops too
        Op(5, "load", 1, layer=0, slot=1),  # queued behind the failed load
    ]
    executor = OpExecutor(fake.handlers)
    executor.submit(ops)
    start = time.perf_counter()
    with pytest.raises(PipelineError, match=r"load\(i=0, j=0, slot=0\) failed: disk gone") as info:
        executor.wait([1], timeout=TIMEOUT)
    assert info.value.__cause__ is error
    assert time.perf_counter() - start < 1.0
    with pytest.raises(PipelineError) as info:
        executor.wait_all(timeout=TIMEOUT)
    assert info.value.__cause__ is error
    with pytest.raises(PipelineError):
        executor.submit([Op(6, "verify", 1)])
    close_within(executor)
    assert sorted(fake.runs) == [0, 2]
    assert not workers()


def test_failure_of_a_running_op_reaches_wait_all() -> None:
    fake = FakeOps({0: 0.1})
    fake.fail[0] = RuntimeError("oom")
    with OpExecutor(fake.handlers) as executor:
        executor.submit([Op(0, "ffn", 0)])
        fake.wait_started(0)
        with pytest.raises(PipelineError, match="oom"):
            executor.wait_all(timeout=TIMEOUT)


def test_failure_in_a_worker_start_hook_does_not_hang_the_pipeline() -> None:
    submitted = threading.Event()

    def hook(resource: str) -> None:
        if resource == "device":
            assert submitted.wait(TIMEOUT)
            raise RuntimeError("no device")

    fake = FakeOps()
    executor = OpExecutor(fake.handlers, on_thread_start=hook)
    try:
        executor.submit([Op(0, "ffn", 0)])
        submitted.set()
        with pytest.raises(PipelineError, match="device worker failed: no device"):
            executor.wait([0], timeout=TIMEOUT)
    finally:
        close_within(executor)
    assert 0 not in fake.runs


def test_submit_rejects_a_batch_with_an_unknown_op_as_a_whole() -> None:
    fake = FakeOps()
    with OpExecutor({"load": fake}) as executor:
        with pytest.raises(ValueError, match="no handler for op kind 'ffn'"):
            executor.submit([Op(0, "load", 0), Op(1, "ffn", 0)])
        executor.wait_all(timeout=TIMEOUT)
    assert not fake.runs
    with (
        OpExecutor(fake.handlers, resources=("io",)) as executor,
        pytest.raises(ValueError, match="no worker for resource 'device'"),
    ):
        executor.submit([Op(0, "load", 0), Op(1, "ffn", 0)])
    assert not fake.runs


# --- cancellation -------------------------------------------------------------------------------------------------


def test_cancel_from_drops_the_queued_ops_of_later_steps() -> None:
    fake = FakeOps({0: 0.15, 1: 0.15})
    ops = [
        Op(0, "load", 0, layer=0, slot=0),  # running at the cancel
        Op(1, "draft", 1, batch=0, token=0),  # step 1 but already running: not dropped
        Op(2, "load", 1, layer=0, slot=1),  # queued behind op 0: dropped
        Op(3, "ffn", 1, layer=0, batch=1, deps=(2,)),  # dropped
        Op(4, "embed", 0, batch=0, deps=(0,)),  # step 0: still runs after op 0
        Op(5, "draft", 2, batch=1, token=0),  # queued behind op 1: dropped
    ]
    with OpExecutor(fake.handlers) as executor:
        executor.submit(ops)
        fake.wait_started(0)
        fake.wait_started(1)
        assert executor.cancel_from(1) == 3
        executor.wait([2, 3, 5], timeout=0.05)  # returns at once, though ops 0 and 1 still run
        executor.wait([1], timeout=TIMEOUT)
        assert 1 in fake.runs
        executor.wait_all(timeout=TIMEOUT)
        assert executor.cancel_from(0) == 0
    assert sorted(fake.runs) == [0, 1, 4]


# --- tracing and threads ----------------------------------------------------------------------------------------


def expected_args(op: Op) -> dict[str, int]:
    args = {"step": op.step, "layer": op.layer, "batch": op.batch, "token": op.token, "slot": op.slot}
    return {name: value for name, value in args.items() if value >= 0}


def test_tracer_gets_one_span_per_op_on_its_resource() -> None:
    ops = schedule_ops(2, 2, [0, 1, 2], num_buffers=2, draft_ops=1)
    fake = FakeOps(default=0.001)
    tracer = Tracer()
    with OpExecutor(fake.handlers, tracer) as executor:
        executor.submit(ops)
        executor.wait_all(timeout=TIMEOUT)
    spans = tracer.spans
    key = [(s.name, s.resource, tuple(sorted(s.args.items()))) for s in spans]
    assert Counter(key) == Counter((op.kind, op.resource, tuple(sorted(expected_args(op).items()))) for op in ops)
    by_key = dict(zip(key, spans))
    for op in ops:
        span = by_key[(op.kind, op.resource, tuple(sorted(expected_args(op).items())))]
        start, end, _ = fake.runs[op.id][0]
        assert span.start <= start and end <= span.end, f"span of {op} does not cover its handler"


def test_disabled_tracer_records_nothing() -> None:
    tracer = Tracer(enabled=False)
    fake = FakeOps()
    with OpExecutor(fake.handlers, tracer) as executor:
        executor.submit([Op(0, "load", 0), Op(1, "ffn", 0, deps=(0,))])
        executor.wait_all(timeout=TIMEOUT)
    assert sorted(fake.runs) == [0, 1] and tracer.spans == []


@pytest.fixture
def baseline_threads() -> Iterator[int]:
    assert not workers(), "a previous test left executor threads behind"
    yield threading.active_count()


def test_close_joins_one_thread_per_resource(baseline_threads: int) -> None:
    started: list[tuple[str, str]] = []
    executor = OpExecutor(
        FakeOps().handlers, on_thread_start=lambda r: started.append((r, threading.current_thread().name))
    )
    assert threading.active_count() == baseline_threads + 3
    assert sorted(t.name for t in workers()) == ["specoffload-cpu", "specoffload-device", "specoffload-io"]
    close_within(executor)
    assert threading.active_count() == baseline_threads
    assert sorted(started) == [(r, f"specoffload-{r}") for r in ("cpu", "device", "io")]
    close_within(executor)  # a second close is harmless
    with OpExecutor(FakeOps().handlers, resources=("io",)):
        assert threading.active_count() == baseline_threads + 1
    assert threading.active_count() == baseline_threads
