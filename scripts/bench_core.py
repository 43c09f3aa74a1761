"""The engine core before and after a rewrite, in one run on one machine (issue 33): the drafters benchmark at the
tight budget on summaries and the refill benchmark, each run in an old checkout and in this one, alternating.

    python -m scripts.bench_core --old DIR [--reps 2] [--out core]

DIR is a checkout of the old commit with a working `.venv` whose editable install points at DIR (the benchmark
scripts run there as `DIR/.venv/bin/python -m scripts.<name>`, so each arm runs its own engine). Each repetition
runs old then new, the next new then old (ABBA), one benchmark repetition per call:

  drafters  scripts/bench_drafters.py --workloads summarization --no-pick (moefied MoE from disk at --budget,
            bfloat16, batch --batch, --prompts aclsum prompts, --new-tokens, systems none / ngram / suffix)
  refill    scripts/bench_refill.py --systems nodraft (the same target and budget, --refill-prompts HumanEval
            prompts, refill on and off)

Writes docs/perf/<out>.json: per arm and system the tokens/s of every repetition, their median and spread, and a
"summary" with core_new_over_old_drafters (the lowest over the systems of median new / median old),
core_new_over_old_refill (refill on; waves beside it), the per-system ratios, and the bound beside them: the
no-draft pass's io over compute on the new arm (what the pass leaves a drafter to gain). The child runs' own JSON
goes under docs/perf/scratch/ in each checkout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts.common import PERF, ROOT, machine, median_spread, utc_now, write_json


def _commit(path: Path) -> str:
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _child(tree: Path, module: str, argv: list[str], out: str) -> dict:
    """Run `python -m scripts.<module> ARGV --out scratch/OUT` in `tree` with its own venv; its JSON."""
    cmd = [str(tree / ".venv" / "bin" / "python"), "-m", f"scripts.{module}", *argv, "--out", f"scratch/{out}"]
    print(f"[{tree}] {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=tree, check=True)
    print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads((tree / "docs" / "perf" / "scratch" / f"{out}.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="checkout of the old commit, with its .venv")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--target", default="moefied")
    ap.add_argument("--budget", default="2.5GiB")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="aclsum prompts of the drafters benchmark")
    ap.add_argument("--refill-prompts", type=int, default=16, help="HumanEval prompts of the refill benchmark")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma-separated: drafters, refill")
    ap.add_argument("--out", default="core")
    args = ap.parse_args()
    trees = {"old": args.old.resolve(), "new": ROOT}
    drafters_argv = ["--target", args.target, "--budget", args.budget, "--workloads", "summarization", "--prompts",
                     str(args.prompts), "--new-tokens", str(args.new_tokens), "--batches", str(args.batch),
                     "--systems", "none,ngram,suffix", "--reps", "1", "--no-pick"]
    refill_argv = ["--target", args.target, "--budget", args.budget, "--corpus", "code", "--dtype", "bfloat16",
                   "--prompts", str(args.refill_prompts), "--new-tokens", str(args.new_tokens), "--batch",
                   str(args.batch), "--systems", "nodraft", "--reps", "1"]
    skip = set(args.skip.split(",")) - {""}
    tok_s: dict[str, dict[str, dict[str, list[float]]]] = {"drafters": {}, "refill": {}}
    bounds: list[float] = []  # the new arm's no-draft io / compute on summaries, per repetition
    for rep in range(args.reps):
        for arm in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            if "drafters" not in skip:
                data = _child(trees[arm], "bench_drafters", drafters_argv, f"core_drafters_{arm}_{rep}")
                for row in data["rows"]:
                    tok_s["drafters"].setdefault(row["system"], {}).setdefault(arm, []).append(row["tok_s_median"])
                if arm == "new" and "io_over_compute_nodraft_summarization" in data["summary"]:
                    bounds.append(data["summary"]["io_over_compute_nodraft_summarization"])
            if "refill" not in skip:
                data = _child(trees[arm], "bench_refill", refill_argv, f"core_refill_{arm}_{rep}")
                for row in data["rows"]:
                    name = "refill" if row["refill"] else "waves"
                    tok_s["refill"].setdefault(name, {}).setdefault(arm, []).append(row["tok_s_median"])
    rows, summary = [], {}
    for bench, systems in tok_s.items():
        ratios = {}
        for system, arms in systems.items():
            stats = {arm: median_spread(values) for arm, values in arms.items()}
            ratio = stats["new"][0] / stats["old"][0]
            ratios[system] = ratio
            rows.append({"benchmark": bench, "system": system, "old_tok_s": arms["old"], "new_tok_s": arms["new"],
                         "old_median": stats["old"][0], "new_median": stats["new"][0],
                         "old_spread": [stats["old"][1], stats["old"][2]],
                         "new_spread": [stats["new"][1], stats["new"][2]], "new_over_old": ratio})
            summary[f"core_new_over_old_{bench}_{system}"] = ratio
        if ratios:  # refill: the refilled arm; drafters: the lowest system
            summary[f"core_new_over_old_{bench}"] = ratios["refill"] if bench == "refill" else min(ratios.values())
    if bounds:
        summary["io_over_compute_nodraft_summarization"] = statistics.median(bounds)
    print(f"\n{'benchmark':9s} {'system':7s} {'old tok/s (min-max)':22s} {'new tok/s (min-max)':22s} new/old")
    for r in rows:
        print(f"{r['benchmark']:9s} {r['system']:7s} {r['old_median']:6.2f} ({r['old_spread'][0]:.2f}-"
              f"{r['old_spread'][1]:.2f})      {r['new_median']:6.2f} ({r['new_spread'][0]:.2f}-"
              f"{r['new_spread'][1]:.2f})      {r['new_over_old']:.3f}")
    print("summary:", {k: round(v, 3) for k, v in summary.items()})
    import torch

    path = write_json(PERF / f"{args.out}.json", {
        "date": utc_now(), "argv": sys.argv, "machine": machine(), "torch": torch.__version__, "dtype": "bfloat16",
        "commits": {arm: _commit(tree) for arm, tree in trees.items()}, "drafters_argv": drafters_argv,
        "refill_argv": refill_argv, "summary": summary, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
