"""A replica's chunk stream (actors/coordinator.py `ChunkStream`), in-process over a local engine: several leased
chunks in flight share one engine stream (no drain between them), each call gets exactly its own rows, and a stream
that dies fails every call in flight instead of leaving it waiting."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS

pytest.importorskip("ray")
from specoffload.actors.coordinator import ChunkStream  # noqa: E402 (needs ray)

PROMPTS = OFFLOAD_PROMPTS
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (2, 12, 3, 12, 2, 12, 3)]
HOT = SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


@pytest.fixture
def engine(tiny_models, single_thread):
    engine = Engine(EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], num_draft_tokens=2,
                                 max_batch_size=2, max_seq_len=48, device_memory="1GiB", replan_interval=0))
    yield engine
    engine.close()


def test_chunks_in_flight_share_one_stream_and_each_gets_its_own_rows(engine):
    params = [HOT if i % 3 == 1 else p for i, p in enumerate(PARAMS)]
    keys = [100 + i for i in range(len(PROMPTS))]  # a row's key is its job index, not its place in the stream
    reference = engine.generate(PROMPTS, params, keys=keys)
    streams = []
    real = engine.pipeline.stream
    engine.pipeline.stream = lambda *a, **kw: (streams.append(1), real(*a, **kw))[1]
    chunks = ChunkStream(engine, SimpleNamespace(recoveries=0))
    spans = [(0, 3), (3, 5), (5, 7)]
    results: dict[int, tuple] = {}

    def lease(n: int, lo: int, hi: int) -> None:
        if n:
            time.sleep(0.05 * n)  # later leases arrive while earlier rows decode
        call = chunks.submit([(PROMPTS[i], params[i], keys[i]) for i in range(lo, hi)])
        results[n] = call.result()

    threads = [threading.Thread(target=lease, args=(n, lo, hi)) for n, (lo, hi) in enumerate(spans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a chunk call hung"
    chunks.close(timeout_s=30)
    assert not chunks.thread.is_alive() and len(streams) == 1  # one engine stream for every chunk
    for n, (lo, hi) in enumerate(spans):
        rows, cost = results[n]
        assert [r.token_ids for r in rows] == [reference[i].token_ids for i in range(lo, hi)]
        assert cost["wall_s"] > 0 and cost["recoveries"] == 0
    assert sum(results[n][1]["passes"] for n in results) == engine.pipeline.verified  # passes split, not repeated
    assert sum(results[n][1]["bytes_read"] for n in results) == engine.last_stats.bytes_read


def test_a_dying_stream_fails_every_call_in_flight(engine):
    """A lost role beyond its restarts (here: an op raising) ends the stream: each run_chunk in flight raises that
    error (so the driver re-leases its chunk) instead of waiting forever; the next chunk starts a fresh stream."""
    boom = RuntimeError("role lost for good")
    real_verify = engine.pipeline._verify
    calls = {"n": 0}

    def verify(op):
        calls["n"] += 1
        if calls["n"] == 3:
            raise boom
        real_verify(op)

    engine.pipeline._verify = verify  # (before the stream starts: its schedule binds the handlers)
    chunks = ChunkStream(engine, SimpleNamespace(recoveries=0))
    first = chunks.submit([(PROMPTS[i], PARAMS[i], i) for i in range(3)])
    second = chunks.submit([(PROMPTS[i], PARAMS[i], i) for i in range(3, 6)])
    errors = []

    def wait(call) -> None:
        try:
            call.result()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    waiters = [threading.Thread(target=wait, args=(c,)) for c in (first, second)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in waiters), "a call hung after the stream died"
    assert len(errors) == 2 and all("role lost for good" in str(e) for e in errors)
    assert not chunks.alive
    with pytest.raises(Exception, match="role lost for good"):
        chunks.submit([(PROMPTS[0], PARAMS[0], 0)])
    engine.pipeline._verify = real_verify
    fresh = ChunkStream(engine, SimpleNamespace(recoveries=0))
    rows, _ = fresh.submit([(PROMPTS[0], PARAMS[0], 0)]).result()
    assert len(rows[0].token_ids) == 2
    fresh.close(timeout_s=30)
