#!/usr/bin/env python3
"""Continuous batching (issue 21): row refill on against off, in one run, alternating, on an EOS-honoured job.

The same engine config (target streamed from disk under one budget, one batch cap, no draft or the 0.5B draft),
with `refill=True` (a finished row's slot takes a waiting prompt at once) and `refill=False` (a batch waits for its
slowest row, then takes a new wave). HumanEval prompts by default (--corpus: aclsum summaries or ShareGPT chat,
in corpus order, each at most --max-prompt-tokens), EOS honoured, so rows end anywhere up to --new-tokens.
Reports tokens/s (median and spread over the repetitions), target passes, tokens committed per row per pass,
greedy tokens equal across the two, and the ideal gain: the passes one batch needs for the measured row lengths
in waves over those it needs with refill (list scheduling; one token per row per pass). Writes
docs/perf/<out>.json with a top-level "summary" and <out>.png (tokens committed over time).

    python -m scripts.bench_refill [--target dense|moefied|DIR] [--budget 4.5GiB] [--batch 8] [--corpus code]
                                   [--dtype float32] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from scripts.bench_offload import roofline
from scripts.common import PERF, WORKLOADS, figure, median_spread, timed_generate, utc_now, workload_prompts, write_json
from scripts.get_models import model_dir
from specoffload.planner.units import format_bytes, parse_bytes
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams

TARGETS = {"dense": "target", "moefied": "qwen2.5-coder-1.5b-moefied"}


def run(config: EngineConfig, prompts: list[list[int]], params: SamplingParams, plan: object = None) -> dict:
    def extra(engine: Engine, start: float) -> dict:
        pipeline = engine.pipeline
        log = pipeline.verify_log
        timeline, total = [], 0
        for at, _, tokens, _ in log:  # (seconds since the start, tokens committed so far) per verified pass
            total += tokens
            timeline.append((round(at - start, 3), total))
        return {"refilled": pipeline.batches.refilled, "preempted": pipeline.batches.preempted, "timeline": timeline}

    return timed_generate(config, prompts, params, plan, extra)


def ideal_passes(lengths: list[int], batch: int) -> tuple[int, int]:
    """Passes one batch of `batch` rows needs for rows of these lengths (one token per row per pass, the first at
    its prefill pass), in input order: (waves: each wave lasts its longest row; refill: a finished row's slot takes
    the next prompt at the next pass, i.e. list scheduling). Their ratio bounds what refill can gain."""
    waves = sum(max(lengths[i: i + batch]) for i in range(0, len(lengths), batch))
    free = [0] * min(batch, len(lengths))  # the pass at which each slot is free
    for n in lengths:
        slot = min(range(len(free)), key=free.__getitem__)
        free[slot] += n
    return waves, max(free)


def planned_chunk(config: EngineConfig, prompts: list[list[int]], new_tokens: int) -> int | None:
    """The per-pass prompt token budget the planner sets for this config's refilled batch (planner/cost.py
    `prefill_budget`: what the compute headroom under the pass's io holds), from the measured hardware profile,
    the prompts' lengths and new_tokens as the mean output (no warm-up); None when nothing streams."""
    from specoffload.planner.cost import Workload, steady_pass
    from specoffload.planner.plan import fixed_plan
    from specoffload.runtime.models.model import Transformer
    from specoffload.runtime.offload.profiler import load_or_measure
    from specoffload.runtime.planning import ModelPair, place_plan

    profile = load_or_measure(config, open_engine=Engine, log=print)
    models = ModelPair.for_config(config, Transformer(config.target, dtype=config.torch_dtype), shares_kv=True)
    batch, k = int(config.max_batch_size), int(config.num_draft_tokens)
    plan = fixed_plan(batch, k, config.max_seq_len)
    placement = place_plan(config, plan, models)
    workload = Workload.of_prompts([len(p) for p in prompts], new_tokens)
    return steady_pass(profile, models.costs(plan.drafting), placement, batch, k, 0.8, workload).prefill_chunk


