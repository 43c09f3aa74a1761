"""What capping oneDNN's kernel caches costs (runtime/models/linear.py `bound_kernel_caches`, 128 entries each):
the same `specoffload generate` job with the cap (ours) and with oneDNN's own default of 1024 (baseline: the two
variables set in the environment, which the engine then leaves alone), alternating in one run, several times.

The job is the worst case for the cap: a tiny random Llama, 100k one-token rows of 2-8 prompt tokens, batch 256
with refill, so nearly every pass has a new GEMM shape and a kernel is cheap to run but not to build. Reported:
tokens/s (the CLI's own, generation only) and peak RSS per arm, median and spread, and ours / baseline.
Results: docs/perf/kernel_cache.json ("summary").

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_kernel_cache [--rows N] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.common import PERF, median_spread, run_meta, write_json

BIN = Path(sys.executable).parent
RATE = re.compile(r"([0-9.]+) tokens/s")
BASELINE = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}  # oneDNN's and ideep's default


def run(model: Path, corpus: Path, out: Path, env: dict[str, str]) -> dict:
    cmd = ["/usr/bin/time", "-f", "peak_kb %M", str(BIN / "specoffload"), "generate", "--model", str(model),
           "--prompts", str(corpus), "-o", str(out), "--overwrite", "--max-tokens", "1",
           "--temperature", "0", "--batch-size", "256",
           "--threads", "1", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | env, timeout=1800)
    rate = RATE.findall(done.stderr)
    peak = re.findall(r"peak_kb (\d+)", done.stderr)
    return {"exit_status": done.returncode, "tokens_per_s": float(rate[-1]) if rate else None,
            "peak_rss_mib": int(peak[-1]) / 1024 if peak else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=PERF / "kernel_cache.json")
    args = parser.parse_args()
    meta = run_meta("float32")
    work = Path(tempfile.mkdtemp(prefix="so-kcache-"))
    from scripts.make_tiny_models import make_tiny_models

    model = make_tiny_models(work / "models", ["llama"])["llama"]
    rng = random.Random(0)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(2, 9))]})
                              + "\n" for _ in range(args.rows)))
    arms: dict[str, list[dict]] = {"baseline": [], "ours": []}
    order = [("baseline", BASELINE), ("ours", {})]
    for rep in range(args.reps):  # alternating, so a drifting machine touches both arms alike
        for arm, env in order if rep % 2 == 0 else order[::-1]:
            result = run(model, corpus, work / "out.jsonl", env)
            arms[arm].append(result)
            print(f"rep {rep} {arm}: {result}", flush=True)
    summary: dict[str, object] = {}
    for arm, results in arms.items():
        med, lo, hi = median_spread(r["tokens_per_s"] for r in results)
        summary[f"{arm}_tokens_per_s"] = {"median": med, "min": lo, "max": hi}
        summary[f"{arm}_peak_rss_mib"] = max(r["peak_rss_mib"] for r in results)
    summary["cap_over_default_tokens_per_s"] = (summary["ours_tokens_per_s"]["median"]  # type: ignore[index]
                                                / summary["baseline_tokens_per_s"]["median"])  # type: ignore[index]
    write_json(args.out, {"benchmark": "kernel_cache", **meta, "rows": args.rows, "reps": args.reps,
                          "baseline_env": BASELINE, "summary": summary, "runs": arms})
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
