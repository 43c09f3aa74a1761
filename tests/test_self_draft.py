"""The resident-expert drafter (draft="self"): an MoE target drafts for itself with only some of its experts.

Lossless whatever it proposes (greedy equals the target's own decoding, token for token; seeded sampling is
reproducible), accepts everything when every expert is resident, migrates its resident set toward the experts
the target routes to, is counted by placement, and runs behind the same wire interface as any drafter.
"""

from __future__ import annotations

import pytest
import torch

from specoffload.planner.shapes import self_draft_shape
from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.models.config import ModelConfig
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.offload.drafters.resident_experts import ResidentExpertDrafter
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS

PROMPTS = OFFLOAD_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)  # as conftest's resident_greedy


@pytest.fixture
def reference(resident_greedy):
    """Greedy tokens of the resident Engine, per target model (shared across test modules)."""
    return resident_greedy


def _config(tiny_models, target: str, **kw) -> EngineConfig:
    """The self-drafting config; its drafter's options (resident_experts, migrate_interval) may be given as keywords."""
    base = dict(target=tiny_models[target], draft="self", max_batch_size=3, max_seq_len=48, num_draft_tokens=3,
                device_memory="1GiB")
    options = {k: kw.pop(k) for k in ("resident_experts", "migrate_interval") if k in kw}
    return EngineConfig(**(base | kw), drafter_options=options)


def _min_budget(tiny_models, target: str, **kw) -> int:
    return Engine(_config(tiny_models, target, **kw)).minimum_device_memory()


