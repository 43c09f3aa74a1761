"""What row buckets save in a prefill (runtime/models/row_buckets.py): the same prefill with CPU 16-bit GEMMs over
a bucket of rows (ours, the default) and over their own row counts (baseline: `row_buckets.BUCKET_FROM` set past
any row count, as before the buckets), each run in a fresh process (oneDNN's kernel cache starts empty, as in a
new job), alternating, several times.

The job: the moefied MoE's Q4_K_M GGUF (scripts/peers/moefied_gguf.sh; the peers bench's budget model), streamed
from disk at `--device-memory`, bfloat16, `--prompts` HumanEval prompts at batch `--batch`, chunks of
`--prefill-chunk` prompt tokens a pass, one new token (the prefill and its first token). Reported per arm: the
generate call's seconds, median and spread; the kernel builds oneDNN reports in one extra run per arm
(ONEDNN_VERBOSE=profile_create, "create:cache_miss" lines) and the milliseconds they took: the bound (what the
buckets can save at most is the builds' time). Results: docs/perf/row_buckets.json ("summary").

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_row_buckets [--reps 3] [--prompts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from scripts.common import PERF, ROOT, median_spread, run_meta, utc_now, write_json

GGUF = Path.home() / ".cache/specoffload/peers/gguf/qwen2.5-coder-1.5b-moefied-q4_k_m-q4khead-shgate.gguf"

#: the child: one prefill, timed; argv[1] a JSON request; prints {"seconds": ...}
CHILD = """
import json, sys, time
req = json.loads(sys.argv[1])
from specoffload.runtime.models import row_buckets
if not req["buckets"]:
    row_buckets.BUCKET_FROM = 1 << 62  # every GEMM at its own row count (the baseline)
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams
engine = Engine(EngineConfig(target=req["model"], dtype="bfloat16", max_batch_size=req["batch"], num_draft_tokens=0,
                             device_memory=req["device_memory"], prefill_chunk=req["prefill_chunk"],
                             max_seq_len=max(map(len, req["prompts"])) + 8))
try:
    start = time.perf_counter()
    engine.generate(req["prompts"], SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    print(json.dumps({"seconds": time.perf_counter() - start}))
finally:
    engine.close()
"""


def run(request: dict, verbose: bool = False) -> dict:
    """One child process; with `verbose` also the kernel builds it reported (count, milliseconds)."""
    env = os.environ | ({"ONEDNN_VERBOSE": "profile_create"} if verbose else {})
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(request)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the prefill child failed: {done.stderr[-2000:]}")
    lines = done.stdout.splitlines()
    out = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    if verbose:
        builds = [line for line in lines if "create:cache_miss" in line]
        out |= {"kernel_builds": len(builds), "kernel_build_ms": round(sum(float(b.rsplit(",", 1)[1])
                                                                          for b in builds), 1)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=GGUF)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device-memory", default="0.31GiB")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 prompts, 1 rep (scratch/)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.reps = 2, 1
    if not args.gguf.exists():
        raise SystemExit(f"{args.gguf} is missing: make it with scripts/peers/moefied_gguf.sh")
    from specoffload.planner.units import parse_bytes
    from specoffload.runtime.models.gguf import resolve_model
    from specoffload.runtime.prompts import humaneval_prompts
    from specoffload.runtime.tokenizer import load_tokenizer

    meta = run_meta("bfloat16")
    target = resolve_model(args.gguf)
    tok = load_tokenizer(target)
    prompts = [tok.encode(p) for p in humaneval_prompts(args.prompts)]
    request = {"model": str(target), "prompts": prompts, "batch": args.batch,
               "device_memory": parse_bytes(args.device_memory), "prefill_chunk": args.prefill_chunk}
    arms = {"buckets": True, "no_buckets": False}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    for rep in range(args.reps):
        for arm, on in arms.items():
            seconds[arm].append(run(request | {"buckets": on})["seconds"])
            print(f"rep {rep} {arm}: {seconds[arm][-1]:.2f} s", file=sys.stderr)
    builds = {arm: run(request | {"buckets": on}, verbose=True) for arm, on in arms.items()}
    results = {}
    for arm in arms:
        med, lo, hi = median_spread(seconds[arm])
        results[arm] = {"seconds_median": med, "seconds_min": lo, "seconds_max": hi, "seconds": seconds[arm],
                        "kernel_builds": builds[arm]["kernel_builds"],
                        "kernel_build_ms": builds[arm]["kernel_build_ms"],
                        "verbose_run_seconds": builds[arm]["seconds"]}
    summary = {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "batch": args.batch,
               "buckets_s": round(results["buckets"]["seconds_median"], 3),
               "no_buckets_s": round(results["no_buckets"]["seconds_median"], 3),
               "prefill_speedup_buckets_over_none": round(results["no_buckets"]["seconds_median"]
                                                         / results["buckets"]["seconds_median"], 3),
               "kernel_builds_buckets": results["buckets"]["kernel_builds"],
               "kernel_builds_no_buckets": results["no_buckets"]["kernel_builds"],
               "kernel_build_s_no_buckets": round(results["no_buckets"]["kernel_build_ms"] / 1000, 3)}
    print("\n| arm | prefill s (median, min-max) | oneDNN kernel builds (ms) |\n|---|---:|---:|")
    for arm, r in results.items():
        print(f"| {arm} | {r['seconds_median']:.2f} ({r['seconds_min']:.2f}-{r['seconds_max']:.2f}) | "
              f"{r['kernel_builds']} ({r['kernel_build_ms']:.0f}) |")
    print(summary)
    name = "scratch/row_buckets_quick.json" if args.quick else "row_buckets.json"
    path = write_json(PERF / name, {"summary": summary, **meta, "end": utc_now(),
                                    "args": vars(args) | {"gguf": str(args.gguf)}, "results": results})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
