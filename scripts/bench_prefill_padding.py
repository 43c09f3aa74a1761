#!/usr/bin/env python
"""Benchmark: a padded prefill's dense FFN on every padded position (baseline) vs on the valid tokens only (ours).

A prefill pads every row of a batch to its longest prompt (right padding). The baseline runs the dense FFN on all
rows x padded-length positions; ours runs it on the valid tokens only (runtime/models/model.py `Transformer.ffn`
with the batch's token mask), since a padded position's output is never read. On a batch of 16 prose prompts
(mean 122, longest 329 tokens) that is 2.7x fewer tokens. This measures it at the op in one run: for each corpus
(the validation's: HumanEval prompts and prose paragraphs, whole, tokenized by the target's tokenizer), one batch
of `--rows` prompts, both variants of one layer's FFN of the real target on the same hidden states, alternating,
`--reps` times each (median, min, max), the FLOPs each does, and the machine's roofline: the time those FLOPs take
at the GEMM rate measured in the same run at the same shape with enough rows to saturate it. Ours must give the
baseline's output on every valid position (checked to 1e-5 relative).

Weights are used unpacked, as streamed layers are (the resident ones are packed: the same saving applies).

    python -m scripts.bench_prefill_padding            # 16 rows, 5 repetitions, code and prose
    python -m scripts.bench_prefill_padding --quick    # 8 rows, 2 repetitions, prose only

Writes docs/perf/prefill_padding.json ("summary": ffn_speedup per corpus) and a section of docs/perf/README.md.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch

from scripts.common import PERF, median_spread, utc_now, write_json
from scripts.get_models import model_dir
from scripts.readme_section import write_section
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.prompts import humaneval_prompts, prose_prompts
from specoffload.runtime.tokenizer import load_tokenizer

CORPORA = {"code": humaneval_prompts, "prose": prose_prompts}
LAYER = 0


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call of `fn`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gemm_roofline(hidden: int, inter: int, rows: int, reps: int) -> float:
    """FLOP/s of the FFN's three GEMMs (gate and up: H -> I; down: I -> H) at `rows` rows, best of `reps`."""
    linear = torch.nn.functional.linear
    x, mid = torch.randn(rows, hidden), torch.randn(rows, inter)  # [rows, H], [rows, I]
    w_in, w_out = torch.randn(inter, hidden), torch.randn(hidden, inter)  # [I, H], [H, I]
    with torch.inference_mode():
        best = min(timed(lambda: (linear(x, w_in), linear(x, w_in), linear(mid, w_out))) for _ in range(reps))
    return 2.0 * rows * hidden * inter * 3 / best


def run_corpus(model: Transformer, tok, corpus: str, rows: int, reps: int) -> dict:  # noqa: ANN001
    cfg = model.config
    prompts = [tok.encode(p, add_special_tokens=False) for p in CORPORA[corpus](rows)]
    lens = torch.tensor([len(p) for p in prompts])  # [rows]
    padded = int(lens.max())
    mask = torch.arange(padded)[None, :] < lens[:, None]  # [rows, padded]
    torch.manual_seed(0)
    hidden = torch.randn(rows, padded, cfg.hidden_size)  # [rows, padded, H]: the layer's input
    with torch.inference_mode():
        base_out = model.ffn(LAYER, hidden, None)  # [rows, padded, H] (also warms the weights and allocator)
        ours_out = model.ffn(LAYER, hidden, mask)
        err = float((ours_out - base_out)[mask].abs().max() / base_out[mask].abs().max())
        base_t, ours_t = [], []
        for _ in range(reps):  # alternating, so a drift of the machine hits both alike
            base_t.append(timed(lambda: model.ffn(LAYER, hidden, None)))
            ours_t.append(timed(lambda: model.ffn(LAYER, hidden, mask)))
    flops_token = 2.0 * 3 * cfg.hidden_size * cfg.intermediate_size
    valid, total = int(mask.sum()), rows * padded
    return {"corpus": corpus, "rows": rows, "mean_len": float(lens.float().mean()), "padded_len": padded,
            "valid_tokens": valid, "padded_tokens": total, "baseline_s": base_t, "ours_s": ours_t,
            "baseline_flops": flops_token * total, "ours_flops": flops_token * valid, "max_rel_error": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="prompts in the batch (default 16, the validation's)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="8 rows, 2 repetitions, prose only")
    args = ap.parse_args()
    rows, reps, corpora = (8, 2, ["prose"]) if args.quick else (args.rows, args.reps, list(CORPORA))
    target = model_dir("target")
    tok = load_tokenizer(target)
    if tok is None:
        raise SystemExit(f"no tokenizer in {target}: run `python -m scripts.get_models` first")
    model = Transformer(target)
    model.pack = False  # as a streamed layer's weights are used
    cfg = model.config
    results = [run_corpus(model, tok, c, rows, reps) for c in corpora]
    rate = gemm_roofline(cfg.hidden_size, cfg.intermediate_size, 2048, 3)
    for r in results:
        r["baseline"] = dict(zip(("median", "min", "max"), median_spread(r["baseline_s"])))
        r["ours"] = dict(zip(("median", "min", "max"), median_spread(r["ours_s"])))
        r["roofline_baseline_s"], r["roofline_ours_s"] = r["baseline_flops"] / rate, r["ours_flops"] / rate
        r["speedup"] = r["baseline"]["median"] / r["ours"]["median"]
        assert r["max_rel_error"] <= 1e-5, f"{r['corpus']}: ours differs from the baseline on valid tokens"
    summary = {f"ffn_speedup_{r['corpus']}": r["speedup"] for r in results} | {
        f"padding_ratio_{r['corpus']}": r["padded_tokens"] / r["valid_tokens"] for r in results}
    data = {"meta": {"date": utc_now(), "machine": platform.node(), "cpu_threads": torch.get_num_threads(),
                     "torch": torch.__version__, "model": target.name, "layer": LAYER, "quick": args.quick,
                     "gemm_flops_per_s_at_2048_rows": rate},
            "summary": summary, "results": results}
    path = write_json(PERF / "prefill_padding.json", data)
    lines = ["| corpus | rows | mean / padded len | tokens valid / padded | baseline s (min-max) | ours s (min-max) "
             "| speedup | roofline base / ours s |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, o = r["baseline"], r["ours"]
        lines.append(f"| {r['corpus']} | {r['rows']} | {r['mean_len']:.0f} / {r['padded_len']} | {r['valid_tokens']} / "
                     f"{r['padded_tokens']} | {b['median']:.2f} ({b['min']:.2f}-{b['max']:.2f}) | {o['median']:.2f} "
                     f"({o['min']:.2f}-{o['max']:.2f}) | {r['speedup']:.2f}x | {r['roofline_baseline_s']:.2f} / "
                     f"{r['roofline_ours_s']:.2f} |")
    table = "\n".join(lines)
    print(table)
    body = (f"One layer's dense FFN of {target.name} on a padded prefill batch, fp32, unpacked weights, "
            f"{torch.get_num_threads()} threads, {reps} alternating repetitions in one run ({utc_now()[:10]}); "
            f"roofline: the FLOPs at the GEMM rate measured in the same run ({rate / 1e9:.0f} GFLOP/s at 2048 rows). "
            "Outputs on valid positions equal the baseline's (max relative difference "
            f"{max(r['max_rel_error'] for r in results):.1e}).\n\n{table}\n\nJSON: `{path.relative_to(PERF)}`.")
    write_section(PERF / "README.md", "prefill_padding", body,
                  heading="prefill_padding (`scripts/bench_prefill_padding.py`)")


if __name__ == "__main__":
    main()