@pytest.mark.parametrize("target", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("resident", [1, 2, 4])
def test_self_draft_is_lossless_at_the_minimum_budget(tiny_models, reference, single_thread, target, resident):
    """One ring slot, so that the cheapest plan of these tiny models streams their experts (with two slots keeping
    everything resident is cheaper once the drafter's shared parts are pinned)."""
    budget = _min_budget(tiny_models, target, resident_experts=resident, num_buffers=1)
    engine = Engine(_config(tiny_models, target, resident_experts=resident, device_memory=budget, migrate_interval=2,
                            num_buffers=1))
    pinned = [key for key in engine.placement.tiers if key.kind in ("attention", "router", "dense_mlp", "head")]
    assert not any(engine.placement.is_streamed(key) for key in pinned)  # the drafter shares them
    assert engine.placement.streamed_layers and engine.placement.device_bytes() <= budget
    out = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == reference(target)
    stats = engine.last_stats
    assert stats.num_drafted > 0 and stats.expert_picks > 0 and stats.migrations >= 1
    if resident == 4:  # every expert resident: the drafter is the target, every draft is accepted
        assert stats.num_accepted == stats.num_drafted and stats.expert_hit_rate == 1.0
    else:
        assert 0.0 < stats.expert_hit_rate < 1.0
    hotness = stats.expert_hotness
    cfg = ModelConfig.from_dir(tiny_models[target])
    assert len(hotness) == cfg.num_layers and all(len(layer) == 4 for layer in hotness if layer)
    # every valid token of every pass picks top_k experts in every MoE layer
    assert sum(hotness[0]) == stats.expert_picks // sum(1 for layer in hotness if layer)


def test_seeded_sampling_with_self_draft_is_reproducible(tiny_models, single_thread):
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = Engine(_config(tiny_models, "qwen2_moe", resident_experts=2))
        runs.append([r.token_ids for r in engine.generate(PROMPTS, params)])
        assert engine.last_stats.num_drafted > 0
    assert runs[0] == runs[1] and all(len(t) == 8 for t in runs[0])


def test_migration_moves_the_resident_set_to_the_hottest_experts(tiny_models, single_thread):
    """Literal routing counts: layer 0's traffic goes to experts 2 and 3, so one resident expert (0) is replaced
    by the hottest (3), its bytes are counted, and the drafter now routes there; a small gain is not worth it."""
    drafter = ResidentExpertDrafter(_config(tiny_models, "mixtral", resident_experts=1))
    assert drafter.resident == {0: [0], 1: [0]}
    counts = [[1, 0, 5, 30], [10, 0, 0, 0]]
    hits, picks, moved_bytes, moved = drafter.adapt(counts)
    assert (hits, picks, moved) == (1 + 10, 36 + 10, 1)
    assert moved_bytes == drafter.model.loader.nbytes(drafter.model.loader.parts()[3]) > 0  # one expert's bytes
    assert drafter.resident == {0: [3], 1: [0]}
    assert drafter.allowed[0].tolist() == [False, False, False, True]
    from specoffload.planner.shapes import PartKey

    assert PartKey("expert", 0, 3) in drafter.model.resident and PartKey("expert", 0, 0) not in drafter.model.resident
    # decayed heat of layer 1 still favours expert 0: nothing moves
    assert drafter.adapt([[0, 0, 0, 0], [0, 1, 0, 0]])[2:] == [0, 0]


def test_restricted_routing_only_uses_allowed_experts(tiny_models):
    model = Transformer(tiny_models["qwen2_moe"])
    picked: list[torch.Tensor] = []
    model.on_route = lambda layer, ids: picked.append(ids)
    allowed = torch.tensor([False, True, False, False])
    ids = torch.tensor([PROMPTS[3]])
    full = model.forward(ids, model.new_cache(1, 8))
    picked.clear()
    moe_layers = [j for j in range(model.config.num_layers) if model.config.is_moe_layer(j)]
    restricted = model.forward(ids, model.new_cache(1, 8), allowed_experts=dict.fromkeys(moe_layers, allowed))
    assert len(picked) == len(moe_layers) >= 2
    assert all(set(p.unique().tolist()) == {1} for p in picked)  # top-2 with one allowed: both picks on it
    assert not torch.allclose(full, restricted)


def test_placement_counts_the_drafter_and_its_cache(tiny_models):
    """In this process the drafter drafts into the target's KV cache: placement counts its weights and no second
    cache. Its scratch positions live in the target cache's k + 1 speculative slack."""
    engine = Engine(_config(tiny_models, "mixtral", resident_experts=2))
    shape = self_draft_shape(engine.models.target, 2, shares_kv=True)
    assert engine.models.draft == shape and shape.kv_bytes_per_token == 0
    experts = [key for key, _ in shape.parts if key.kind == "expert"]
    assert sorted({key.expert for key in experts}) == [0, 1] and len(experts) == 2 * 2
    items = {item.name: item.nbytes for item in engine.placement.items}
    assert items["draft weights"] == shape.total_bytes and items["draft KV cache"] == 0
    assert engine.workers.drafter.target_kv is engine.workers.attention.caches
    own = self_draft_shape(engine.models.target, 2)  # a drafter in its own process (a backend role) keeps a cache
    assert own.kv_bytes_per_token == engine.models.target.kv_bytes_per_token


def test_drafting_into_the_target_cache_leaves_its_committed_state_alone(tiny_models, single_thread):
    """The scratch view writes past the committed positions of the shared storage and never moves the target
    cache's own lengths; the target's next pass overwrites the scratch."""
    from specoffload.runtime.kv_cache import KVCache

    target = KVCache(2, 2, 2, 4, capacity=16)
    target.advance(torch.tensor([5, 3]))
    view = target.scratch_view()
    view.write(0, torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4))
    view.advance(3)
    assert target.lengths.tolist() == [5, 3] and view.lengths.tolist() == [8, 6]
    assert view.k.data_ptr() == target.k.data_ptr() and float(target.k[0, 0, 0, 5:8].sum()) == 12.0
    with pytest.raises(Exception, match="holds 16"):
        view.ensure_capacity(17)  # a view never reallocates the shared storage


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(target="llama"), "needs an MoE target"),
        (dict(target="mixtral", resident_experts=5), "has 4 experts per layer"),
    ],
)
def test_bad_self_draft_configs_are_one_line(tiny_models, kwargs, match):
    target = kwargs.pop("target")
    with pytest.raises(ConfigError, match=match):
        Engine(_config(tiny_models, target, **kwargs))


