#!/usr/bin/env python3
"""Drafters compared in one run (issues 22, 40): none / ngram / suffix / lowbit, and model / self where the target
allows, on summaries (aclsum), code (HumanEval) and chat (sharegpt), the target streamed from disk under one budget.

Per workload and system: each batch of --batches and each k its --systems entry names (NAME@K1/K2; default -k) (a
drafting system's best (batch, k) is kept;
every system measured under the same budget; "lowbit" runs one batch drafting between its passes: with a job of
--prompts rows, two interleaved batches would halve the rows each pass verifies), --reps repetitions alternating the
systems' order; EOS honoured. Reports tokens/s (median and spread),
the acceptance rate, tokens committed per row per pass, row-tokens verified per row per pass (1 + drafts fed),
the drafter's microseconds per row-round (its draft ops' wall time over the rows it proposed for), the draft's share
of the wall time (the trace's draft spans over it), and whether the
greedy outputs equal no-draft's (bf16 may flip near-ties: a pass over several tokens does not round like one per
token), and from the trace the no-draft pass's loader time over its compute time (attention + ffn + head) at its
best batch: the bound on what any drafter can gain there (`io_over_compute_nodraft_<workload>`; a drafter's gain
is at most min(its tokens per row-pass E[n], that ratio), `modelfree_bound_<workload>`).

Then, unless --no-pick, the planner's own pick (`--drafter auto`, runtime/drafter_choice.py: each candidate of
--systems measured on the workload's prompts, planned from the hardware profile, the best predicted one chosen at
its batch and k) is run --reps times: `planner_pick_over_best_<workload>` is its tokens/s over the best measured
(system, batch) of the grid.

Writes docs/perf/<out>.json with a top-level "summary": <system>_over_nodraft_<workload> (each at its own best
batch and k), <system>_over_best_other_<workload> (over the best other drafting system),
best_modelfree_over_nodraft_<workload>, io_over_compute_nodraft_<workload>, modelfree_bound_<workload>,
planner_pick_over_best_<workload>, and the issue's own io_over_compute_nodraft (summaries) and planner_pick_over_best
(the lowest workload); every key ends in --tag (e.g. "_roomy" for a run at a budget with rows to spare). The JSON
records the machine, torch, dtype, commit and full argv (scripts/common.py `run_meta`) and its start and end.
`--resummarize JSON` rewrites a saved run's summary from its rows (`summarize`), measuring nothing.

    python -m scripts.bench_drafters [--target moefied|dense|small|DIR] [--budget 2.5GiB] [--tag _roomy] [--quick]

--quick: the 0.5B dense target, 4 prompts per workload (aclsum and HumanEval, the shortest), 24 new tokens,
batch 4, none / ngram / suffix, 1 rep: a smoke run of the whole path, not the issue's measurement (that is the
default: moefied, 16 prompts, 96 new tokens, batches 4, 8, 16, 2 reps; about an hour per workload on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from scripts.common import (
    PERF,
    io_compute_seconds,
    median_spread,
    run_meta,
    timed_generate,
    utc_now,
    workload_prompts,
    write_json,
)
from scripts.get_models import model_dir
from specoffload.planner.units import format_bytes, parse_bytes
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams

TARGETS = {"dense": "target", "moefied": "qwen2.5-coder-1.5b-moefied", "small": "qwen2.5-coder-0.5b-instruct"}


def run(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> dict:
    def extra(engine: Engine, _: float) -> dict:
        stats = engine.last_stats
        log = engine.pipeline.verify_log
        row_passes = sum(rows for *_, rows in log) or 1
        drafter = engine.workers.drafter
        asked = getattr(drafter, "proposed", 0)  # rows a model-free drafter proposed for (round-start calls)
        io_s, compute_s = io_compute_seconds(engine)
        draft_span_s = sum(s.end - s.start for s in engine.tracer.spans if s.name == "draft") \
            if engine.tracer is not None else 0.0
        return {"batch": engine.plan.batch, "k": engine.plan.k, "io_s": io_s, "compute_s": compute_s,
                "draft_span_s": draft_span_s, "copies": getattr(drafter, "copies", None),
                "io_over_compute": io_s / compute_s if compute_s else None,
                "verified_per_row_pass": 1 + stats.num_drafted / row_passes, "draft_s": stats.draft_s,
                "draft_us_per_row_round": 1e6 * stats.draft_s / asked if asked else None,
                "matched_rate": getattr(drafter, "matched", 0) / asked if asked else None}

    return timed_generate(config, prompts, params, extra=extra)


def _row(workload: str, system: str, batch: int, runs: list[dict]) -> dict:
    """One (workload, system, batch, k) row of the JSON from its repetitions (medians of tokens/s, io / compute and
    the draft's share of the wall time)."""
    med, lo, hi = median_spread(r["tok_s"] for r in runs)
    first = runs[0]
    ratios = [r["io_over_compute"] for r in runs if r["io_over_compute"] is not None]
    shares = [r["draft_span_s"] / r["wall_s"] for r in runs if r.get("draft_span_s") is not None]
    return {"workload": workload, "system": system, "batch": batch, "k": first["k"], "tok_s_median": med,
            "tok_s_min": lo, "tok_s_max": hi, "passes": first["passes"], "acceptance": first["acceptance"],
            "committed_per_row_pass": first["committed_per_row_pass"],
            "verified_per_row_pass": first["verified_per_row_pass"],
            "draft_us_per_row_round": first["draft_us_per_row_round"], "matched_rate": first["matched_rate"],
            "io_over_compute": statistics.median(ratios) if ratios else None, "tokens": first["tokens"],
            "draft_share": statistics.median(shares) if shares else None, "copies": first.get("copies")}


def _pick(workload: str, config: EngineConfig, names: list[str], prompts: list[list[int]], params: SamplingParams,
          reps: int) -> dict:
    """The planner's pick among `names` (`--drafter auto`: measured on these prompts, planned from the profile),
    run `reps` times; its JSON row, with the comparison table the planner printed."""
    from specoffload.runtime.drafter_choice import choose_drafter
    from specoffload.runtime.models.model import Transformer
    from specoffload.runtime.offload.profiler import load_or_measure

    profile = load_or_measure(config, log=lambda m: print(f"  {m}", flush=True), open_engine=Engine)
    choice = choose_drafter(config, Transformer(config.target, dtype=config.torch_dtype), prompts, params,
                            config.max_seq_len, profile, names=names)
    print(f"  planner's pick: {choice.best.drafter}, batch {choice.best.plan.batch}, k {choice.best.plan.k} (measured "
          f"in {choice.seconds:.0f} s)\n{choice.table()}", flush=True)
    chosen = choice.config(config)
    runs = []
    for rep in range(reps):
        runs.append(run(chosen, prompts, params))
        print(f"  pick {choice.best.drafter} rep {rep}: {runs[-1]['tok_s']:.2f} tok/s", flush=True)
    return _row(workload, f"pick:{choice.best.drafter}", choice.best.plan.batch, runs) | {
        "predicted_tok_s": choice.best.predicted, "choice_s": choice.seconds, "table": choice.table()}


def best_of(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(workload, system) -> its row at its own best batch (highest median tokens/s)."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["workload"], r["system"])
        if key not in best or r["tok_s_median"] > best[key]["tok_s_median"]:
            best[key] = r
    return best


def summarize(rows: list[dict], picks: list[dict], tag: str = "") -> dict[str, float]:
    """The summary of a run's rows (every system x batch) and picks, each system at its own best batch: per
    workload <system>_over_nodraft_<w>, best_modelfree_over_nodraft_<w> (also as modelfree_over_nodraft_<w>: the
    issue names it both ways), io_over_compute_nodraft_<w> and modelfree_bound_<w> (the no-draft pass's trace; 0
    when nothing streams), planner_pick_over_best_<w>; then io_over_compute_nodraft (the summarization workload's)
    and planner_pick_over_best (the lowest over the workloads: the goal holds on every one). Every key + `tag`."""
    best = best_of(rows)
    summary: dict[str, float] = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        none = best.get((workload, "none"))
        if none is None:
            continue
        drafting = {name: r for (w, name), r in best.items() if w == workload and name != "none"}
        for name, r in drafting.items():
            summary[f"{name}_over_nodraft_{workload}"] = r["tok_s_median"] / none["tok_s_median"]
            others = [o["tok_s_median"] for n, o in drafting.items() if n != name]
            if others:
                summary[f"{name}_over_best_other_{workload}"] = r["tok_s_median"] / max(others)
        free = [best[(workload, n)] for n in ("ngram", "suffix") if (workload, n) in best]
        io = none["io_over_compute"]
        if free:
            top = max(free, key=lambda r: r["tok_s_median"])
            summary[f"best_modelfree_over_nodraft_{workload}"] = summary[f"modelfree_over_nodraft_{workload}"] = (
                top["tok_s_median"] / none["tok_s_median"])
            if io is not None:
                summary[f"modelfree_bound_{workload}"] = min(top["committed_per_row_pass"], io)
        if io is not None:
            summary[f"io_over_compute_nodraft_{workload}"] = io
        pick = next((p for p in picks if p["workload"] == workload), None)
        if pick is not None:
            grid = max(r["tok_s_median"] for r in rows if r["workload"] == workload)
            summary[f"planner_pick_over_best_{workload}"] = pick["tok_s_median"] / grid
    if "io_over_compute_nodraft_summarization" in summary:
        summary["io_over_compute_nodraft"] = summary["io_over_compute_nodraft_summarization"]
    ratios = [v for k, v in summary.items() if k.startswith("planner_pick_over_best_")]
    if ratios:
        summary["planner_pick_over_best"] = min(ratios)
    return {key + tag: value for key, value in summary.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="moefied", help="moefied | dense | small | a checkpoint directory")
    ap.add_argument("--budget", default="2.5GiB")
    ap.add_argument("--workloads", default="summarization,code,chat")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per workload (the shortest of the corpus's "
                                                               "first 4x as many)")
    ap.add_argument("--max-prompt-tokens", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batches", default="4,8,16")
    ap.add_argument("-k", type=int, default=4, help="k of a drafting system whose --systems entry names none")
    ap.add_argument("--systems", default=None, help="default: none,ngram,suffix,lowbit + model (dense) or self (MoE); "
                                                     "NAME@K1/K2 runs a drafting system at each k (its best kept)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="see the module docstring")
    ap.add_argument("--no-pick", action="store_true", help="skip the planner's pick (--drafter auto)")
    ap.add_argument("--tag", default="", help="suffix of every summary key, e.g. _roomy")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the target's compute dtype (float32 where the CPU has no native bfloat16 GEMM)")
    ap.add_argument("--out", default="drafters")
    ap.add_argument("--resummarize", metavar="JSON", help="only rewrite the summary of a saved run from its rows "
                                                          "(this script's summary keys changed after it ran)")
    args = ap.parse_args()
    if args.resummarize:
        path = Path(args.resummarize)
        saved = json.loads(path.read_text())
        saved["summary"] = summarize(saved["rows"], saved.get("picks", []), ap.parse_args(saved["argv"]).tag)
        print("summary:", {k: round(v, 3) for k, v in saved["summary"].items()})
        print(f"wrote {write_json(path, saved)}")
        return 0
    if args.quick:
        args.target, args.workloads, args.prompts, args.new_tokens = "small", "summarization,code", 4, 24
        args.batches, args.reps, args.systems, args.budget = "4", 1, "none,ngram,suffix", "800MiB"
        args.out = "scratch/drafters_quick"  # a smoke run never takes a headline name
    target = model_dir(TARGETS[args.target]) if args.target in TARGETS else args.target
    from transformers import AutoTokenizer

    from specoffload.runtime.models.config import ModelConfig

    moe = bool(ModelConfig.from_dir(target).num_experts)
    meta = run_meta(args.dtype)  # machine, torch, dtype, commit, argv, start: before the runs
    entries = (args.systems.split(",") if args.systems else
               ["none", "ngram", "suffix", "lowbit", "self" if moe else "model"])
    systems = [e.split("@")[0] for e in entries]
    extra = {"none": dict(num_draft_tokens=0), "ngram": dict(drafter="ngram"), "suffix": dict(drafter="suffix"),
             "model": dict(draft=model_dir("draft")), "self": dict(drafter="self"),
             "lowbit": dict(drafter="lowbit", interleave=False)}
    grid = [(name, 0) if name == "none" else (name, int(k))
            for name, _, ks in (e.partition("@") for e in entries) for k in (ks.split("/") if ks else [args.k])]
    tok = AutoTokenizer.from_pretrained(target)
    budget = parse_bytes(args.budget)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)  # greedy, EOS honoured
    rows: list[dict] = []
    picks: list[dict] = []
    for workload in args.workloads.split(","):
        encoded = [tok.encode(p) for p in workload_prompts(workload)[: 4 * args.prompts]]
        prompts = sorted((p for p in encoded if len(p) <= args.max_prompt_tokens), key=len)[: args.prompts]
        print(f"\n{workload}: {len(prompts)} prompts (mean {statistics.fmean(map(len, prompts)):.0f} tokens), up to "
              f"{args.new_tokens} new, budget {format_bytes(budget)}, {args.reps} reps", flush=True)
        base = dict(target=target, device_memory=budget, replan_interval=0, dtype=args.dtype, trace=True,
                    max_seq_len=max(map(len, prompts)) + args.new_tokens)
        for batch in map(int, args.batches.split(",")):
            runs: dict[tuple[str, int], list[dict]] = {cell: [] for cell in grid}
            for rep in range(args.reps):
                for name, k in grid if rep % 2 == 0 else grid[::-1]:
                    kw = {"num_draft_tokens": k, **extra[name]}
                    r = run(EngineConfig(**base, max_batch_size=batch, **kw), prompts, params)
                    runs[name, k].append(r)
                    print(f"  batch {batch:2d} {name:7s} k {k} rep {rep}: {r['tok_s']:.2f} tok/s, {r['passes']} "
                          f"passes, {r['committed_per_row_pass']:.2f} committed / {r['verified_per_row_pass']:.2f} "
                          f"verified per row per pass", flush=True)
            reference = runs[grid[0]][0]["token_ids"]
            for (name, _), rs in runs.items():
                rows.append(_row(workload, name, batch, rs) | {"equal_to_" + systems[0]: rs[0]["token_ids"] ==
                                                               reference})
        if not args.no_pick:
            picks.append(_pick(workload, EngineConfig(**base, max_batch_size="auto", num_draft_tokens="auto",
                                                      interleave="auto"),
                               [n for n in systems if n in extra], prompts, params, args.reps))
    best = best_of(rows)
    print(f"\n{'workload':14s} {'system':7s} {'batch':>5s} {'k':>2s} {'tok/s (min-max)':20s} {'accept':>6s} "
          f"{'commit':>6s} {'verify':>6s} {'us/row':>7s} {'draft':>5s} {'io/cmp':>6s} equal")
    for r in [*best.values(), *picks]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        us = f"{r['draft_us_per_row_round']:.0f}" if r["draft_us_per_row_round"] is not None else "-"
        io = f"{r['io_over_compute']:.2f}" if r["io_over_compute"] is not None else "-"
        share = f"{r['draft_share']:.2f}" if r.get("draft_share") is not None else "-"
        print(f"{r['workload']:14s} {r['system']:7s} {r['batch']:5d} {r['k']:2d} {r['tok_s_median']:6.2f} "
              f"({r['tok_s_min']:.2f}-{r['tok_s_max']:.2f})     {acc:>6s} {r['committed_per_row_pass']:6.2f} "
              f"{r['verified_per_row_pass']:6.2f} {us:>7s} {share:>5s} {io:>6s} {r.get('equal_to_' + systems[0], '')}")
    summary = summarize(rows, picks, args.tag)
    print("summary:", {k: round(v, 3) for k, v in summary.items()})
    path = write_json(PERF / f"{args.out}.json", {
        **meta, "end": utc_now(), "argv": sys.argv[1:], "target": str(target), "budget": budget, "quick": args.quick,
        "note": "quick: a smoke run (0.5B dense, 4 short prompts, 24 new tokens, 1 rep), not the issue's measurement"
        if args.quick else "", "summary": summary, "best": list(best.values()), "picks": picks, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
