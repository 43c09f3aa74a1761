#!/usr/bin/env python
"""How well the calibrated profile predicts decode passes at batches it was not calibrated on, for two fits of the
per-pass overhead on the same calibration points (runtime/offload/calibrate.py):

    line   o(n) = pass_overhead_s + position_overhead_s * n, least squares through the overhead each calibration
           point needs (the residual of the measured period over the model's step), n = positions verified: with
           CALIBRATION_ROWS = (16, 4) two points, so the slope is their residuals' difference over 12 positions
    ops    position_overhead_s = the per-position busy seconds of the ops the model leaves out (embed, verify),
           measured at the same points (a line through the origin); pass_overhead_s = the mean residual left

The profile is the cached one for the config (measured first when there is none). Then, for each --batches value,
a fixed no-draft plan of that batch runs `batch` HumanEval prompts (--prompt-tokens each at most) for --new-tokens
tokens under --budget, and its decode passes' median period (verify to verify, the prefill passes skipped, as
calibration measures) is compared with each fit's `estimate_step` for the same placement. Summary: the median
absolute relative error of each fit and their ratio; the rows keep the measured period, the predictions and the
pass's io / compute. Long (a minute a batch): run it alone, `flock /tmp/specoffload-bench.lock python -m
scripts.bench_calibration`. Writes docs/perf/calibration_fit.json (--out to change).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

from scripts.common import PERF, io_compute_seconds, run_meta, utc_now, write_json
from scripts.get_models import model_dir
from specoffload.planner import HardwareProfile
from specoffload.planner.cost import estimate_step
from specoffload.runtime import EngineConfig, SamplingParams
from specoffload.runtime.engine import Engine
from specoffload.runtime.offload import profiler
from specoffload.runtime.offload.calibrate import _fit_line
from specoffload.runtime.prompts import humaneval_prompts
from specoffload.runtime.tokenizer import load_tokenizer


def ops_fit(profile: HardwareProfile) -> HardwareProfile:
    """The "ops" fit (module docstring) on `profile`'s calibration points."""
    points = profile.calibration
    positions = [p["positions"] for p in points]
    ops = [p["verify_s"] + p["embed_s"] for p in points]  # busy seconds a pass, per point
    per_position = sum(ops) / sum(positions) if sum(positions) else 0.0
    rest = [max(0.0, p["overhead_needed_s"] - per_position * p["positions"]) for p in points]
    return replace(profile, pass_overhead_s=statistics.fmean(rest) if rest else 0.0,
                   position_overhead_s=per_position)


def line_fit(profile: HardwareProfile) -> HardwareProfile:
    """The "line" fit (module docstring), as calibrate.py makes it, on `profile`'s calibration points."""
    o, r = _fit_line([p["positions"] for p in profile.calibration],
                     [p["overhead_needed_s"] for p in profile.calibration])
    return replace(profile, pass_overhead_s=o, position_overhead_s=r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--batches", default="4,8,16,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=PERF / "calibration_fit.json")
    args = ap.parse_args(argv)
    start = utc_now()
    target = str(model_dir("target"))
    tok = load_tokenizer(model_dir("target"))
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [tok.encode(p)[: args.prompt_tokens] for p in humaneval_prompts(max(batches))]
    config = EngineConfig(target, device_memory=args.budget, dtype=args.dtype)
    profile = profiler.load_or_measure(config, open_engine=Engine)
    fits = {"line": line_fit(profile), "ops": ops_fit(profile)}
    print({name: (round(f.pass_overhead_s, 4), round(f.position_overhead_s, 6)) for name, f in fits.items()})
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        job = prompts[:batch]
        cfg = replace(config, max_batch_size=batch, num_draft_tokens=0, trace=True,
                      max_seq_len=max(map(len, job)) + args.new_tokens + 1)
        engine = Engine(cfg)
        engine.generate(job, params)
        ends = [end for end, *_ in engine.pipeline.verify_log]
        periods = [b - a for a, b in zip(ends[2:], ends[3:])]  # (the prefill pass and the first decode skipped)
        measured = statistics.median(periods)
        attended = round(statistics.fmean(map(len, job)) + args.new_tokens / 2)
        costs = engine.models.costs(False)
        predicted = {name: estimate_step(f, costs, engine.placement, batch, 0, 0.0, attended).t_step
                     for name, f in fits.items()}
        io_s, compute_s = io_compute_seconds(engine)
        rows.append({"batch": batch, "plan": engine.plan.describe(), "measured_s": measured, "passes": len(periods),
                     "io_over_compute": io_s / compute_s if compute_s else None,
                     **{f"predicted_{name}_s": p for name, p in predicted.items()},
                     **{f"error_{name}": p / measured - 1 for name, p in predicted.items()}})
        engine.close()
        print(f"batch {batch}: measured {measured:.3f} s a pass, line {predicted['line']:.3f}, ops "
              f"{predicted['ops']:.3f}", flush=True)
    errors = {name: statistics.median(abs(r[f"error_{name}"]) for r in rows) for name in fits}
    summary = {"median_abs_error_line": errors["line"], "median_abs_error_ops": errors["ops"],
               "ops_error_over_line_error": errors["ops"] / errors["line"] if errors["line"] else None}
    print("| batch | measured s | line s (error) | ops s (error) | io / compute |\n|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['measured_s']:.3f} | {r['predicted_line_s']:.3f} ({r['error_line']:+.0%}) | "
              f"{r['predicted_ops_s']:.3f} ({r['error_ops']:+.0%}) | {r['io_over_compute'] or 0:.2f} |")
    print(summary)
    meta = run_meta(args.dtype) | {"start": start, "end": utc_now(), "budget": args.budget,
                                   "profile": profile.to_json()["provenance"], "fits": {
                                       name: {"pass_overhead_s": f.pass_overhead_s,
                                              "position_overhead_s": f.position_overhead_s}
                                       for name, f in fits.items()}}
    write_json(args.out, {"meta": meta, "summary": summary, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
