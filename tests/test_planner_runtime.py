"""The runtime uses the planner: measured profile (cached), 'auto' batch size and k, online re-planning of k."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specoffload.planner import HardwareProfile
from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.offload import profiler
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import other_cores_busy

PROMPTS = [[1, 5 + i, 9, 33 + 2 * i, 70 + i][: 2 + i % 4] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def profile_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(profiler, "PROFILE_DIR", tmp_path / "profiles")
    return tmp_path / "profiles"


def test_profile_is_measured_once_then_reused(tiny_models, profile_dir, monkeypatch, single_thread):
    config = EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], device_memory="1GiB")
    first = profiler.load_or_measure(config, quick=True, open_engine=Engine)
    assert first.stream_bytes_per_s > 0 and first.attention_fit[0] >= 0 and len(first.draft_step_s) >= 2
    assert first.matches(profiler.fingerprint(config))
    assert list(profile_dir.glob("*.json"))

    def fail(*_a, **_k):
        raise AssertionError("measured again although a matching profile is cached")

    monkeypatch.setattr(profiler, "measure", fail)
    assert profiler.load_or_measure(config, open_engine=Engine) == first


def test_one_profile_serves_every_drafter(tiny_models, profile_dir, monkeypatch, single_thread):
    """The profile is the model's: a second drafter reuses it and only its own draft step is timed (once: cached
    beside the profile); a drafter with nothing to time gets the nominal step."""
    ngram = EngineConfig(tiny_models["llama"], drafter="ngram", device_memory="1GiB")
    model = EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], device_memory="1GiB")
    first = profiler.load_or_measure(ngram, quick=True, open_engine=Engine)
    assert first.draft_step_s == profiler.NOMINAL_DRAFT_STEP
    measured = []
    monkeypatch.setattr(profiler, "measure", lambda *a, **k: measured.append(1))
    timed = []
    real_steps = profiler._draft_steps
    monkeypatch.setattr(profiler, "_draft_steps", lambda *a, **k: timed.append(1) or real_steps(*a, **k))
    with_model = profiler.load_or_measure(model, quick=True, open_engine=Engine)
    assert not measured and timed == [1] and len(with_model.draft_step_s) >= 2
    assert replace(with_model, draft_step_s=first.draft_step_s) == first  # the rest is the same profile
    again = profiler.load_or_measure(model, open_engine=Engine)
    assert not measured and timed == [1] and again == with_model
    assert profiler.profile_path(ngram) == profiler.profile_path(model)


@pytest.mark.parametrize("drafter", ["model", "self", "lowbit"])
def test_a_timed_draft_step_runs_every_layer_on_a_token_per_row(tiny_models, monkeypatch, single_thread, drafter):
    """The profiler's draft step computes what a draft step computes: one valid token per row through every
    attention and FFN (a row fed no valid token skips its FFN, which timed steps 4-5x short), attending to the same
    context at every repetition."""
    from specoffload.runtime.models.model import Transformer

    target = "mixtral" if drafter == "self" else "llama"
    extra = {"draft": tiny_models["qwen2_draft"]} if drafter == "model" else {"drafter": drafter}
    config = EngineConfig(tiny_models[target], device_memory="1GiB", **extra)
    seen: list[tuple[int, int]] = []  # (rows the FFN computed, KV length) per layer call
    real_ffn = Transformer.ffn

    def ffn(self, layer, hidden, token_mask=None, allowed=None):  # noqa: ANN001, ANN202
        valid = hidden.shape[0] * hidden.shape[1] if token_mask is None else int(token_mask.sum())
        seen.append((valid, hidden.shape[0]))
        return real_ffn(self, layer, hidden, token_mask, allowed)

    monkeypatch.setattr(Transformer, "ffn", ffn)
    steps = profiler._draft_steps(config, profiler._Timer(1), quick=True)
    assert [rows for rows, _ in steps] == list(profiler.DRAFT_ROWS[:3]) and all(s > 0 for _, s in steps)
    assert seen and all(valid == rows for valid, rows in seen)  # every row's token reaches every FFN


def test_a_disturbed_measurement_is_taken_again_then_marked(tiny_models, profile_dir, monkeypatch, single_thread):
    """Other processes busy while it measures (a busy /proc/stat, simulated: one extra core busy): the isolated rates
    are taken MEASURE_TRIES times, the last is used for the job, saved as disturbed, and measured again by the next
    load; a quiet machine's profile is kept."""
    config = EngineConfig(tiny_models["llama"], device_memory="1GiB")
    other_cores_busy(monkeypatch)
    tries = []
    real_isolated = profiler._isolated
    monkeypatch.setattr(profiler, "_isolated", lambda *a, **k: tries.append(1) or real_isolated(*a, **k))
    lines: list[str] = []
    busy_profile = profiler.load_or_measure(config, quick=True, open_engine=Engine, log=lines.append)
    conditions = busy_profile.provenance["conditions"]
    assert len(tries) == profiler.MEASURE_TRIES and conditions["others_cores"] > 0.5
    assert "other processes kept" in conditions["disturbed"]
    assert sum(line.startswith("profile: the measurement was disturbed") for line in lines) == \
        profiler.MEASURE_TRIES - 1
    assert lines[-1].startswith("profile: disturbed (other processes kept")
    assert profiler.cached(config)[0] is None and "busy machine" in profiler.cached(config)[1]
    other_cores_busy(monkeypatch, 0.0)  # quiet again
    tries.clear()
    quiet = profiler.load_or_measure(config, quick=True, open_engine=Engine, log=lines.append)
    assert tries == [1] and not quiet.provenance["conditions"].get("disturbed")
    assert quiet.provenance["conditions"]["others_cores"] < 0.5
    assert profiler.cached(config)[0] == quiet


