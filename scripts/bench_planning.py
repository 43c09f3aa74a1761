#!/usr/bin/env python
"""What `--drafter auto` planning costs a job: every drafter with a model warmed up, against only those that can win.

`--drafter auto` (runtime/drafter_choice.py) plans none and the model-free drafters from one no-draft warm-up,
then warms up a drafter with a model (the draft model, the low-bit copy) only when, accepting every draft, it
would predict at least the best candidate so far. This benchmark runs `choose_drafter` on one job of
scripts/validate_planner.py (its corpus, prompts, budget and config) both ways, alternating, --reps times each:

    all      measure_all=True: every candidate measured, as before the bound
    bounded  the default

and records the seconds of each (the no-draft warm-up's and each drafter warm-up's among them), the pick of each
(drafter, batch, k, predicted tokens/s: the bound must not change it where the skipped candidate could not have
won) and the comparison tables. Summary: plan_s_all,
plan_s_bounded (medians), bounded_over_all (the share of the planning time left) and same_pick (1 when every
bounded run picked what every full run picked); and, since the code before the bound had no no-draft warm-up
(the first model warm-up's outputs priced every candidate), plan_s_all_less_nodraft_warmup (the full runs less
their no-draft warm-up: what that code spent, derived from the same runs) and bounded_over_all_less_nodraft_warmup.

Writes docs/perf/planning_time.json (--out to change; quick runs belong under docs/perf/scratch/). Long (minutes a
rep): run it under the machine-wide lock, `flock /tmp/specoffload-bench.lock python -m scripts.bench_planning`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from scripts.common import PERF, median_spread, run_meta, utc_now, write_json
from scripts.get_models import model_dir
from scripts.validate_planner import job_config, job_prompts
from specoffload.runtime import SamplingParams
from specoffload.runtime.drafter_choice import choose_drafter
from specoffload.runtime.engine import Engine
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.offload.profiler import load_or_measure
from specoffload.runtime.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="code", help="a corpus of scripts/validate_planner.py")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=PERF / "planning_time.json")
    args = ap.parse_args(argv)
    start = utc_now()
    tok = load_tokenizer(model_dir("target"))
    prompts = job_prompts(args.corpus, tok, args.prompts, 1024)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    max_seq_len = max(map(len, prompts)) + args.new_tokens
    base, _ = job_config(args.budget, max_seq_len, args.dtype)
    profile = load_or_measure(base, log=lambda m: print(f"  {m}", flush=True), open_engine=Engine)
    target = Transformer(base.target, dtype=base.torch_dtype)
    runs: list[dict] = []
    for rep in range(args.reps):
        for mode in ("all", "bounded"):
            t = time.perf_counter()
            choice = choose_drafter(base, target, prompts, params, max_seq_len, profile, measure_all=mode == "all")
            seconds = time.perf_counter() - t
            best = choice.best
            runs.append({"mode": mode, "rep": rep, "seconds": seconds, "drafter": best.drafter,
                         "batch": best.plan.batch, "k": best.plan.k, "predicted": best.predicted,
                         "nodraft_warmup_s": choice.priced_by.seconds if choice.priced_by else None,
                         "warmups_s": {c.drafter: c.warmup.seconds for c in choice.candidates if c.warmup},
                         "table": choice.table()})
            print(f"{mode} rep {rep}: {seconds:.0f} s, pick {best.drafter} batch {best.plan.batch} k {best.plan.k} "
                  f"({best.predicted:.3g} tok/s predicted)\n{choice.table()}", flush=True)
    seconds = {m: [r["seconds"] for r in runs if r["mode"] == m] for m in ("all", "bounded")}
    picks = {m: {(r["drafter"], r["batch"], r["k"]) for r in runs if r["mode"] == m} for m in ("all", "bounded")}
    all_med, all_lo, all_hi = median_spread(seconds["all"])
    bnd_med, bnd_lo, bnd_hi = median_spread(seconds["bounded"])
    # before the bound, `--drafter auto` priced every candidate with the first model warm-up (no no-draft one):
    # what the full runs took less their no-draft warm-up
    before = statistics.median(r["seconds"] - (r["nodraft_warmup_s"] or 0.0) for r in runs if r["mode"] == "all")
    summary = {"plan_s_all": all_med, "plan_s_bounded": bnd_med, "bounded_over_all": bnd_med / all_med,
               "plan_s_all_less_nodraft_warmup": before, "bounded_over_all_less_nodraft_warmup": bnd_med / before,
               "same_pick": float(picks["all"] == picks["bounded"] and len(picks["all"]) == 1)}
    print("| mode | median s | min | max |\n|---|---:|---:|---:|\n"
          f"| all | {all_med:.0f} | {all_lo:.0f} | {all_hi:.0f} |\n| bounded | {bnd_med:.0f} | {bnd_lo:.0f} | "
          f"{bnd_hi:.0f} |\nbounded / all {summary['bounded_over_all']:.2f}; same pick: {bool(summary['same_pick'])}")
    meta = run_meta(args.dtype) | {"start": start, "end": utc_now(), "job": f"{args.corpus}@{args.budget}",
                                   "prompts": len(prompts), "new_tokens": args.new_tokens,
                                   "spread": {m: statistics.pstdev(v) for m, v in seconds.items()}}
    write_json(args.out, {"meta": meta, "summary": summary, "runs": runs})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
