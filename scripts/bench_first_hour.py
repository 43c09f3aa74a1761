"""A new user's first runs (issue 38, Measure): how long `specoffload generate` stays silent, and how long until it
commits its first token, on the real 1.5B offloaded, first with no cached hardware profile, then with it.

Each run is `specoffload generate` in a subprocess (its own profile cache folder: the first run measures, the
second finds it), its stderr read line by line with the time each line arrived: the first line that names a phase
(measuring, warm-up, plan, models loaded, progress), and the first progress line whose rate is above zero (a
token committed). Results: docs/perf/first_hour.json ("summary"), docs/perf/README.md.

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_first_hour [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.common import PERF, run_meta, write_json
from scripts.readme_section import write_section

BIN = Path(sys.executable).parent
MODELS = Path.home() / ".cache" / "specoffload" / "models"
PHASE = re.compile(r"^(profile:|measuring|warm-up|plan:|drafter|progress:|hardware profile|generate)")
RATE = re.compile(r"progress: .* ([0-9.]+) tok/s")


def run(prompts: Path, cache: Path, out: Path, args: argparse.Namespace) -> dict:
    cmd = [str(BIN / "specoffload"), "generate", "--model", str(MODELS / "qwen2.5-coder-1.5b-instruct"),
           "--prompts", str(prompts), "-o", str(out), "--overwrite", "--device-memory", args.device_memory,
           "--max-tokens", str(args.max_tokens),
           "--temperature", "0", "--dtype", "bfloat16", "--progress-interval", "1"]
    start = time.monotonic()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**__import__("os").environ, "SPECOFFLOAD_CACHE": str(cache)})
    lines, first_phase, first_token = [], None, None
    assert process.stderr is not None
    for line in process.stderr:
        at = time.monotonic() - start
        lines.append((round(at, 2), line.rstrip()[:200]))
        if first_phase is None and PHASE.match(line):
            first_phase = at
        rate = RATE.search(line)
        if first_token is None and rate and float(rate.group(1)) > 0:
            first_token = at
    process.wait()
    return {"exit_status": process.returncode, "wall_s": time.monotonic() - start, "first_phase_line_s": first_phase,
            "first_token_s": first_token, "stderr": lines[:60]}


def profile(cache: Path, args: argparse.Namespace, *extra: str) -> dict:
    """`specoffload profile` of the real 1.5B (bf16) at the run's budget in `cache`: its wall time, and whether it
    measured the model's profile or only a drafter's step on top of a cached one."""
    cmd = [str(BIN / "specoffload"), "profile", "--model", str(MODELS / "qwen2.5-coder-1.5b-instruct"),
           "--device-memory", args.device_memory, "--dtype", "bfloat16", *extra]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**__import__("os").environ, "SPECOFFLOAD_CACHE": str(cache)})
    return {"exit_status": done.returncode, "wall_s": time.monotonic() - start, "argv": cmd[1:],
            "measured_profile": "measuring the hardware profile" in done.stderr,
            "timed_draft_step": "timing the draft step" in done.stderr, "stderr": done.stderr.splitlines()[:30]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens: a smoke run, written to scratch/")
    parser.add_argument("--device-memory", default="2GiB")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.quick:
        args.max_tokens = 4
    meta = run_meta("bfloat16")
    work = Path(tempfile.mkdtemp(prefix="so-first-"))
    prompts = work / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "def fibonacci(n):", "Write a haiku about caches.", "class Stack:", "import os\n\ndef walk(path):")))
    cache = work / "cache"
    first = run(prompts, cache, work / "o1.jsonl", args)
    second = run(prompts, cache, work / "o2.jsonl", args)
    summary = {name: {k: r[k] for k in ("exit_status", "first_phase_line_s", "first_token_s", "wall_s")}
               for name, r in (("first_run", first), ("second_run", second))}
    # `specoffload profile` ahead of a job (issue 38: <= 60 s), then another drafter on the same profile
    ahead = profile(work / "profile-cache", args)
    drafted = profile(work / "profile-cache", args, "--draft", str(MODELS / "qwen2.5-coder-0.5b-instruct"))
    summary["profile_ahead"] = {k: ahead[k] for k in ("exit_status", "wall_s", "measured_profile")}
    summary["profile_another_drafter"] = {k: drafted[k] for k in ("exit_status", "wall_s", "measured_profile",
                                                                 "timed_draft_step")}
    record = {"benchmark": "first_hour", **meta, "quick": args.quick, "device_memory": args.device_memory,
              "max_tokens": args.max_tokens, "summary": summary,
              "runs": {"first": first, "second": second, "profile_ahead": ahead, "profile_another_drafter": drafted}}
    path = PERF / ("scratch/first_hour_quick.json" if args.quick else "first_hour.json")
    write_json(path, record)
    print(json.dumps(summary, indent=2))
    if not args.quick:
        write_section(PERF / "README.md", "first_hour", _section(record),
                      heading="first_hour (`scripts/bench_first_hour.py`)")


def _section(record: dict) -> str:
    s = record["summary"]

    def cell(v: float | None) -> str:
        return "never" if v is None else f"{v:.1f} s"

    rows = "\n".join(f"| {name.replace('_', ' ')} | {cell(r['first_phase_line_s'])} | {cell(r['first_token_s'])} | "
                     f"{r['wall_s']:.1f} s | {r['exit_status']} |" for name, r in s.items() if name.endswith("_run"))
    ahead, other = s["profile_ahead"], s["profile_another_drafter"]
    return (f"Run {record['date']} on {record['machine']['model']} ({record['machine']['cores']} cores), torch "
            f"{record['torch']}, commit {record['commit']}: `specoffload generate` of the real "
            f"Qwen2.5-Coder-1.5B-Instruct (bf16) offloaded at {record['device_memory']}, 4 prompts x "
            f"{record['max_tokens']} tokens, first with an empty profile cache, then with the profile the first "
            "run measured.\n\n| run | first phase line | first committed token | wall | exit |\n"
            "|---|---:|---:|---:|---:|\n" + rows + "\n\n"
            f"`specoffload profile` ahead of a job (empty cache, bf16, {record['device_memory']}): "
            f"{ahead['wall_s']:.1f} s (measured the profile: {ahead['measured_profile']}); then with the 0.5B "
            f"draft model: {other['wall_s']:.1f} s (the profile reused: {not other['measured_profile']}; only the "
            f"draft step timed: {other['timed_draft_step']}).")


if __name__ == "__main__":
    main()
