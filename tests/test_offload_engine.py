"""The offloaded pipeline reproduces the resident Engine token for token, at every budget that fits."""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import replace

import pytest
import torch

from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.placement import PlacementError
from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Engine, PromptError
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS

PROMPTS = OFFLOAD_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)  # as conftest's resident_greedy


@pytest.fixture
def reference(resident_greedy):
    """Greedy tokens of the resident Engine, per target model (shared across test modules)."""
    return resident_greedy


def _config(tiny_models, target: str, draft: str | None, **kw) -> EngineConfig:
    base = dict(target=tiny_models[target], draft=tiny_models[draft] if draft else None, max_batch_size=3,
                max_seq_len=48, num_draft_tokens=3)
    return EngineConfig(**(base | kw))


def _budgets(tiny_models, target: str, draft: str | None, **kw) -> list[int]:
    """The minimum budget, one in between, and the budget with everything resident."""
    probe = Engine(_config(tiny_models, target, draft, device_memory="1GiB", **kw))
    lo = probe.minimum_device_memory()
    hi = probe.placement.device_bytes()
    return sorted({lo, (2 * lo + hi) // 3, hi})


@pytest.mark.parametrize("target", ["llama", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("draft", [None, "qwen2_draft", "self"])
def test_disk_tier_matches_resident_engine_at_every_budget(tiny_models, reference, single_thread, target, draft):
    draft = target if draft == "self" else draft  # a self-draft accepts everything: the acceptance path
    budgets = _budgets(tiny_models, target, draft)
    streamed_somewhere = False
    for budget in budgets:
        engine = Engine(_config(tiny_models, target, draft, device_memory=budget))
        out = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        assert out == reference(target), f"budget {budget}: {engine.describe_placement()}"
        assert engine.placement.device_bytes() <= budget
        stats = engine.last_stats
        assert stats.generated_tokens == sum(len(t) for t in out)
        if engine.placement.streamed_layers:
            streamed_somewhere = True
            assert stats.bytes_read > 0
        if draft == target:
            assert stats.num_accepted == stats.num_drafted > 0
    assert streamed_somewhere, "the smallest budget must stream something"


@pytest.mark.parametrize("target", ["llama", "qwen2_moe"])
def test_ram_tier_matches_resident_engine(tiny_models, reference, single_thread, target):
    # host_memory given: device_memory covers the device tier only, the streamed weights live in host RAM
    kw = dict(weights_tier="ram", host_memory="1GiB")
    lo = _budgets(tiny_models, target, "qwen2_draft", **kw)[0]
    engine = Engine(_config(tiny_models, target, "qwen2_draft", device_memory=lo, **kw))
    assert engine.placement.streamed_layers
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == reference(target)
    assert engine.last_stats.bytes_read > 0


@pytest.mark.parametrize("target", ["mixtral", "qwen2_moe"])
def test_selected_experts_only_loads_routed_experts(tiny_models, reference, single_thread, target):
    """Small batches load only the experts the router picks; outputs are unchanged and fewer bytes move."""
    probe = Engine(_config(tiny_models, target, None, device_memory="1GiB", max_batch_size=1))
    # the largest budget that streams experts while attention and routers stay resident
    budget = probe.placement.device_bytes()
    while budget > probe.minimum_device_memory():
        budget -= 4096
        plan = Engine(_config(tiny_models, target, None, device_memory=budget, max_batch_size=1)).placement
        if any(plan.is_streamed(k) for k in plan.tiers if k.kind == "expert"):
            break
    assert not any(plan.is_streamed(k) for k in plan.tiers if k.kind in ("attention", "router"))
    moved = {}
    for mode in ("all", "selected"):
        engine = Engine(
            _config(tiny_models, target, None, device_memory=budget, expert_loading=mode, max_batch_size=1)
        )
        assert engine.weight_plan.selected_experts == (mode == "selected")
        out = [r.token_ids for r in engine.generate(PROMPTS[:3], GREEDY)]
        assert out == reference(target)[:3]
        moved[mode] = engine.last_stats.bytes_read
    assert 0 < moved["selected"] < moved["all"]


def test_sampling_is_reproducible_with_a_seed(tiny_models, single_thread):
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        budget = _budgets(tiny_models, "llama", "qwen2_draft")[0]
        engine = Engine(_config(tiny_models, "llama", "qwen2_draft", device_memory=budget))
        runs.append([r.token_ids for r in engine.generate(PROMPTS, params)])
    assert runs[0] == runs[1]
    assert all(len(t) == 8 and all(0 <= x < 512 for x in t) for t in runs[0])


def test_budget_below_minimum_states_the_minimum(tiny_models):
    with pytest.raises(PlacementError, match=r"at least .*\(\d+ bytes\)"):
        Engine(_config(tiny_models, "llama", "qwen2_draft", device_memory="64KiB"))


def test_bad_memory_strings_are_config_errors(tiny_models):
    with pytest.raises(ConfigError, match="device_memory"):
        _config(tiny_models, "llama", None, device_memory="lots")
    with pytest.raises(ConfigError, match="weights_tier"):
        _config(tiny_models, "llama", None, device_memory="1GiB", weights_tier="tape")


def test_prompt_longer_than_max_seq_len_is_a_prompt_error(tiny_models):
    engine = Engine(_config(tiny_models, "llama", None, device_memory="1GiB", max_seq_len=8))
    with pytest.raises(PromptError, match="max_seq_len"):
        engine.generate([list(range(3, 20))], GREEDY)


def test_truncated_checkpoint_mid_stream_is_a_clear_error_not_a_hang(tiny_models, tmp_path, single_thread):
    ckpt = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], ckpt)
    config = EngineConfig(ckpt, max_batch_size=3, max_seq_len=48, device_memory="1GiB")
    budget = Engine(config).minimum_device_memory()
    engine = Engine(EngineConfig(ckpt, max_batch_size=3, max_seq_len=48, device_memory=budget))
    assert engine.placement.streamed_layers
    file = next(ckpt.glob("*.safetensors"))
    with open(file, "r+b") as f:  # the file is cut after the engine validated its header
        f.truncate(file.stat().st_size // 2)
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            engine.generate(PROMPTS, GREEDY)
        except BaseException as exc:  # noqa: BLE001
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate hung on a truncated checkpoint"
    error = result.get("error")
    assert isinstance(error, SpecOffloadError)
    assert file.name in str(error) or file.name in str(error.__cause__)


def test_trace_covers_every_op_and_the_breakdown_adds_up(tiny_models, tmp_path, single_thread):
    budget = _budgets(tiny_models, "mixtral", "qwen2_draft")[0]
    engine = Engine(_config(tiny_models, "mixtral", "qwen2_draft", device_memory=budget, trace=True))
    engine.generate(PROMPTS, GREEDY)
    spans = engine.tracer.spans
    kinds = {s.name for s in spans}
    assert {"load", "embed", "attention", "ffn", "head", "verify", "draft"} <= kinds
    assert {s.resource for s in spans} == {"io", "cpu", "device"}
    table = engine.tracer.breakdown()
    for usage in table.resources:
        assert usage.busy + usage.idle == pytest.approx(table.wall, abs=1e-9)
    assert sum(t for _, t in table.overlap) == pytest.approx(table.wall, abs=1e-9)
    path = engine.tracer.save_chrome_trace(tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(spans)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("budget", [None, "1GiB"])
def test_cuda_without_a_gpu_is_one_line(tiny_models, budget):
    """device='cuda' on a machine whose torch sees no GPU: one line saying so, before any profile is measured or
    weight read (scripts/gpu_check.py runs the CUDA path where there is one)."""
    with pytest.raises(ConfigError, match="sees no CUDA GPU; use device='cpu'"):
        Engine(EngineConfig(tiny_models["llama"], device_memory=budget, device="cuda"))


@pytest.mark.parametrize("target", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize(("draft", "group"), [(None, 1), ("qwen2_draft", 2), ("self", 1)])
def test_expert_groups_shrink_the_ring_and_change_no_token(tiny_models, reference, single_thread, target, draft, group):
    """A streamed MoE layer loaded in units of `group` experts, its ffn run one unit after another: the ring slot
    holds a group instead of a layer (smaller), and the greedy tokens equal the resident engine's."""
    base = _config(tiny_models, target, None, device_memory="1GiB")
    if draft == "self":  # one slot: with the drafter's shared parts pinned, streaming is then the cheapest plan
        base = replace(base, draft="self", drafter_options={"resident_experts": 1}, num_buffers=1)
    elif draft is not None:
        base = replace(base, draft=tiny_models[draft])
    whole = Engine(replace(base, device_memory=Engine(base).minimum_device_memory()))
    grouped = replace(base, expert_group=group)
    budget = Engine(grouped).minimum_device_memory()
    engine = Engine(replace(grouped, device_memory=budget))
    assert engine.placement.streamed_layers and budget < whole.placement.device_memory
    assert engine.placement.slot_bytes < whole.placement.slot_bytes
    assert max(g for _, g in engine.weight_plan.units()) >= 1  # some layer really streams in several units
    out = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert out == reference(target)
    assert engine.last_stats.bytes_read > 0


@pytest.mark.parametrize(("target", "draft"), [("llama", "qwen2_draft"), ("qwen2_moe", "qwen2_draft"),
                                               ("mixtral", "self")])
def test_one_batch_drafting_between_its_passes_is_lossless(tiny_models, reference, single_thread, target, draft):
    """interleave=False: one batch, its drafts between its own passes; the KV of one batch instead of two."""
    kw = (dict(draft="self", drafter_options={"resident_experts": 2}, num_buffers=1) if draft == "self"
          else dict(draft=tiny_models[draft]))
    base = replace(_config(tiny_models, target, None, device_memory="1GiB"), interleave=False, **kw)
    budget = Engine(base).minimum_device_memory()
    engine = Engine(replace(base, device_memory=budget))
    assert engine.plan.num_batches == 1
    interleaved = Engine(replace(base, interleave=True))
    assert budget < interleaved.minimum_device_memory()  # one batch's KV caches instead of two
    out = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == reference(target)
    assert engine.last_stats.num_drafted > 0


def test_a_bfloat16_draft_beside_a_float32_target_is_lossless_and_half_the_memory(tiny_models, reference,
                                                                                 single_thread):
    base = _config(tiny_models, "llama", "qwen2_draft", device_memory="1GiB")
    fp32 = Engine(base)
    bf16 = Engine(replace(base, draft_dtype="bfloat16"))
    items = {name: {i.name: i.nbytes for i in e.placement.items} for name, e in (("fp32", fp32), ("bf16", bf16))}
    assert items["bf16"]["draft weights"] * 2 == items["fp32"]["draft weights"]
    assert items["bf16"]["draft KV cache"] * 2 == items["fp32"]["draft KV cache"]
    assert bf16.workers.drafter.model.dtype == torch.bfloat16 and bf16.models.draft_dtype_bytes == 2
    assert [r.token_ids for r in bf16.generate(PROMPTS, GREEDY)] == reference("llama")
    assert bf16.last_stats.num_drafted > 0