def test_a_job_that_finds_the_profile_off_marks_it_stale(tiny_models, profile_dir, single_thread, caplog):
    """A cached profile whose compute is ten times too fast for this machine: the job's passes say so in one line,
    the run goes on correctly, and the cached profile is measured again before the next engine uses it."""
    config = EngineConfig(tiny_models["llama"], device_memory="1GiB", max_seq_len=64, max_batch_size=2,
                          num_draft_tokens="auto", drafter="ngram")
    profile = profiler.load_or_measure(config, quick=True, open_engine=Engine)
    path = profiler.profile_path(config)
    replace(profile, provenance=dict(profile.provenance), draft_step_s=profile.draft_step_s
            ).scaled_compute(0.1).save(path)
    assert profiler.cached(config)[0] is not None
    engine = Engine(config)
    assert engine.replanner.profile is not None
    prompts = [[3 + i, 9, 27, 40 + i] for i in range(2)]
    with caplog.at_level("WARNING", logger="specoffload.offload"):
        out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    ref = Engine(EngineConfig(tiny_models["llama"], max_batch_size=2)).generate(prompts, greedy)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert engine.replanner.profile_off is not None and engine.replanner.profile_off > 1.25
    assert len([r for r in caplog.records if "hardware profile predicts" in r.getMessage()]) == 1
    cached, why = profiler.cached(config)
    assert cached is None and "marked stale" in why


def test_the_warm_up_corrects_an_off_profile_before_the_job_is_planned(tiny_models, profile_dir, single_thread,
                                                                      monkeypatch):
    """The warm-up's drafted passes check the profile (replan.py's table). A profile measured slow (ten times, as on
    a busy machine): one line says the job is planned with its compute costs scaled, and the cached profile is stale.
    A profile that predicts the drafted passes faster than they run: on a quiet machine the cost model's error at
    that shape (nothing scaled, the profile kept); with other processes busy, this job is planned with its costs
    scaled and the profile, measured quiet, is kept."""
    from specoffload.runtime.models.model import Transformer
    from specoffload.runtime.planning import ModelPair
    from specoffload.runtime.warmup import plan_job

    config = EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], device_memory="1GiB",
                          max_seq_len=48)
    profile = profiler.load_or_measure(config, quick=True, open_engine=Engine)
    models = ModelPair.for_config(config, Transformer(config.target), shares_kv=True)
    prompts = [[3 + i, 9, 27, 40 + i] for i in range(8)]

    def planned(prof):  # noqa: ANN001, ANN202
        prof.save(profiler.profile_path(config))  # (cached: what a stale mark removes)
        lines: list[str] = []
        job = plan_job(config, models, prompts, GREEDY, 48, profile=prof, log=lines.append)
        assert job.warmup is not None
        scaled = any(line.startswith("plan: searched with the profile's compute costs x") for line in lines)
        return job.warmup.compute_scale, scaled, profiler.cached(config)[0] is not None

    scale, scaled, kept = planned(profile.scaled_compute(10.0))
    assert scale < 1 / 1.25 and scaled and not kept  # measured slow: corrected, measured again next time
    scale, scaled, kept = planned(profile.scaled_compute(0.1))
    assert scale == 1.0 and not scaled and kept  # quiet: the drafted shape's error, the rates stand
    other_cores_busy(monkeypatch)
    scale, scaled, kept = planned(profile.scaled_compute(0.1))
    assert scale > 1.25 and scaled and kept  # busy now: this job corrected, the profile kept


