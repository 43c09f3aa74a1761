"""What putting the head first in the placement order gains at a tight budget (planner/placement.py
`head_first`), bfloat16, in one run.

    python -m scripts.bench_head_first [--target moefied|dense] [--budget 1.05GiB] [--reps 3] [--quick]

The target's bfloat16 copy (scripts/bench_compressed.py `bf16_copy`; the moefied MoE's untied 467 MB head is five
times a layer) streamed from disk at `--budget`, batch 8, 8 HumanEval prompts, greedy, EOS ignored, no draft, two
arms alternating per repetition:
  - before: the order before the change (routers, attention, then the head): here `head_first` is patched
    to say no, so a streamed head sizes both ring slots;
  - after: the engine as it is (the head resident first where it is larger than every layer unit).
Reported: tokens/s (prefill counted) of each arm, `head_first_over_before` (median of the per-repetition ratios,
and each), bytes read per pass, and the bound beside it (each arm's load and compute seconds per pass from the
trace: the pass waits on its reads while load > compute, so fewer bytes a pass is what there is to gain). The
outputs of both arms are compared (a placement must not change a token). JSON under docs/perf/ (--quick:
docs/perf/scratch/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from unittest import mock

from scripts.common import PERF, io_compute_seconds, median_spread, run_meta, timed_generate, utc_now, write_json
from scripts.get_models import model_dir
from specoffload.planner import placement
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.prompts import humaneval_prompts
from specoffload.runtime.sampling import SamplingParams

#: scripts/bench_compressed.py `bf16_copy` of each target
BF16 = {"moefied": "qwen2.5-coder-1.5b-moefied-bf16", "dense": "qwen2.5-coder-1.5b-instruct-bf16"}


def _extra(engine, _start: float) -> dict:  # noqa: ANN001
    load, compute = io_compute_seconds(engine)
    passes = max(engine.last_stats.passes, 1)
    resident = [i.name for i in engine.placement.items if i.tier == "device"]
    return {"load_s_per_pass": load / passes, "compute_s_per_pass": compute / passes,
            "bytes_per_pass": engine.last_stats.bytes_read / passes, "slot_bytes": engine.placement.slot_bytes,
            "device_items": resident}


@contextmanager
def _arm(name: str):  # noqa: ANN202
    """The placement order of arm `name`: "before" patches `head_first` to False (the head after attention)."""
    if name == "after":
        yield
        return
    with mock.patch.object(placement, "head_first", lambda *a, **k: False):
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=sorted(BF16), default="moefied")
    ap.add_argument("--budget", default="1.05GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="2 prompts, 4 new tokens, 1 rep")
    ap.add_argument("--out", default="head_first")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.reps = 2, 4, 1
    meta = run_meta("bfloat16")
    target = model_dir("target").parent / BF16[args.target]
    if not target.is_dir():
        ap.error(f"{target} missing: build it with scripts.bench_compressed --target {args.target} --variants bf16")
    from transformers import AutoTokenizer

    prompts = [AutoTokenizer.from_pretrained(target).encode(p) for p in humaneval_prompts(args.prompts)]
    config = EngineConfig(target=target, dtype="bfloat16", device_memory=args.budget, max_batch_size=8,
                          num_draft_tokens=0, max_seq_len=max(map(len, prompts)) + args.new_tokens, trace=True)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for rep in range(args.reps):
        for name in ("before", "after") if rep % 2 == 0 else ("after", "before"):
            with _arm(name):
                r = timed_generate(config, prompts, params, extra=_extra)
            runs[name].append(r)
            print(f"rep {rep} {name}: {r['tok_s']:.2f} tok/s, {r['bytes_per_pass'] / 1e9:.2f} GB a pass, load "
                  f"{r['load_s_per_pass']:.2f} s / compute {r['compute_s_per_pass']:.2f} s per pass",
                  file=sys.stderr, flush=True)
    ratios = [a["tok_s"] / b["tok_s"] for b, a in zip(runs["before"], runs["after"], strict=True)]
    rows = {}
    for name, rs in runs.items():
        med, lo, hi = median_spread(r["tok_s"] for r in rs)
        rows[name] = {"tok_s": med, "tok_s_min": lo, "tok_s_max": hi,
                      "bytes_per_pass": statistics.median(r["bytes_per_pass"] for r in rs),
                      "load_s_per_pass": statistics.median(r["load_s_per_pass"] for r in rs),
                      "compute_s_per_pass": statistics.median(r["compute_s_per_pass"] for r in rs),
                      "slot_bytes": rs[0]["slot_bytes"], "device_items": rs[0]["device_items"],
                      "runs": [{k: v for k, v in r.items() if k not in ("token_ids", "device_items")} for r in rs]}
    summary = {"head_first_over_before": round(statistics.median(ratios), 3),
               "head_first_over_before_per_rep": [round(x, 3) for x in ratios],
               "bytes_per_pass_ratio": round(rows["after"]["bytes_per_pass"] / rows["before"]["bytes_per_pass"], 3),
               "io_over_compute_before": round(rows["before"]["load_s_per_pass"]
                                               / rows["before"]["compute_s_per_pass"], 3),
               "io_over_compute_after": round(rows["after"]["load_s_per_pass"]
                                              / rows["after"]["compute_s_per_pass"], 3),
               "outputs_identical": runs["before"][0]["token_ids"] == runs["after"][0]["token_ids"]}
    print("\n| arm | tok/s (min-max) | GB read a pass | slot MB | load / compute s a pass |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['tok_s']:.2f} ({row['tok_s_min']:.2f}-{row['tok_s_max']:.2f}) | "
              f"{row['bytes_per_pass'] / 1e9:.2f} | {row['slot_bytes'] / 1e6:.0f} | "
              f"{row['load_s_per_pass']:.2f} / {row['compute_s_per_pass']:.2f} |")
    print(summary)
    out = PERF / ("scratch/" if args.quick else "") / f"{args.out}.json"
    write_json(out, {"summary": summary, **meta, "end": utc_now(), "rows": rows, "target": args.target,
                     "budget": args.budget,
                     "prompts": args.prompts, "new_tokens": args.new_tokens, "reps": args.reps, "quick": args.quick})
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
