"""The copy / compute protocol of the ring slots (runtime/offload/slot_sync.py), checked on the CPU.

On CUDA a load only queues copies and a layer only queues kernels, so the pipeline must call the `SlotSync` hooks
in the right order: a read waits on the event of the load it reads, and a load waits on the release that followed
the slot's previous readers. Here the real pipeline runs on the CPU with a `RecordingSlotSync` (the fake device: it
logs every call with the slot's load generation), for random budgets, k and batch sizes, and `check_protocol`
must find nothing; and `check_protocol` itself must catch every kind of violation.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specoffload.planner.placement import PlacementPolicy, place
from specoffload.planner.shapes import PartKey
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.offload.slot_sync import RecordingSlotSync, SyncEvent, check_protocol
from specoffload.runtime.offload.workers import local_workers
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS, dense_shape


def _events(calls: list[tuple[str, int]]) -> list[SyncEvent]:
    sync = RecordingSlotSync()
    for call, slot in calls:
        getattr(sync, call)(slot)
    return sync.log


def _ring(loads: list[int], readers: list[int]) -> list[tuple[str, int]]:
    """A correct trace: load i goes to slot loads[i], then readers[i] reads of it, each released."""
    calls: list[tuple[str, int]] = []
    for slot, n in zip(loads, readers):
        calls += [("before_load", slot), ("after_load", slot)]
        calls += [("before_use", slot), ("after_use", slot)] * n
    return calls


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=30))
def test_a_correct_trace_passes(pairs: list[tuple[int, int]]) -> None:
    loads, readers = [s for s, _ in pairs], [n for _, n in pairs]
    assert check_protocol(_events(_ring(loads, readers))) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=20), st.data())
def test_every_broken_trace_is_caught(pairs: list[tuple[int, int]], data: st.DataObject) -> None:
    """Drop one call of a correct trace, or move a read's release after the next load: a violation."""
    calls = _ring([s for s, _ in pairs], [n for _, n in pairs])
    broken = list(calls)
    how = data.draw(st.sampled_from(["drop", "late_release"]))
    if how == "drop":
        del broken[data.draw(st.integers(0, len(calls) - 1))]
    else:  # the slot's release comes only after the next load into it has begun
        uses = [n for n, (call, _) in enumerate(calls) if call == "after_use"]
        n = data.draw(st.sampled_from(uses))
        slot = calls[n][1]
        broken = calls[:n] + [("before_load", slot), ("after_use", slot)]
    assert check_protocol(_events(broken)), broken


def test_check_protocol_names_the_problem() -> None:
    problems = check_protocol(_events([("before_use", 0)]))
    assert problems == ["event 0 (before_use slot 0 gen 0 on MainThread): the slot is read before any load into it",
                        "slot 0: 1 read(s) never released"]
    problems = check_protocol(_events([("before_load", 1), ("before_use", 1)]))
    assert "read while a load into it is in flight" in problems[0]


def test_host_attention_keeps_attention_and_embedding_off_the_device() -> None:
    """A GPU with CPU attention: attention and embedding live in host RAM, never in a slot or the device budget."""
    shape = dense_shape("t", layers=4, attention=1000, mlp=8000, head=3000, embedding=3000, kv=10)
    gpu = PlacementPolicy(batch_size=2, num_batches=1, kv_capacity=16, unified_memory=False, host_attention=True)
    cpu = PlacementPolicy(batch_size=2, num_batches=1, kv_capacity=16, unified_memory=False)
    lean_gpu = place(shape, None, gpu, device_memory=10**9, host_memory=10**9)
    assert all(lean_gpu.tier(k) == "host" for k, _ in shape.parts if k.kind in ("attention", "embedding"))
    assert not any(lean_gpu.is_streamed(PartKey("attention", j)) for j in range(4))
    host_weights = 4 * 1000 + 3000
    assert lean_gpu.host_bytes() == host_weights + lean_gpu.policy.target_kv_cache_bytes(shape)
    # the smallest device budget: the ring alone (every ffn and the head stream), attention costing nothing there
    tight_gpu = place(shape, None, gpu, device_memory=2 * 8000, host_memory=10**9)
    assert tight_gpu.device_bytes() == 2 * 8000
    with pytest.raises(Exception, match="device"):
        place(shape, None, cpu, device_memory=2 * 8000, host_memory=10**9)  # attention must stream or stay there


@pytest.fixture(scope="module")
def minimum(tiny_models):  # noqa: ANN001, ANN201
    """(name, draft, batch, k) -> (the smallest budget an offloaded engine of it places, the budget with every
    weight resident)."""
    cache: dict[tuple, tuple[int, int]] = {}

    def get(*key) -> tuple[int, int]:  # noqa: ANN002
        if key not in cache:
            probe = Engine(_config(tiny_models, *key, "1GiB"))
            cache[key] = probe.minimum_device_memory(), probe.placement.device_bytes()
        return cache[key]

    return get


def _config(tiny_models, target: str, draft: str | None, batch: int, k: int, budget) -> EngineConfig:  # noqa: ANN001
    return EngineConfig(target=tiny_models[target], draft=tiny_models[draft] if draft else None,
                        max_batch_size=batch, num_draft_tokens=k if draft else None, max_seq_len=48,
                        device_memory=budget)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["llama", "mixtral"]), drafting=st.booleans(), batch=st.integers(1, 4),
       k=st.integers(1, 4), spare=st.floats(0.0, 0.5))
def test_the_pipeline_keeps_the_slot_protocol(tiny_models, minimum, single_thread, target, drafting, batch, k,
                                              spare) -> None:  # noqa: ANN001
    """Every read of a ring slot waits on the load it reads, every load on the release of the previous readers,
    for random plans (budget from the minimum halfway to every weight resident, batch, k, with or without a draft)."""
    draft = "qwen2_draft" if drafting else None
    lo, hi = minimum(target, draft, batch, k)
    budget = lo + int((hi - lo) * spare)
    sync = RecordingSlotSync()
    engine = Engine(_config(tiny_models, target, draft, batch, k, budget),
                    workers=functools.partial(local_workers, sync=sync))
    assert engine.placement.streamed_layers  # (short of every weight resident, layers stream)
    engine.generate(OFFLOAD_PROMPTS[:5], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    engine.close()
    assert check_protocol(sync.log) == []
    calls = {e.call for e in sync.log}
    assert calls == {"before_load", "after_load", "before_use", "after_use"}
    reads = [e for e in sync.log if e.call == "before_use"]
    assert {e.thread for e in reads} <= {"specoffload-device", "specoffload-cpu"}
    assert max(e.generation for e in sync.log) >= 2  # slots were reused


def test_a_unit_whose_parts_all_load_later_still_claims_its_slot(tiny_models, single_thread) -> None:
    """Mixtral with routed experts loaded inside the ffn (`selected` loading) at batch 1: the load op has no parts,
    yet it claims the slot, so the ffn's read follows a load of that slot (found by the property test above)."""
    sync = RecordingSlotSync()
    config = _config(tiny_models, "mixtral", None, 1, 1, "1GiB")
    lo = Engine(config).minimum_device_memory()
    engine = Engine(_config(tiny_models, "mixtral", None, 1, 1, lo), workers=functools.partial(local_workers,
                                                                                               sync=sync))
    engine.generate(OFFLOAD_PROMPTS[:2], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    engine.close()
    assert check_protocol(sync.log) == []
