"""The kernel table of issue 34: one FFN layer's GEMMs of the real 1.5B (gate and up [8960, 1536], down [1536, 8960])
at 1, 8, 32 and 128 rows, per weight format, the weight as a streamed slot holds it, in the compute dtype bfloat16.

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_kernels [--quick]

Per format and row count, two ways of multiplying (each the engine's, runtime/models/packed.py):

    kernel    the format's packed weight through its torch kernel: bf16 the engine's `linear` on a 16-bit weight
              (F.linear; where the CPU has no native bfloat16 GEMM, float32 from 48 rows); int8 (per
              channel) `_weight_int8pack_mm`; int4k g32 / g128 `_weight_int4pack_mm_for_cpu`; int8g g32 / g64 the
              int4 kernel over [x, x] and the halves H | L (`PackedInt8Split`)
    dequant   the packed weight dequantized to bfloat16, then `linear` (what `packed_linear` does above the format's
              row limit, and what a loader without packed slots pays per weight per pass)

The table gives layer tokens/s (rows / the three GEMMs' seconds) and the milliseconds; `engine` is the way
`packed_linear` picks at that row count. The summary: per format and rows the kernel's tokens/s over bf16's
(`<label>_kernel_over_bf16_<rows>`), int8g's kernel against int8's (`int8g32_over_int8_<rows>`), and the crossover
row count of the int8g kernel against dequant (`int8g32_kernel_faster_up_to_rows`: the largest measured row count
where the kernel wins; INT8G_MAX_ROWS is set from it). Median of REPS timings, min and max beside. A quick run
(one row count pair, 3 reps) writes docs/perf/scratch/<out>_quick.json; --out names the file (default kernels).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from scripts.common import PERF, median_spread, run_meta, timed_samples, write_json
from specoffload.runtime.formats import weight_format
from specoffload.runtime.models.linear import linear
from specoffload.runtime.models.packed import (
    INT8G_MAX_ROWS,
    PACKED_MAX_ROWS,
    PackedInt4,
    PackedInt8,
    int4_kernel_ok,
)

LAYER = ((8960, 1536), (8960, 1536), (1536, 8960))  # gate, up, down of Qwen2.5-Coder-1.5B
ROWS = (1, 8, 32, 48, 64, 96, 128)
REPS = 7
FORMATS = (("bf16", None), ("int8", weight_format("int8")), ("int8g32", weight_format("int8g", 32)),
           ("int8g64", weight_format("int8g", 64)), ("int4g32", weight_format("int4k", 32)),
           ("int4g128", weight_format("int4k", 128)))


def _kernel(w: object, x: torch.Tensor) -> torch.Tensor:
    if isinstance(w, PackedInt4):  # (and PackedInt8Split)
        return w.matmul(x)
    if isinstance(w, PackedInt8):
        return torch._weight_int8pack_mm(x, w.qweight, w.scale)
    return linear(x, w)  # type: ignore[arg-type]


def _dequant(w: object, x: torch.Tensor) -> torch.Tensor:
    return linear(x, w.dequantize()) if isinstance(w, (PackedInt4, PackedInt8)) else linear(x, w)  # type: ignore


def _layer(fn, weights: list[object], x_in: list[torch.Tensor]) -> None:  # noqa: ANN001
    for w, x in zip(weights, x_in):
        fn(w, x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="rows 1 and 8, 3 reps: a smoke run (scratch/)")
    ap.add_argument("--out", default="kernels", help="docs/perf/<out>.json (another machine's table: its own name)")
    args = ap.parse_args()
    if not (int4_kernel_ok() and hasattr(torch, "_weight_int8pack_mm")):
        print("this torch has no CPU int4 / int8 weight-only kernel: nothing to measure", file=sys.stderr)
        return 1
    meta = run_meta("bfloat16")
    reps, rows_list = (3, ROWS[:2]) if args.quick else (REPS, ROWS)
    g = torch.Generator().manual_seed(0)
    source = [torch.randn(shape, generator=g) * 0.02 for shape in LAYER]  # [out, in] float32
    table: list[dict] = []
    ms: dict[tuple[str, str, int], float] = {}
    for label, fmt in FORMATS:
        if fmt is None:
            weights: list[object] = [w.bfloat16() for w in source]
        else:
            weights = [fmt.packed_copy(fmt.quantize_rows(w), tuple(w.shape), torch.bfloat16) for w in source]
        limit = getattr(weights[0], "max_rows", PACKED_MAX_ROWS if label == "int8" else 10**9)  # packed_linear's
        for rows in rows_list:
            x_in = [torch.randn(rows, shape[1], generator=g).bfloat16() for shape in LAYER]
            for way, fn in (("kernel", _kernel), ("dequant", _dequant)):
                if fmt is None and way == "dequant":
                    continue
                med, lo, hi = median_spread(timed_samples(partial(_layer, fn, weights, x_in), reps))
                ms[label, way, rows] = med * 1e3
                table.append({"format": label, "way": way, "rows": rows, "ms": med * 1e3, "min_ms": lo * 1e3,
                              "max_ms": hi * 1e3, "tok_s": rows / med,
                              "engine": way == ("kernel" if rows <= limit or fmt is None else "dequant")})
                print(f"{label:9} {way:8} {rows:4} rows: {med * 1e3:8.2f} ms ({lo * 1e3:.2f}-{hi * 1e3:.2f})",
                      file=sys.stderr)
    summary: dict[str, object] = {"layer": "3 FFN GEMMs of Qwen2.5-Coder-1.5B", "dtype": "bfloat16",
                                  "quick": args.quick}
    for label, _ in FORMATS[1:]:
        for rows in rows_list:
            summary[f"{label}_kernel_over_bf16_{rows}"] = round(ms["bf16", "kernel", rows] / ms[label, "kernel", rows],
                                                                3)
    for rows in rows_list:
        summary[f"int8g32_over_int8_{rows}"] = round(ms["int8", "kernel", rows] / ms["int8g32", "kernel", rows], 3)
    wins = [r for r in rows_list if ms["int8g32", "kernel", r] < ms["int8g32", "dequant", r]]
    summary["int8g32_kernel_faster_up_to_rows"] = max(wins) if wins else 0
    summary["int8g_max_rows_in_engine"] = INT8G_MAX_ROWS
    print("\n| format | rows | kernel tok/s | kernel ms | dequant + GEMM ms | engine uses |")
    print("|---|---:|---:|---:|---:|---|")
    for label, _ in FORMATS:
        for rows in rows_list:
            k, d = ms[label, "kernel", rows], ms.get((label, "dequant", rows))
            used = next(r["way"] for r in table if r["format"] == label and r["rows"] == rows and r["engine"])
            print(f"| {label} | {rows} | {rows / k * 1e3:.0f} | {k:.2f} | {'' if d is None else f'{d:.2f}'} | "
                  f"{used} |")
    print(summary)
    path = write_json(PERF / (f"scratch/{args.out}_quick.json" if args.quick else f"{args.out}.json"),
                      {"summary": summary, **meta, "reps": reps, "shapes": LAYER, "rows": table})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
