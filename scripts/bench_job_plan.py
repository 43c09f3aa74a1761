#!/usr/bin/env python
"""What planning for the job gives an engine made without one: `Engine(config)` (as `LLM(model, device_memory=...)`
builds it) against the same engine planning again for the job it is given (runtime/engine.py `_plan_job`).

`Engine(config)` with batch "auto" plans before any prompt is known: a default workload (256 prompts of half the
KV length) and KV for rows of the whole context (max_seq_len: the model's, at most 4096), so under a budget the
KV takes memory that a job of short rows never uses, and fewer rows and weights fit. Since this commit the engine
plans again at `generate` for the job's rows and lengths (KV for its longest row) and moves to that plan when the
planner predicts it pays. Both run here on the same job (corpus prompts of scripts/validate_planner.py, greedy,
EOS ignored), alternating, --reps times each:

    constructed   `Engine(config, plan=P)` with P the plan `Engine(config)` makes: what ran before
    job           `Engine(config)`: its `generate` plans for the job first (the re-plan and the rebuilt workers
                  are inside the timed call)

Loading is outside the timer in both (`scripts/common.py` `timed_generate`). Each run records its plan, the bytes
of each tier, the loader's busy seconds against the passes' compute seconds (the trace: io over compute above 1
means the pass waits on its reads, the bound a bigger resident share lifts) and its tokens; the tokens of the two
modes must be identical (checked). Summary: tok_s_constructed and tok_s_job (medians), job_over_constructed, and
the io / compute of each.

Writes docs/perf/job_plan.json (--out to change; quick runs belong under docs/perf/scratch/). Long (minutes a rep):
run it alone, `flock /tmp/specoffload-bench.lock python -m scripts.bench_job_plan`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from scripts.common import PERF, io_compute_seconds, median_spread, run_meta, timed_generate, utc_now, write_json
from scripts.get_models import model_dir
from scripts.validate_planner import job_prompts
from specoffload.runtime import SamplingParams
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.tokenizer import load_tokenizer


def _extra(engine: Engine, start: float) -> dict[str, Any]:
    io_s, compute_s = io_compute_seconds(engine)
    assert engine.placement is not None
    return {"plan": engine.plan.describe(), "batch": engine.plan.batch, "max_seq_len": engine.plan.max_seq_len,
            "bytes_by_tier": engine.placement.bytes_by_tier(), "io_s": io_s, "compute_s": compute_s,
            "io_over_compute": io_s / compute_s if compute_s else None,
            "predicted": engine.plan.policy.predicted_tokens_per_s if engine.plan.policy else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="code", help="a corpus of scripts/validate_planner.py")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=PERF / "job_plan.json")
    args = ap.parse_args(argv)
    start = utc_now()
    tok = load_tokenizer(model_dir("target"))
    prompts = job_prompts(args.corpus, tok, args.prompts, 1024)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    config = EngineConfig(target=model_dir("target"), device_memory=args.budget, dtype=args.dtype, trace=True)
    probe = Engine(config)
    constructed = probe.plan
    probe.close()
    print(f"constructed plan: {constructed.describe()}", flush=True)
    runs: list[dict] = []
    for rep in range(args.reps):
        for mode in ("constructed", "job"):
            t = time.perf_counter()
            run = timed_generate(config, prompts, params, plan=constructed if mode == "constructed" else None,
                                 extra=_extra)
            runs.append({"mode": mode, "rep": rep, "with_loading_s": time.perf_counter() - t} | run)
            print(f"{mode} rep {rep}: {run['tok_s']:.3g} tok/s ({run['wall_s']:.0f} s), {run['plan']}, io / compute "
                  f"{run['io_over_compute'] or 0:.2f}", flush=True)
    same = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    assert same, "the job's plan changed the tokens: a bug"
    rates = {m: median_spread(r["tok_s"] for r in runs if r["mode"] == m) for m in ("constructed", "job")}
    bound = {m: median_spread(r["io_over_compute"] or 0.0 for r in runs if r["mode"] == m)[0]
             for m in ("constructed", "job")}
    summary = {"tok_s_constructed": rates["constructed"][0], "tok_s_job": rates["job"][0],
               "job_over_constructed": rates["job"][0] / rates["constructed"][0],
               "io_over_compute_constructed": bound["constructed"], "io_over_compute_job": bound["job"],
               "same_tokens": float(same)}
    print("| mode | plan | tok/s median | min | max | io / compute |\n|---|---|---:|---:|---:|---:|")
    for m in ("constructed", "job"):
        plan = next(r["plan"] for r in runs if r["mode"] == m)
        med, lo, hi = rates[m]
        print(f"| {m} | {plan} | {med:.3g} | {lo:.3g} | {hi:.3g} | {bound[m]:.2f} |")
    print(f"job / constructed {summary['job_over_constructed']:.2f}")
    for r in runs:
        del r["token_ids"]
    meta = run_meta(args.dtype) | {"start": start, "end": utc_now(), "corpus": args.corpus, "budget": args.budget,
                                   "prompts": len(prompts), "new_tokens": args.new_tokens,
                                   "constructed_plan": constructed.describe()}
    write_json(args.out, {"meta": meta, "summary": summary, "runs": runs})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
