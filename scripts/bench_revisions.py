"""Before / after a refactor, in one run: the offloaded engine's throughput and the Ray backend's overhead of a
baseline revision against the working tree, on the same machine, alternating.

The baseline is an install of an older revision into its own folder (it shadows the editable install through
PYTHONPATH, in child processes only):

    git worktree add /tmp/old_tree <rev>
    .venv/bin/pip install --no-deps --no-build-isolation --target /tmp/old_pkg /tmp/old_tree
    python -m scripts.bench_revisions --baseline /tmp/old_pkg --label <rev>     # --quick: 1 round

Workload: by default the offload benchmark's quick mode (scripts/bench_offload.py --quick: 8 HumanEval prompts of 32
tokens, 8 new tokens, budget 4.5 GiB, disk tier; no draft at batch 8, the 0.5B draft at batch 4 with k = 3), local
and Ray backends; --prompts, --prompt-tokens, --new-tokens and --budget change it. The `planned` system (local only,
`--combos local:planned`) is `Engine(config)` with batch "auto" and no draft: the planner picks the batch and the
per-pass prompt budget for the job, as `LLM(model, device_memory=...)` does. Each (revision, backend, system) runs
in a fresh process: one warm-up generate, then `--reps` timed ones. Rounds alternate the revisions (ABBA) so a drift
of the machine hits both. Greedy tokens must be identical across revisions and backends. Results:
docs/perf/revisions.json ("summary": new / old per system, and the Ray overhead ray / local per revision) and a
section of docs/perf/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # (the worker imports nothing of the working tree's package)
SYSTEMS = {"nodraft": {"max_batch_size": 8, "draft": False}, "draft": {"max_batch_size": 4, "draft": True},
           "planned": {"max_batch_size": "auto", "draft": False}}
#: what may be measured per revision: the systems locally; the Ray backend with its five actors (draft included)
COMBOS = (("local", "nodraft"), ("local", "draft"), ("ray", "draft"), ("local", "planned"))
#: measured unless --combos says otherwise
DEFAULT_COMBOS = COMBOS[:3]


def worker(args: argparse.Namespace) -> None:
    """One (revision, backend, system) measurement in this process; prints a JSON line."""
    import torch

    from scripts.common import io_compute_seconds
    from scripts.get_models import model_dir
    from specoffload.runtime import EngineConfig, SamplingParams
    from specoffload.runtime.prompts import humaneval_prompts

    target, draft = str(model_dir("target")), str(model_dir("draft"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok.encode(p)[: args.prompt_tokens] for p in humaneval_prompts(args.prompts)]
    system = SYSTEMS[args.system]
    config = EngineConfig(target, draft=draft if system["draft"] else None, device_memory=args.budget,
                          max_seq_len=max(map(len, prompts)) + args.new_tokens,
                          max_batch_size=system["max_batch_size"], num_draft_tokens=3,
                          trace=args.backend == "local")  # (the last generate's io and compute seconds)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    if args.backend == "ray":
        from specoffload.actors import connect

        handle = connect(config, None, num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        generate, close = handle.generate, handle.shutdown
    else:
        if importlib.util.find_spec("specoffload.runtime.offload.engine") is not None:  # before the refactor
            from specoffload.runtime.offload.engine import OffloadEngine as Engine
        else:  # the one front door
            from specoffload.runtime.engine import Engine
        engine = Engine(config)
        generate, close = engine.generate, getattr(engine, "close", lambda: None)
    tokens = [r.token_ids for r in generate(prompts, params)]  # warm-up (and the tokens to compare)
    rates = []
    for _ in range(args.reps):
        start = time.perf_counter()
        results = generate(prompts, params)
        rates.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - start))
    local = generate.__self__ if args.backend == "local" else None  # (its plan after the job, its last trace)
    io_s, compute_s = io_compute_seconds(local) if local is not None else (0.0, 0.0)
    close()
    print(json.dumps({"rates": rates, "tokens": tokens, "threads": torch.get_num_threads(),
                      "plan": local.plan.describe() if local is not None else None,
                      "passes": local.last_stats.passes if local is not None else None,
                      "io_over_compute": io_s / compute_s if compute_s else None}))


def run_one(revision: str, baseline: Path, backend: str, system: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if revision == "old":
        env["PYTHONPATH"] = f"{baseline}{os.pathsep}{ROOT}"
    cmd = [sys.executable, "-m", "scripts.bench_revisions", "--worker", "--revision", revision, "--backend", backend,
           "--system", system, "--reps", str(args.reps), "--prompts", str(args.prompts), "--prompt-tokens",
           str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), "--budget", args.budget]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{revision}/{backend}/{system} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="folder holding an install of the baseline revision")
    ap.add_argument("--label", default="baseline", help="what the baseline is (a commit)")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each runs every combination twice)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round, 2 reps")
    ap.add_argument("--combos", default=",".join(f"{b}:{s}" for b, s in DEFAULT_COMBOS),
                    help=f"backend:system pairs to measure, of {','.join(f'{b}:{s}' for b, s in COMBOS)} (default: "
                         "the first three)")
    ap.add_argument("--prompts", type=int, default=8, help="HumanEval prompts")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="each prompt cut to at most this many tokens")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--budget", default="4.5GiB", help="device memory")
    ap.add_argument("--out", default="revisions", help="docs/perf/<out>.json and its README section")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--revision", default="new", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="local", help=argparse.SUPPRESS)
    ap.add_argument("--system", default="nodraft", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    from scripts.common import PERF, median_spread, run_meta, utc_now, write_json
    from scripts.readme_section import write_section

    if args.baseline is None or not (args.baseline / "specoffload").is_dir():
        raise SystemExit("--baseline must be a folder with an installed specoffload (see the module docstring)")
    if args.quick:
        args.rounds, args.reps = 1, 2
    combos = [tuple(c.split(":")) for c in args.combos.split(",")]
    if not combos or any(c not in COMBOS for c in combos):
        raise SystemExit(f"--combos: pairs of {[f'{b}:{s}' for b, s in COMBOS]}")
    rates: dict[tuple[str, str, str], list[float]] = {}
    tokens: dict[tuple[str, str, str], list] = {}
    plans: dict[tuple[str, str, str], dict] = {}
    for round_ in range(args.rounds):
        order = ("old", "new", "new", "old") if round_ % 2 == 0 else ("new", "old", "old", "new")
        for revision in order:
            for backend, system in combos:
                key = (revision, backend, system)
                result = run_one(revision, args.baseline, backend, system, args)
                rates.setdefault(key, []).extend(result["rates"])
                tokens[key] = result["tokens"]
                plans[key] = {k: result.get(k) for k in ("plan", "passes", "io_over_compute")}
                print(f"round {round_} {revision:3s} {backend:5s} {system:7s}: "
                      f"{statistics.median(result['rates']):6.2f} tok/s", flush=True)
    identical = all(len({json.dumps(t) for (_, _, sys_), t in tokens.items() if sys_ == system}) == 1
                    for system in {system for _, system in combos})
    rows, summary = [], {"greedy_tokens_identical": identical}
    for (revision, backend, system), values in sorted(rates.items()):
        median, low, high = median_spread(values)
        rows.append({"revision": revision, "backend": backend, "system": system, "tok_s_median": median,
                     "tok_s_min": low, "tok_s_max": high, "n": len(values)} | plans[revision, backend, system])
    med = {(r["revision"], r["backend"], r["system"]): r["tok_s_median"] for r in rows}
    for backend, system in combos:
        summary[f"new_over_old_{backend}_{system}"] = med["new", backend, system] / med["old", backend, system]
        for revision in ("old", "new"):
            bound = plans[revision, backend, system]["io_over_compute"]
            if bound is not None:  # (the loader's busy seconds over the pass's compute seconds, last generate)
                summary[f"io_over_compute_{revision}_{backend}_{system}"] = bound
    for revision in ("old", "new"):
        if (revision, "ray", "draft") in med and (revision, "local", "draft") in med:
            summary[f"ray_overhead_{revision}"] = med[revision, "local", "draft"] / med[revision, "ray", "draft"] - 1
    workload = (f"{args.prompts} HumanEval prompts x up to {args.prompt_tokens} tokens, {args.new_tokens} new, "
                f"{args.budget}, disk tier")
    meta = run_meta("float32") | {"date": utc_now(), "baseline": args.label, "rounds": args.rounds,
                                  "reps": args.reps, "workload": workload}
    write_json(PERF / f"{args.out}.json", {"summary": summary, "meta": meta, "rows": rows})
    lines = ["| revision | backend | system | tok/s median | min | max | n | plan | passes | io / compute |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    lines += [f"| {r['revision']} | {r['backend']} | {r['system']} | {r['tok_s_median']:.2f} | {r['tok_s_min']:.2f} "
              f"| {r['tok_s_max']:.2f} | {r['n']} | {r['plan'] or '-'} | {r['passes'] or '-'} | "
              f"{'-' if r['io_over_compute'] is None else format(r['io_over_compute'], '.2f')} |" for r in rows]
    text = (f"Run {meta['date']}, baseline `{args.label}` (old) against the working tree (new), {args.rounds} ABBA "
            f"round(s) x {args.reps} timed generates per process; {meta['workload']}. "
            + ("Ray overhead = local / ray - 1 (time per token); " if any(b == "ray" for b, _ in combos) else "")
            + f"Local rows: the engine's plan after the job, the target passes and io / compute (the "
            f"loader's busy seconds over the passes' compute seconds, of the last generate: above 1 the pass waits on "
            f"its reads). Greedy tokens identical across revisions and backends: {identical}.\n\n"
            + "\n".join(lines) + "\n\n" + "Summary: " + ", ".join(f"{k} = {v:.3f}" if isinstance(v, float)
                                                                    else f"{k} = {v}" for k, v in summary.items()))
    write_section(PERF / "README.md", args.out, text, heading=f"{args.out} (`scripts/bench_revisions.py`)")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
