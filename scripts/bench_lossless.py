#!/usr/bin/env python3
"""How often speculative greedy output differs from the same engine's no-draft output, per dtype and drafter
(issue 25 item 6), on the real Qwen2.5-Coder-1.5B target (resident, the CPU).

Verification is exact arithmetic on the target's logits, but the logits of a pass over k + 1 tokens are not
bit-identical to k + 1 passes over one token (a different GEMM shape sums in a different order), so wherever the
target's top two logits are closer than that rounding, the argmax can flip and the row continues differently.
This measures how often that happens: rows of the same prompts, greedy, EOS ignored, each drafter against no-draft
in the same dtype and the same run; the first differing position and the logit margin at it are reported.

With --exact each dtype runs again in exact mode (EngineConfig.exact: each row computed as it would be alone), its
drafted rows compared with its own no-draft rows, and its cost is the tokens/s of the exact run over the plain one
(one run each, so the host's noise is in it: scripts/bench_exact.py times it alternating).

    python -m scripts.bench_lossless [--prompts 8] [--new-tokens 64] [--exact] [--quick]

Writes docs/perf/lossless.json (top-level "summary": rows_differing per dtype (and _exact) and drafter).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from scripts.common import PERF, run_meta, utc_now, write_json
from scripts.get_models import model_dir
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.corpora import dataset_prompts
from specoffload.runtime.engine import Engine
from specoffload.runtime.errors import ConfigError
from specoffload.runtime.prompts import humaneval_prompts
from specoffload.runtime.sampling import SamplingParams


def _run(config: EngineConfig, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float, dict]:
    engine = Engine(config)
    t = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    s = engine.last_stats
    info = {"acceptance": s.acceptance_rate if s.num_drafted else None, "tok_s": s.generated_tokens / wall}
    return [r.token_ids for r in results], wall, info


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per corpus (HumanEval and aclsum)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--drafters", default="model,ngram")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--exact", action="store_true", help="also run each dtype in exact mode (docstring)")
    ap.add_argument("--quick", action="store_true", help="2 prompts per corpus, 16 new tokens, float32 only")
    ap.add_argument("--out", default="lossless")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.dtypes = 2, 16, "float32"
    torch.set_num_threads(2)
    meta = run_meta(args.dtypes)
    target, draft = model_dir("target"), model_dir("draft")
    prompts = humaneval_prompts(args.prompts)
    try:
        prompts += dataset_prompts(f"aclsum:0:{args.prompts}")
    except Exception as exc:  # noqa: BLE001 - the corpus is optional: say so and go on with code only
        print(f"aclsum unavailable ({exc}); HumanEval only", file=sys.stderr)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    configs = {}  # every configuration checked before the first (minutes-long) run: a bad one fails at once
    exacts = (False, True) if args.exact else (False,)
    modes = [(dtype, exact) for dtype in args.dtypes.split(",") for exact in exacts]
    for dtype, exact in modes:
        base = dict(target=target, dtype=dtype, max_batch_size=len(prompts), max_seq_len=2048, exact=exact)
        dtype = f"{dtype}_exact" if exact else dtype
        configs[dtype, None] = EngineConfig(**base)
        for drafter in args.drafters.split(","):
            extra = dict(draft=draft) if drafter == "model" else dict(drafter=drafter)
            try:
                configs[dtype, drafter] = EngineConfig(**base, **extra, num_draft_tokens=args.k)
            except ConfigError as exc:
                ap.error(f"--drafters {drafter}: {exc} (this benchmark runs the resident engine)")
    rows, summary, nodraft = [], {}, {}
    for dtype in [f"{d}_exact" if exact else d for d, exact in modes]:
        ref, wall, info = _run(configs[dtype, None], prompts, params)
        nodraft[dtype] = ref, info
        rows.append({"dtype": dtype, "drafter": "none", "rows": len(prompts), "wall_s": wall, **info})
        print(f"{dtype} no draft: {wall:.0f} s", flush=True)
        for drafter in args.drafters.split(","):
            out, wall, info = _run(configs[dtype, drafter], prompts, params)
            diffs = [_first_diff(a, b) for a, b in zip(ref, out)]
            differing = sum(d is not None for d in diffs)
            rows.append({"dtype": dtype, "drafter": drafter, "k": args.k, "rows": len(prompts),
                         "rows_differing": differing, "first_difference": diffs, "wall_s": wall, **info})
            summary[f"rows_differing_{dtype}_{drafter}"] = f"{differing}/{len(prompts)}"
            if dtype.endswith("_exact"):  # the same drafter without exact mode ran before
                plain = next(r for r in rows if r["dtype"] == dtype.removesuffix("_exact") and r["drafter"] == drafter)
                summary[f"exact_cost_{dtype.removesuffix('_exact')}_{drafter}"] = round(
                    info["tok_s"] / plain["tok_s"], 3)
            print(f"{dtype} {drafter}: {differing} of {len(prompts)} rows differ from no-draft "
                  f"(first at {[d for d in diffs if d is not None]}), acceptance {info['acceptance']}, "
                  f"{wall:.0f} s", flush=True)
    for dtype in (d for d in nodraft if d.endswith("_exact")):  # exact mode's own output against the plain one's
        plain = dtype.removesuffix("_exact")
        diffs = [_first_diff(a, b) for a, b in zip(nodraft[plain][0], nodraft[dtype][0])]
        summary[f"rows_differing_{dtype}_none_vs_{plain}_none"] = f"{sum(d is not None for d in diffs)}/{len(prompts)}"
        summary[f"exact_cost_{plain}_none"] = round(nodraft[dtype][1]["tok_s"] / nodraft[plain][1]["tok_s"], 3)
    print("\n| dtype | drafter | rows differing from no-draft | first differing positions | acceptance |")
    print("|---|---|---:|---|---:|")
    for r in rows:
        if r["drafter"] == "none":
            continue
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        firsts = [d for d in r["first_difference"] if d is not None]
        print(f"| {r['dtype']} | {r['drafter']} | {r['rows_differing']}/{r['rows']} | {firsts or '-'} | {acc} |")
    out = PERF / ("scratch/" if args.quick else "") / f"{args.out}.json"
    write_json(out, {"summary": summary, **meta, "end": utc_now(), "rows": rows, "target": target.name,
                     "draft": draft.name, "new_tokens": args.new_tokens, "threads": 2, "quick": args.quick})
    return 0


if __name__ == "__main__":
    sys.exit(main())
