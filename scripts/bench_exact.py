"""What exact mode costs (EngineConfig.exact, runtime/models/linear.py `exact_rows`), bfloat16, in one run.

    python -m scripts.bench_exact [--reps 3] [--quick]

Two regimes, each plain and exact alternating per repetition, HumanEval prompts, greedy, EOS ignored:
  - resident: the dense 1.5B, all weights in memory, one batch of every prompt, without a draft and with ngram
    (k 4): compute-bound, so exact mode's extra work (GEMMs in blocks of 32 rows, each block re-reading its weight;
    attention per query) shows in full;
  - tight: the moefied MoE (its bfloat16 copy) streamed from disk under 1.05 GiB, batch 8, no draft: the pass waits
    on its reads (load > compute per pass), so the extra compute hides behind them while exact compute < load.
Reported per regime and drafter: tokens/s (prefill counted) plain and exact, `exact_cost_<regime>_<drafter>` = exact
over plain (median of the per-repetition ratios, and each), and beside it the bound from the trace (tight): load and
compute seconds per pass of both, since exact mode costs nothing a pass cannot hide while its compute stays below its
load. Also whether exact drafted rows equal exact no-draft rows (`exact_rows_identical_*`). JSON under docs/perf/
(--quick: docs/perf/scratch/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

from scripts.common import PERF, io_compute_seconds, median_spread, run_meta, timed_generate, utc_now, write_json
from scripts.get_models import model_dir
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.prompts import humaneval_prompts
from specoffload.runtime.sampling import SamplingParams

MOEFIED_BF16 = "qwen2.5-coder-1.5b-moefied-bf16"  # scripts/bench_compressed.py `bf16_copy` of the moefied MoE


def _extra(engine, _start: float) -> dict:  # noqa: ANN001
    load, compute = io_compute_seconds(engine)
    passes = max(engine.last_stats.passes, 1)
    return {"load_s_per_pass": load / passes, "compute_s_per_pass": compute / passes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="resident prompts (tight: the first 8)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budget", default="1.05GiB", help="the tight regime's --device-memory")
    ap.add_argument("--regimes", default="resident,tight")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 8 new tokens, 1 rep")
    ap.add_argument("--out", default="exact_cost")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.reps = 4, 8, 1
    meta = run_meta("bfloat16")
    from transformers import AutoTokenizer

    prompts = [AutoTokenizer.from_pretrained(model_dir("target")).encode(p) for p in humaneval_prompts(args.prompts)]
    seq = max(len(p) for p in prompts) + args.new_tokens  # (KV sized to the job: the tight budget has no room)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    cases = []  # (regime, drafter, config without exact)
    regimes = args.regimes.split(",")
    if "resident" in regimes:
        base = dict(target=model_dir("target"), dtype="bfloat16", max_batch_size=len(prompts), max_seq_len=seq,
                    trace=True)
        cases += [("resident", "none", EngineConfig(**base)),
                  ("resident", "ngram", EngineConfig(**base, drafter="ngram", num_draft_tokens=4))]
    if "tight" in regimes:
        moefied = model_dir("target").parent / MOEFIED_BF16
        if not moefied.is_dir():
            ap.error(f"{moefied} missing: build it with scripts.bench_compressed --target moefied --variants bf16")
        cases.append(("tight", "none", EngineConfig(target=moefied, dtype="bfloat16", device_memory=args.budget,
                                                    max_batch_size=8, num_draft_tokens=0, max_seq_len=seq,
                                                    trace=True)))
    runs: dict[tuple[str, str, bool], list[dict]] = {}
    for rep in range(args.reps):
        for regime, drafter, config in cases:
            for exact in (False, True) if rep % 2 == 0 else (True, False):  # alternating which goes first
                work = prompts if regime == "resident" else prompts[:8]
                r = timed_generate(replace(config, exact=exact), work, params, extra=_extra)
                runs.setdefault((regime, drafter, exact), []).append(r)
                print(f"rep {rep} {regime} {drafter} exact={exact}: {r['tok_s']:.2f} tok/s, "
                      f"load {r['load_s_per_pass']:.2f} s / compute {r['compute_s_per_pass']:.2f} s per pass",
                      file=sys.stderr, flush=True)
    summary, rows = {}, []
    for regime, drafter, _ in cases:
        plain, exact = runs[regime, drafter, False], runs[regime, drafter, True]
        ratios = [e["tok_s"] / p["tok_s"] for p, e in zip(plain, exact, strict=True)]
        key = f"{regime}_{drafter}"
        summary[f"exact_cost_{key}"] = round(statistics.median(ratios), 3)
        summary[f"exact_cost_{key}_per_rep"] = [round(x, 3) for x in ratios]
        row = {"regime": regime, "drafter": drafter}
        for name, rs in (("plain", plain), ("exact", exact)):
            med, lo, hi = median_spread(r["tok_s"] for r in rs)
            row |= {f"{name}_tok_s": med, f"{name}_tok_s_min": lo, f"{name}_tok_s_max": hi,
                    f"{name}_load_s_per_pass": statistics.median(r["load_s_per_pass"] for r in rs),
                    f"{name}_compute_s_per_pass": statistics.median(r["compute_s_per_pass"] for r in rs),
                    f"{name}_runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rs]}
        if regime == "tight":
            summary[f"exact_compute_over_load_{key}"] = round(row["exact_compute_s_per_pass"]
                                                              / row["exact_load_s_per_pass"], 3)
        rows.append(row)
        if drafter != "none":  # exact drafted rows against exact no-draft rows of the same regime
            same = [a == b for a, b in zip(runs[regime, "none", True][0]["token_ids"], exact[0]["token_ids"])]
            summary[f"exact_rows_identical_{key}"] = f"{sum(same)}/{len(same)}"
    print("\n| regime | drafter | plain tok/s (min-max) | exact tok/s (min-max) | exact / plain (per rep) | "
          "load / compute s per pass, plain | exact |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        cost = f"exact_cost_{r['regime']}_{r['drafter']}"
        print(f"| {r['regime']} | {r['drafter']} | {r['plain_tok_s']:.2f} ({r['plain_tok_s_min']:.2f}-"
              f"{r['plain_tok_s_max']:.2f}) | {r['exact_tok_s']:.2f} ({r['exact_tok_s_min']:.2f}-"
              f"{r['exact_tok_s_max']:.2f}) | {summary[cost]} ({summary[f'{cost}_per_rep']}) | "
              f"{r['plain_load_s_per_pass']:.2f} / {r['plain_compute_s_per_pass']:.2f} | "
              f"{r['exact_load_s_per_pass']:.2f} / {r['exact_compute_s_per_pass']:.2f} |")
    out = PERF / ("scratch/" if args.quick else "") / f"{args.out}.json"
    write_json(out, {"summary": summary, **meta, "end": utc_now(), "rows": rows, "prompts": args.prompts,
                     "new_tokens": args.new_tokens, "reps": args.reps, "budget": args.budget, "quick": args.quick})
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