def test_self_draft_needs_a_budget(tiny_models):
    with pytest.raises(ConfigError, match="needs device_memory"):
        EngineConfig(tiny_models["mixtral"], draft="self")


def test_migration_is_traced_on_its_own_track_and_the_breakdown_adds_up(tiny_models, single_thread):
    engine = Engine(_config(tiny_models, "qwen2_moe", resident_experts=1, migrate_interval=1, trace=True))
    engine.generate(PROMPTS, GREEDY)
    spans = [s for s in engine.tracer.spans if s.name == "migrate"]
    assert len(spans) == engine.last_stats.migrations >= 2 and {s.resource for s in spans} == {"migrate"}
    table = engine.tracer.breakdown()
    assert "migrate" in [usage.resource for usage in table.resources]
    for usage in table.resources:
        assert usage.busy + usage.idle == pytest.approx(table.wall, abs=1e-9)
    assert sum(t for _, t in table.overlap) == pytest.approx(table.wall, abs=1e-9)


def test_the_planner_weighs_self_drafting_against_no_draft_from_its_measured_acceptance(tiny_models, caplog):
    """A synthetic MoE far larger than its budget, on an io-bound profile (slow stream, fast compute): a
    resident-expert drafter whose drafts are all accepted beats no draft (9 tokens per row per pass for a little
    more io); the same drafter at acceptance 0.05 still runs, as it was asked for (k >= 1), and one line says that
    the planner predicts no draft to be faster. The drafting plan carries its resident experts."""
    from specoffload.planner import HardwareProfile, Workload
    from specoffload.planner.shapes import ModelShape, PartKey
    from specoffload.runtime.planning import ModelPair, make_plan

    parts = [(PartKey("embedding"), 10_000)]
    for j in range(4):
        parts += [(PartKey("attention", j), 10_000), (PartKey("router", j), 100)]
        parts += [(PartKey("expert", j, e), 1_000_000) for e in range(8)]
    target = ModelShape("big-moe", (*parts, (PartKey("head"), 10_000)), 4, 64)
    io_bound = HardwareProfile(
        provenance={"synthetic": True}, device="cpu", shared_compute=True, weights_tier="disk",
        stream_bytes_per_s=1e7, ffn_flops_per_s=((1, 1e12), (256, 1e13)), attention_fit=(1e-7, 0.0, 0.0),
        draft_step_s=((1, 1e-6), (64, 1e-5)),
    )
    path = tiny_models["mixtral"]  # only its config is read: the shapes above stand for the model
    budget = 24_000_000  # the ring alone (two whole-layer slots) is 16 MB
    none = ModelPair(target, None, model_context=64, dtype_bytes=2, top_k=2)
    selfish = ModelPair(target, self_draft_shape(target, 1), model_context=64, dtype_bytes=2, top_k=2, draft_top_k=1,
                        self_draft_experts=1)
    base = EngineConfig(path, device_memory=budget, max_seq_len=48)
    self_config = EngineConfig(path, draft="self", drafter_options={"resident_experts": 1}, device_memory=budget,
                               max_seq_len=48)
    workload = Workload(num_prompts=64, prompt_len=8, new_tokens=32)

    no_draft = make_plan(base, none, 48, workload=workload, alpha=0.0, profile=io_bound)
    drafting = make_plan(self_config, selfish, 48, workload=workload, alpha=1.0, profile=io_bound)
    assert drafting.policy.predicted_tokens_per_s > no_draft.policy.predicted_tokens_per_s
    assert drafting.k >= 1 and drafting.draft_experts == 1
    with caplog.at_level("WARNING", logger="specoffload.planning"):
        losing = make_plan(self_config, selfish, 48, workload=workload, alpha=0.05, profile=io_bound)
    assert losing.k >= 1 and losing.draft_experts == 1
    assert losing.policy.predicted_tokens_per_s < no_draft.policy.predicted_tokens_per_s
    warned = [r.getMessage() for r in caplog.records if "runs as asked" in r.getMessage()]
    assert len(warned) == 1 and "without a draft" in warned[0]
