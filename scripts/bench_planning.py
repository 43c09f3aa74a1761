#!/usr/bin/env python
"""What `--drafter auto` planning costs a job: every drafter with a model warmed up, against only those that can win.

`--drafter auto` (runtime/drafter_choice.py) warms up a drafter with a model (the draft model, the low-bit copy)
only when, accepting every draft, it would predict at least the best candidate so far; the first such warm-up (or,
when none may win, a no-draft one) prices every candidate. This benchmark runs `choose_drafter` on one job of
scripts/validate_planner.py (its corpus, prompts, budget and config) both ways, alternating, --reps times each:

    all      measure_all=True: every drafter with a model warmed up, the first one's warm-up pricing them all
             (what `--drafter auto` did before the bound)
    bounded  the default

and records the seconds of each, each warm-up's seconds and which warm-up priced the candidates, the pick of each
(drafter, batch, k, predicted tokens/s: the bound must not change it) and the comparison tables. Summary:
plan_s_all and plan_s_bounded (medians), bounded_over_all (the share of the planning time left) and same_pick (1
when every bounded run picked the drafter, batch and k every full run picked).

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
from specoffload.runtime.warmup import Warmup


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
            best, priced = choice.best, choice.priced_by
            runs.append({"mode": mode, "rep": rep, "seconds": seconds, "drafter": best.drafter,
                         "batch": best.plan.batch, "k": best.plan.k, "predicted": best.predicted,
                         "priced_by": next((c.drafter for c in choice.candidates if c.warmup is priced), "no-draft"),
                         "warmups_s": {c.drafter: c.warmup.seconds for c in choice.candidates if c.warmup}
                         | ({} if isinstance(priced, Warmup) else {"no-draft": priced.seconds}),
                         "table": choice.table()})
            print(f"{mode} rep {rep}: {seconds:.0f} s, pick {best.drafter} batch {best.plan.batch} k {best.plan.k} "
                  f"({best.predicted:.3g} tok/s predicted)\n{choice.table()}", flush=True)
    seconds = {m: [r["seconds"] for r in runs if r["mode"] == m] for m in ("all", "bounded")}
    picks = {m: {(r["drafter"], r["batch"], r["k"]) for r in runs if r["mode"] == m} for m in ("all", "bounded")}
    all_med, all_lo, all_hi = median_spread(seconds["all"])
    bnd_med, bnd_lo, bnd_hi = median_spread(seconds["bounded"])
    summary = {"plan_s_all": all_med, "plan_s_bounded": bnd_med, "bounded_over_all": bnd_med / all_med,
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
