"""A `Feed` (runtime/request.py): an open-ended request source that an engine stream reads without blocking, so a
producer (a Ray replica's leased chunks) can add rows while rows already admitted keep decoding. The stream idles
while the feed is open and empty, admits rows as they arrive, and ends once it is closed and drained; every row
equals its own `generate` (same key), on both runners."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.request import Feed, Request, Waiting
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS

PROMPTS = OFFLOAD_PROMPTS
UNEVEN = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (2, 12, 3, 12, 2, 12, 3)]
HOT = SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def _engine(tiny_models, offloaded: bool, draft: bool = True) -> Engine:
    extra = dict(device_memory="1GiB", replan_interval=0) if offloaded else {}
    return Engine(EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"] if draft else None,
                               num_draft_tokens=2 if draft else 0, max_batch_size=2, max_seq_len=48, **extra))


def _request(i: int) -> Request:
    return Request(i, [1, 2], 3, frozenset())


# ---- the feed and the waiting queue over it (pure) ------------------------------------------------------------------
def test_waiting_over_a_feed_never_blocks_and_ends_only_once_closed():
    feed: Feed[Request] = Feed()
    waiting = Waiting(feed)
    assert waiting.streaming and waiting.available(4) == 0 and not waiting and not waiting.ended
    t0 = time.monotonic()
    waiting.wait(0.05)  # open and empty: waits out its timeout
    assert time.monotonic() - t0 >= 0.04
    feed.put([_request(0), _request(1)])
    assert waiting.available(4) == 2 and waiting.popleft().index == 0
    feed.close()
    assert not waiting.ended  # request 1 still waits
    assert waiting.popleft().index == 1 and waiting.ended
    with pytest.raises(ValueError, match="closed"):
        feed.put([_request(2)])


def test_feed_wait_wakes_on_put_and_on_close():
    feed: Feed[int] = Feed()
    threading.Timer(0.05, lambda: feed.put([7])).start()
    t0 = time.monotonic()
    assert feed.wait(5.0) and time.monotonic() - t0 < 2.0 and feed.take(3) == [7]
    threading.Timer(0.05, feed.close).start()
    assert feed.wait(5.0) and feed.exhausted


@given(st.lists(st.lists(st.integers(0, 100), max_size=5), max_size=6), st.integers(1, 4))
def test_a_mapped_feed_takes_every_item_once_in_order(bursts, n):
    feed: Feed[int] = Feed()
    seen: list[int] = []
    mapped = feed.map(lambda x: (seen.append(x), x * 2)[1])
    out: list[int] = []
    for burst in bursts:
        feed.put(burst)
        while chunk := mapped.take(n):
            assert len(chunk) <= n
            out.extend(chunk)
    feed.close()
    assert mapped.exhausted and out == [2 * x for b in bursts for x in b] and seen == [x for b in bursts for x in b]


def test_waiting_over_an_iterator_is_unchanged():
    waiting = Waiting(iter([_request(0)]))
    assert not waiting.streaming and waiting and not waiting.ended
    waiting.popleft()
    assert not waiting and waiting.ended


# ---- an engine stream over a feed ------------------------------------------------------------------------------------
@pytest.mark.parametrize("offloaded", [True, False], ids=["offloaded", "resident"])
def test_rows_fed_in_two_bursts_stream_through_one_pipeline(tiny_models, single_thread, offloaded):
    """Burst 1 (3 rows) decodes; once the feed has been open and empty while rows decoded (two results out), a pause,
    then burst 2 (4 rows) joins the rows of burst 1 still running: no drain between them. Then the feed closes and
    the stream ends. Every row equals `generate` (sampled rows too: per-row random streams)."""
    engine = _engine(tiny_models, offloaded)
    params = UNEVEN[:3] + [HOT if i % 2 else UNEVEN[i] for i in range(3, len(PROMPTS))]
    reference = engine.generate(PROMPTS, params)
    feed: Feed = Feed()
    rows = [(p, params[i], i) for i, p in enumerate(PROMPTS)]
    feed.put(rows[:3])
    out = []
    running_at_second: list[bool] = []
    for result in engine.stream(feed):
        out.append(result)
        if len(out) == 2:
            time.sleep(0.1)
            if offloaded:
                running_at_second.append(any(b.rows for b in engine.pipeline.batches.items))
            feed.put(rows[3:])
            feed.close()
    assert sorted(r.index for r in out) == list(range(len(PROMPTS)))
    assert {r.index: r.token_ids for r in out} == {r.index: r.token_ids for r in reference}
    assert 1 not in {r.index for r in out[:2]}  # burst 1's 12-token row was still running when burst 2 came
    assert engine.last_stats is not None and engine.last_stats.num_prompts == len(PROMPTS)
    if offloaded:
        assert running_at_second == [True]
    engine.close()


@pytest.mark.parametrize("offloaded", [True, False], ids=["offloaded", "resident"])
def test_a_stream_over_an_open_empty_feed_idles_then_continues(tiny_models, single_thread, offloaded):
    """Every row done, the feed open: the stream idles (no passes, no spinning) until rows arrive, then runs them;
    it ends only when the feed closes."""
    engine = _engine(tiny_models, offloaded, draft=offloaded)
    reference = engine.generate(PROMPTS[:4], UNEVEN[:4])
    feed: Feed = Feed()
    feed.put([(PROMPTS[0], UNEVEN[0], 0), (PROMPTS[1], UNEVEN[1], 1)])
    stream = engine.stream(feed)
    first = [next(stream), next(stream)]  # burst 1 done; the feed is open and empty
    assert sorted(r.index for r in first) == [0, 1]
    passes: list[int] = []
    if offloaded:
        executor_steps = engine.pipeline.verified

    def later() -> None:
        time.sleep(0.3)
        if offloaded:
            passes.append(engine.pipeline.verified - executor_steps)
        feed.put([(PROMPTS[2], UNEVEN[2], 2), (PROMPTS[3], UNEVEN[3], 3)])
        time.sleep(0.2)
        feed.close()

    producer = threading.Thread(target=later)
    t0 = time.process_time()
    producer.start()
    rest = list(stream)
    producer.join()
    assert sorted(r.index for r in rest) == [2, 3]
    assert {r.index: r.token_ids for r in first + rest} == {r.index: r.token_ids for r in reference}
    assert time.process_time() - t0 < 5.0  # idling waits on the feed rather than spinning
    if offloaded:
        assert passes == [0]  # no pass ran while the feed was empty
    engine.close()


@pytest.mark.parametrize("draft", [False, True], ids=["nodraft", "draft"])
def test_a_stream_over_a_feed_grows_a_batch_below_its_size(tiny_models, single_thread, draft):
    """One row admitted (the feed held one), more arrive while it decodes: the batch grows to its size (a new wave;
    the running row is fed again from its committed tokens, and drafts in that pass as it would have) and every
    row still equals `generate`, the sampled one too."""
    engine = _engine(tiny_models, offloaded=True, draft=draft)
    long = SamplingParams(max_new_tokens=14, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)  # sampled
    reference = engine.generate(PROMPTS[:3], [long, UNEVEN[0], UNEVEN[2]])
    feed: Feed = Feed()
    feed.put([(PROMPTS[0], long, 0)])
    stream = engine.stream(feed)
    pipeline = engine.pipeline
    grown: list[int] = []

    def produce() -> None:
        while not (pipeline.running and pipeline.verified >= 2):  # (verified counts from the stream's start)
            time.sleep(0.005)
        feed.put([(PROMPTS[1], UNEVEN[0], 1), (PROMPTS[2], UNEVEN[2], 2)])
        feed.close()

    producer = threading.Thread(target=produce)
    producer.start()
    out = []
    for r in stream:
        out.append(r)
        grown.append(pipeline.batches.waves)
    producer.join()
    assert {r.index: r.token_ids for r in out} == {r.index: r.token_ids for r in reference}
    assert out[-1].index == 0  # the long row, admitted first, finished last: the others ran beside it
    assert grown[-1] >= 2  # a wave for the first row, another when the batch grew
    engine.close()