def test_auto_policy_is_used_and_lossless(tiny_models, single_thread):
    ref = Engine(EngineConfig(tiny_models["llama"], max_batch_size=4)).generate(PROMPTS, GREEDY)
    config = EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], device_memory=1_400_000,
                          max_seq_len=48, num_draft_tokens="auto", max_batch_size="auto")
    engine = Engine(config)
    assert engine.plan.policy is not None and engine.plan.policy.predicted_tokens_per_s > 0
    assert engine.plan.batch == engine.plan.policy.decode_batch and engine.plan.k == engine.plan.policy.k
    assert engine.placement.device_bytes() <= 1_400_000
    out = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]


def test_online_replanning_raises_k_when_every_draft_is_accepted(tiny_models, single_thread, monkeypatch):
    """A self-draft accepts everything; starting at k = 1 (the initial search is restricted to it), the observed
    alpha of ~1 makes the online re-plan pick a larger k, and the output stays identical."""
    from specoffload.runtime import engine as engine_module
    from specoffload.runtime import planning

    real_search = planning.search
    monkeypatch.setattr(planning, "search", lambda profile, space: real_search(
        profile, replace(space, ks=(1,)) if space.draft is not None else space))  # (not the no-draft comparison)
    # An io-bound machine (slow stream, fast compute and draft), so that at alpha ~ 1 a longer k is clearly better
    # (tiny models measured on a shared CPU are too noisy to decide this reliably).
    io_bound = HardwareProfile(
        provenance={"synthetic": True}, device="cpu", shared_compute=True, weights_tier="disk",
        stream_bytes_per_s=1e6, ffn_flops_per_s=((1, 1e11), (256, 1e12)), attention_fit=(1e-6, 0.0, 0.0),
        draft_step_s=((1, 1e-5), (64, 1e-4)),
    )
    monkeypatch.setattr(engine_module, "load_or_measure", lambda *a, **kw: io_bound)
    target = tiny_models["llama"]
    ref = Engine(EngineConfig(target, max_batch_size=3)).generate(PROMPTS, GREEDY)
    probe = Engine(EngineConfig(target, draft=target, device_memory="1GiB", max_seq_len=48,
                                       max_batch_size=3))
    budget = probe.minimum_device_memory()
    engine = Engine(EngineConfig(target, draft=target, device_memory=budget, max_seq_len=48,
                                        max_batch_size=3, num_draft_tokens="auto", acceptance_prior=0.05,
                                        replan_interval=2))
    k0 = engine.replanner.k
    assert k0 == engine.plan.k == 1 and engine.plan.k_max > 1
    out = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert engine.replanner.replans, "no re-plan happened"
    assert engine.replanner.replans[-1]["alpha"] > 0.9
    assert engine.replanner.k > k0


def test_auto_without_a_budget_is_a_config_error(tiny_models):
    with pytest.raises(ConfigError, match="device_memory"):
        EngineConfig(tiny_models["llama"], num_draft_tokens="auto")


def test_a_planned_batch_is_never_larger_than_the_job(tiny_models):
    """Batch 'auto' searches batches up to the job's prompts only (no KV placed for rows that cannot exist), for
    every job size; the largest job gets the batches beyond it."""
    from specoffload.planner import Workload
    from specoffload.runtime.planning import ModelPair, make_plan
    from tests.conftest import dense_shape

    target = dense_shape("t", layers=4, attention=10_000, mlp=400_000, head=50_000, embedding=50_000, kv=64)
    profile = HardwareProfile(
        provenance={"synthetic": True}, device="cpu", shared_compute=True, weights_tier="disk",
        stream_bytes_per_s=1e7, ffn_flops_per_s=((1, 1e10), (256, 1e12)), attention_fit=(1e-7, 0.0, 0.0),
        draft_step_s=((1, 1e-6), (64, 1e-5)),
    )
    config = EngineConfig(tiny_models["llama"], device_memory="64MiB", max_seq_len=48, num_draft_tokens=0)
    models = ModelPair(target, None, model_context=64, dtype_bytes=2, top_k=0)
    batches = set()
    for rows in range(1, 21):
        plan = make_plan(config, models, 48, workload=Workload(num_prompts=rows, prompt_len=8, new_tokens=32),
                         profile=profile)
        assert plan.batch <= rows, (rows, plan.batch)
        batches.add(plan.batch)
    assert max(batches) > 4  # (the profile makes large batches pay: the cap is what held them)