def vs_main(args: argparse.Namespace, target: Path, draft: Path, prompts: list[list[int]], params: SamplingParams,
            budget: int, roof: dict) -> int:
    """Block KV and refill together against main's contiguous KV in waves, each at the planner's batch for the job
    (its own best under the same budget): `new_over_main_<system>` and `kv_rows_gain`."""
    from specoffload.planner.cost import Workload
    from specoffload.planner.kv_budget import kv_rows
    from specoffload.runtime.models.model import Transformer
    from specoffload.runtime.offload.profiler import load_or_measure
    from specoffload.runtime.planning import ModelPair
    from specoffload.runtime.warmup import plan_job

    job_len = max(map(len, prompts)) + args.new_tokens  # what `specoffload generate` sizes a row for
    max_seq_len = args.max_seq_len or job_len
    base = dict(target=target, device_memory=budget, max_batch_size="auto", replan_interval=0,
                max_seq_len=max_seq_len, dtype=args.dtype)
    arms = {"main": dict(kv_block_size=0, refill=False), "new": dict(kv_block_size=args.block_size, refill=True)}
    systems = {"nodraft": dict(num_draft_tokens=0), "draft": dict(draft=draft, num_draft_tokens=args.k)}
    shape_model = Transformer(target, dtype=EngineConfig(target=target, dtype=args.dtype).torch_dtype)
    rows, summary = [], {}
    for name in args.systems.split(","):
        plans = {}
        for arm, extra in arms.items():
            config = EngineConfig(**base, **systems[name], **extra)
            profile = load_or_measure(config, open_engine=Engine, log=print)
            models = ModelPair.for_config(config, shape_model, shares_kv=True)
            start = time.perf_counter()
            job = plan_job(config, models, prompts, params, max_seq_len, profile=profile)
            plans[arm] = (config, job)
            print(f"  {name} {arm}: {job.plan.describe()} (planned in {time.perf_counter() - start:.0f} s, "
                  f"mean new tokens {job.workload.mean_new_tokens:.1f})", flush=True)
        runs: dict[str, list[dict]] = {"main": [], "new": []}
        for rep in range(args.reps):
            for arm in (("main", "new") if rep % 2 == 0 else ("new", "main")):  # ABBA
                config, job = plans[arm]
                engine_start = time.perf_counter()
                r = run(config, prompts, params, plan=job.plan)
                runs[arm].append(r)
                print(f"  {name:8s} {arm:4s} rep {rep}: {r['tok_s']:.2f} tok/s, batch {job.plan.batch}, "
                      f"{r['passes']} passes, {r['preempted']} preempted ({time.perf_counter() - engine_start:.0f} s)",
                      flush=True)
        same = all(r["token_ids"] == runs["main"][0]["token_ids"] for r in runs["main"] + runs["new"])
        reference = runs["main"][0]["token_ids"]
        for arm, rs in runs.items():
            # rows whose greedy tokens differ from main's first repetition, and the first position where they do
            differ = {n: next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                      for n, (x, y) in enumerate(zip(reference, rs[0]["token_ids"])) if x != y}
            reps_agree = all(r["token_ids"] == rs[0]["token_ids"] for r in rs)
            config, job = plans[arm]
            med, lo, hi = median_spread(r["tok_s"] for r in rs)
            rows.append({"system": name, "arm": arm, "batch": job.plan.batch, "k": job.plan.k,
                         "kv_block_size": config.kv_block_size, "refill": config.refill,
                         "kv_expected_tokens": job.plan.kv_expected_tokens,
                         "mean_new_tokens_planned": job.workload.mean_new_tokens,
                         "tok_s_median": med, "tok_s_min": lo, "tok_s_max": hi, "passes": rs[0]["passes"],
                         "preempted": rs[0]["preempted"], "acceptance": rs[0]["acceptance"],
                         "committed_per_row_pass": rs[0]["committed_per_row_pass"], "tokens": rs[0]["tokens"],
                         "equal_tokens": same, "rows_differing_from_main": differ, "reps_agree": reps_agree,
                         "timeline": rs[0]["timeline"]})
        new, old = (next(r for r in rows if r["system"] == name and r["arm"] == a) for a in ("new", "main"))
        summary[f"new_over_main_{name}"] = new["tok_s_median"] / old["tok_s_median"]
        summary[f"batch_new_over_main_{name}"] = new["batch"] / old["batch"]
        if name == "nodraft":  # rows of target KV by blocks over by max_seq_len, at the job's expected use
            config, job = plans["new"]
            cfg = shape_model.config
            kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * config.torch_dtype.itemsize
            workload: Workload = job.workload
            gain = kv_rows(budget, kv_token, workload, max_seq_len, 0, args.block_size, workload.mean_new_tokens)
            summary["kv_rows_gain"] = gain.gain
            summary["kv_positions_by_blocks"] = gain.positions_by_blocks
            summary["kv_positions_by_max_seq_len"] = gain.positions_by_max_seq_len
            at_job = kv_rows(budget, kv_token, workload, job_len, 0, args.block_size, workload.mean_new_tokens)
            summary["kv_rows_gain_at_job_max_seq_len"] = at_job.gain  # (max_seq_len = longest prompt + new)
    print(f"\n{'system':8s} {'arm':5s} {'batch':>5s} {'tok/s (min-max)':22s} {'passes':>6s} {'preempted':>9s} "
          f"{'equal':>5s}")
    for r in rows:
        print(f"{r['system']:8s} {r['arm']:5s} {r['batch']:5d} {r['tok_s_median']:6.2f} ({r['tok_s_min']:.2f}-"
              f"{r['tok_s_max']:.2f}){'':6s} {r['passes']:6d} {r['preempted']:9d} {r['equal_tokens']!s:>5s}")
    print("summary:", {k: round(v, 3) for k, v in summary.items()})
    path = write_json(PERF / f"{args.out}.json", {"date": utc_now(), "argv": sys.argv[1:], "target": str(target),
                                                   "budget": budget, "roofline": roof, "summary": summary,
                                                   "rows": rows})
    print(f"wrote {path}")
    print(f"wrote {plot_vs_main(path)}")
    return 0


def plot_vs_main(path: Path) -> Path:
    """Tokens committed over time, main (contiguous KV, waves) against new (block KV, refill), from a --vs-main
    JSON: the before/after figure. `python -m scripts.bench_refill --plot PATH` redraws it."""
    record = json.loads(Path(path).read_text())
    out = Path(path).with_suffix(".png")
    with figure(out, (7.0, 4.0)) as ax:
        for r in record["rows"]:
            ts, tokens = zip(*r["timeline"]) if r["timeline"] else ((), ())
            label = (f"{r['system']}, {r['arm']}: batch {r['batch']}, "
                     f"{'block KV + refill' if r['arm'] == 'new' else 'max_seq_len KV, waves'} ({r['passes']} passes)")
            ax.plot(ts, tokens, label=label, linestyle="-" if r["arm"] == "new" else "--")
        ax.set_xlabel("seconds (first repetition)")
        ax.set_ylabel("tokens committed")
        ax.set_title(f"{Path(record['target']).name}, {record['budget'] / 2**30:.1f} GiB, EOS honoured")
        ax.legend(fontsize=8)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="dense", help="dense | moefied | a checkpoint directory")
    ap.add_argument("--budget", default="4.5GiB")
    ap.add_argument("--corpus", default="code", choices=WORKLOADS,
                    help="code: HumanEval; summarization: aclsum; chat: ShareGPT (EOS ends rows early)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024,
                    help="skip prompts longer than this (in corpus order; code prompts are all shorter)")
    ap.add_argument("--dtype", default="float32", help="compute dtype of target and draft")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="cut prompts to this many tokens (0: whole)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="rows per batch (the same cap for both)")
    ap.add_argument("-k", type=int, default=2, help="draft tokens per round with the draft")
    ap.add_argument("--systems", default="nodraft,draft")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="8 prompts of <= 96 tokens, 24 new tokens, batch 4, 1 rep")
    ap.add_argument("--out", default="refill")
    ap.add_argument("--vs-main", action="store_true",
                    help="block KV + refill against main's contiguous KV in waves, each at the planner's batch")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size of the new arm (--vs-main)")
    ap.add_argument("--max-seq-len", type=int, default=0,
                    help="--vs-main: tokens per row both arms are configured for (main reserves them; 0: the longest "
                         "prompt + --new-tokens, as `specoffload generate` sizes a job)")
    ap.add_argument("--prefill-chunk", default="0",
                    help="prompt tokens one pass feeds, refill arm only (waves prefill whole): an integer, 0 for "
                         "whole prompts, or 'plan' for the planner's budget (planned_chunk)")
    ap.add_argument("--plot", type=Path, default=None, help="redraw the figure of a --vs-main JSON and exit")
    args = ap.parse_args()
    if args.plot is not None:
        print(f"wrote {plot_vs_main(args.plot)}")
        return 0
    if args.quick:
        args.prompts, args.prompt_tokens, args.new_tokens, args.batch, args.reps = 8, 96, 24, 4, 1
    target = model_dir(TARGETS.get(args.target, "")) if args.target in TARGETS else args.target
    draft = model_dir("draft")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    encoded = (tok.encode(p) for p in workload_prompts(args.corpus))
    prompts = [p for p in encoded if len(p) <= args.max_prompt_tokens][: args.prompts]
    if args.prompt_tokens:
        prompts = [p[: args.prompt_tokens] for p in prompts]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)  # EOS honoured
    budget = parse_bytes(args.budget)
    print(f"{args.target}, {args.dtype}, budget {format_bytes(budget)}, {len(prompts)} {args.corpus} prompts (mean "
          f"{statistics.fmean(map(len, prompts)):.0f} tokens), up to {args.new_tokens} new, batch {args.batch}, "
          f"{args.reps} reps", flush=True)
    roof = roofline(target)
    print(f"roofline: {roof}", flush=True)
    if args.vs_main:
        return vs_main(args, Path(target), draft, prompts, params, budget, roof)
    base = dict(target=target, device_memory=budget, max_batch_size=args.batch, replan_interval=0,
                max_seq_len=max(map(len, prompts)) + args.new_tokens, dtype=args.dtype)
    systems = {"nodraft": dict(num_draft_tokens=0), "draft": dict(draft=draft, num_draft_tokens=args.k)}
    rows, chunks = [], {}
    for name in args.systems.split(","):
        runs: dict[bool, list[dict]] = {True: [], False: []}
        chunk = None if args.prefill_chunk == "0" else (
            planned_chunk(EngineConfig(**base, **systems[name]), prompts, args.new_tokens)
            if args.prefill_chunk == "plan" else int(args.prefill_chunk))
        chunks[name] = chunk
        print(f"  {name}: refill arm's prefill_chunk {chunk}", flush=True)
        for rep in range(args.reps):
            for refill in ((False, True) if rep % 2 == 0 else (True, False)):  # ABBA
                config = EngineConfig(**base, **systems[name], refill=refill, prefill_chunk=chunk if refill else None)
                r = run(config, prompts, params)
                runs[refill].append(r)
                print(f"  {name:8s} refill={refill!s:5s} rep {rep}: {r['tok_s']:.2f} tok/s, {r['passes']} passes, "
                      f"{r['committed_per_row_pass']:.2f} tokens per row per pass", flush=True)
        same = all(r["token_ids"] == runs[False][0]["token_ids"] for r in runs[True] + runs[False])
        lengths = [len(t) for t in runs[False][0]["token_ids"]]
        waves, refilled = ideal_passes(lengths, args.batch)
        for refill, rs in runs.items():
            med, lo, hi = median_spread(r["tok_s"] for r in rs)
            rows.append({"system": name, "refill": refill, "tok_s_median": med, "tok_s_min": lo, "tok_s_max": hi,
                         "passes": rs[0]["passes"], "committed_per_row_pass": rs[0]["committed_per_row_pass"],
                         "acceptance": rs[0]["acceptance"], "refilled": rs[0]["refilled"],
                         "prefill_chunk": chunks[name] if refill else None,
                         "tokens": rs[0]["tokens"], "equal_tokens": same, "timeline": rs[0]["timeline"],
                         "lengths": lengths, "ideal_passes_waves": waves, "ideal_passes_refill": refilled,
                         "ideal_gain": waves / refilled})
    summary = {}
    print(f"\n{'system':8s} {'refill':6s} {'tok/s (min-max)':22s} {'passes':>6s} {'tok/row/pass':>12s} "
          f"{'equal':>5s}")
    for r in rows:
        print(f"{r['system']:8s} {r['refill']!s:6s} {r['tok_s_median']:6.2f} ({r['tok_s_min']:.2f}-"
              f"{r['tok_s_max']:.2f}){'':6s} {r['passes']:6d} {r['committed_per_row_pass']:12.2f} "
              f"{r['equal_tokens']!s:>5s}")
    for name in args.systems.split(","):
        on = next(r for r in rows if r["system"] == name and r["refill"])
        off = next(r for r in rows if r["system"] == name and not r["refill"])
        summary[f"refill_over_waves_{name}"] = on["tok_s_median"] / off["tok_s_median"]
        summary[f"passes_waves_over_refill_{name}"] = off["passes"] / on["passes"]
        summary[f"ideal_gain_{name}"] = on["ideal_gain"]
        if on["acceptance"] is not None:  # E[n] = (1 - a^(k+1)) / (1 - a) tokens per row per pass at acceptance a
            a = on["acceptance"]
            expected = (1 - a ** (args.k + 1)) / (1 - a) if a < 1 else args.k + 1.0
            summary["committed_per_row_pass_over_expected"] = on["committed_per_row_pass"] / expected  # (drafting)
            summary[f"expected_per_row_pass_{name}"] = expected
    if "refill_over_waves_nodraft" in summary and "refill_over_waves_draft" in summary:
        on = {r["system"]: r["tok_s_median"] for r in rows if r["refill"]}
        summary["draft_over_nodraft"] = on["draft"] / on["nodraft"]
    print("summary:", {k: round(v, 3) for k, v in summary.items()})
    path = write_json(PERF / f"{args.out}.json", {"date": utc_now(), "argv": sys.argv[1:], "target": str(target),
                                                   "corpus": args.corpus, "dtype": args.dtype, "budget": budget,
                                                   "roofline": roof, "summary": summary, "rows": rows})
    print(f"wrote {path}")
    print(f"wrote {plot(args, rows)}")
    return 0


def plot(args: argparse.Namespace, rows: list[dict]) -> Path:
    """Tokens committed over time, waves against refill, per system: the before/after figure."""
    out = PERF / f"{args.out}.png"
    with figure(out, (7.0, 4.0)) as ax:
        for r in rows:
            ts, tokens = zip(*r["timeline"]) if r["timeline"] else ((), ())
            label = f"{r['system']}, {'refill' if r['refill'] else 'waves'} ({r['passes']} passes)"
            ax.plot(ts, tokens, label=label, linestyle="-" if r["refill"] else "--")
        ax.set_xlabel("seconds")
        ax.set_ylabel("tokens committed")
        ax.set_title(f"{args.target}, {args.corpus}, batch {args.batch}, up to {args.new_tokens} new tokens, "
                     "EOS honoured")
        ax.legend()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
