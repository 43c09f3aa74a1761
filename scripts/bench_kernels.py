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
where the kernel wins; INT8G_MAX_ROWS is set from it). Median of REPS timings, min and max beside.

GGUF blocks (q4_k, q6_k: random blocks of the same shapes; `PackedBlocks`, runtime/kernels/ggml.c) at BLOCK_ROWS:
`kernel` is the engine's build of ggml.c (its vector path for this CPU: AVX-512 or AVX2, `ggml_isa` in the summary),
`portable` the same source built without a vector path (what this CPU ran before it had one), `dequant` the
native build's 16-bit copy then `linear`; in bfloat16 (weights rounded) unless --blocks-dtype float32, where on AVX2
`decoded` is the native build that decodes every weight (before it factored the float32 sums: ggml.c
`tile_factored`) and the summary has `<kind>_kernel_over_decoded_<rows>`; in bfloat16 on a CPU with AVX512-BF16
`nodot` is the native build without its pair products (ggml.c `tile_dot`): `<kind>_kernel_over_nodot_<rows>`;
`--vs REV` adds ggml.c as of git revision REV, built for this CPU (`<kind>_kernel_over_<REV>_<rows>`).
Summary: `<kind>_kernel_over_portable_<rows>`, `<kind>_kernel_over_bf16_<rows>` and `_over_int4g32_<rows>` (torch's
int4 kernel, what a q4_k weight is repacked for without the ggml kernel; at the row counts both were measured), and
`<kind>_kernel_faster_up_to_rows`
(BLOCKS_MAX_ROWS is set from it). `--blocks-only` measures these with bf16 and int4 g32 only. A quick
run (one row count pair, 3 reps) writes docs/perf/scratch/<out>_quick.json; --out names the file (default kernels).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch

from scripts.common import PERF, median_spread, run_meta, timed_samples, write_json
from specoffload.runtime import kernels
from specoffload.runtime.formats import weight_format
from specoffload.runtime.formats.ggml import block_kernel
from specoffload.runtime.models.linear import linear
from specoffload.runtime.models.packed import (
    BLOCKS_MAX_ROWS,
    INT8G_MAX_ROWS,
    PACKED_MAX_ROWS,
    PackedInt4,
    PackedInt8,
    int4_kernel_ok,
)

LAYER = ((8960, 1536), (8960, 1536), (1536, 8960))  # gate, up, down of Qwen2.5-Coder-1.5B
ROWS = (1, 8, 32, 48, 64, 96, 128)
#: row counts of the GGUF block kinds (the ggml kernel's range and the crossover with dequant + GEMM)
BLOCK_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96)
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


def _blocks(summary: dict, table: list[dict], ms: dict, rows_list: tuple[int, ...], reps: int,
            g: torch.Generator, dtype: torch.dtype = torch.bfloat16, vs: str | None = None) -> bool:
    """The GGUF block kinds' rows of the table (module docstring) in `dtype`; False where the ggml kernel is not
    built here."""
    native, path = block_kernel(), kernels.build(generic=True)
    if native is None or path is None:
        print("no ggml kernel here (no C compiler): the GGUF block rows are not measured", file=sys.stderr)
        return False
    builds = {"kernel": native, "portable": kernels._load(path)}
    if dtype == torch.float32 and native.isa == "avx2" and (decoded := kernels.build(decoded=True)) is not None:
        builds["decoded"] = kernels._load(decoded)  # (the AVX2 path before it factored float32 sums)
    if dtype == torch.bfloat16 and native.dot and (no_dot := kernels.build(no_dot=True)) is not None:
        builds["nodot"] = kernels._load(no_dot)  # (the AVX-512 path before it summed bfloat16 pairs: `tile_dot`)
    if vs is not None:  # ggml.c as of another revision, built for this CPU as the engine builds it
        text = subprocess.run(["git", "show", f"{vs}:runtime/kernels/ggml.c"], capture_output=True, check=True,
                              cwd=Path(__file__).resolve().parent.parent).stdout
        if (old := kernels.build(source=text)) is not None:
            builds[vs] = kernels._load(old)
    summary["ggml_isa"], summary["blocks_dtype"] = native.isa, str(dtype).removeprefix("torch.")
    for kind in kernels.KINDS:
        nb = [shape[1] // kernels.BLOCK_INPUTS[kind] for shape in LAYER]
        blocks = [kernels.random_blocks(kind, shape[0], n, g) for shape, n in zip(LAYER, nb)]
        ways = {name: (lambda b, x, k=kind, build=build: build.matmul(k, b, x, dtype=dtype))
                for name, build in builds.items()}
        ways["dequant"] = lambda b, x, k=kind: linear(x.to(dtype), native.dequantize(k, b, x.shape[1], dtype))
        for rows in rows_list:
            x_in = [torch.randn(rows, shape[1], generator=g) for shape in LAYER]  # float32: the kernel's input
            for way, fn in ways.items():
                med, lo, hi = median_spread(timed_samples(partial(_layer, fn, blocks, x_in), reps))
                ms[kind, way, rows] = med * 1e3
                table.append({"format": kind, "way": way, "rows": rows, "ms": med * 1e3, "min_ms": lo * 1e3,
                              "max_ms": hi * 1e3, "tok_s": rows / med,
                              "engine": way == ("kernel" if rows <= BLOCKS_MAX_ROWS else "dequant")})
                print(f"{kind:9} {way:8} {rows:4} rows: {med * 1e3:8.2f} ms ({lo * 1e3:.2f}-{hi * 1e3:.2f})",
                      file=sys.stderr)
            kernel_ms = ms[kind, "kernel", rows]
            for other in builds.keys() - {"kernel"}:
                summary[f"{kind}_kernel_over_{other}_{rows}"] = round(ms[kind, other, rows] / kernel_ms, 3)
            for other in ("bf16", "int4g32"):  # (where measured at these rows)
                if (other, "kernel", rows) in ms:
                    summary[f"{kind}_kernel_over_{other}_{rows}"] = round(ms[other, "kernel", rows] / kernel_ms, 3)
        wins = [r for r in rows_list if ms[kind, "kernel", r] < ms[kind, "dequant", r]]
        summary[f"{kind}_kernel_faster_up_to_rows"] = max(wins) if wins else 0
    summary["blocks_max_rows_in_engine"] = BLOCKS_MAX_ROWS
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="rows 1 and 8, 3 reps: a smoke run (scratch/)")
    ap.add_argument("--out", default="kernels", help="docs/perf/<out>.json (another machine's table: its own name)")
    ap.add_argument("--blocks-only", action="store_true",
                    help="the GGUF block kinds, with bf16 and int4 g32 beside them at BLOCK_ROWS, no other format")
    ap.add_argument("--blocks-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the GGUF block kinds' compute dtype (float32: weights not rounded; on AVX2 the build "
                         "that decodes every weight beside it)")
    ap.add_argument("--vs", default=None, metavar="REV",
                    help="also the ggml.c of git revision REV, built for this CPU (`<kind>_kernel_over_<REV>_<rows>`)")
    args = ap.parse_args()
    if not (int4_kernel_ok() and hasattr(torch, "_weight_int8pack_mm")):
        print("this torch has no CPU int4 / int8 weight-only kernel: nothing to measure", file=sys.stderr)
        return 1
    meta = run_meta("bfloat16")
    reps, rows_list = (3, ROWS[:2]) if args.quick else (REPS, ROWS)
    blocks_rows = BLOCK_ROWS[:3:2] if args.quick else BLOCK_ROWS
    formats = FORMATS
    if args.blocks_only:
        formats, rows_list = tuple(f for f in FORMATS if f[0] in ("bf16", "int4g32")), blocks_rows
    g = torch.Generator().manual_seed(0)
    source = [torch.randn(shape, generator=g) * 0.02 for shape in LAYER]  # [out, in] float32
    table: list[dict] = []
    ms: dict[tuple[str, str, int], float] = {}
    for label, fmt in formats:
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
    for label, _ in formats[1:]:
        for rows in rows_list:
            summary[f"{label}_kernel_over_bf16_{rows}"] = round(ms["bf16", "kernel", rows] / ms[label, "kernel", rows],
                                                                3)
    if not args.blocks_only:
        for rows in rows_list:
            summary[f"int8g32_over_int8_{rows}"] = round(ms["int8", "kernel", rows] / ms["int8g32", "kernel", rows],
                                                         3)
        wins = [r for r in rows_list if ms["int8g32", "kernel", r] < ms["int8g32", "dequant", r]]
        summary["int8g32_kernel_faster_up_to_rows"] = max(wins) if wins else 0
        summary["int8g_max_rows_in_engine"] = INT8G_MAX_ROWS
    if _blocks(summary, table, ms, blocks_rows, reps, g, getattr(torch, args.blocks_dtype), args.vs):
        rows_list = [*rows_list, *(r for r in blocks_rows if r not in rows_list)]
    print("\n| format | rows | kernel tok/s | kernel ms | dequant + GEMM ms | portable build ms | decoded / nodot "
          "build ms | engine uses |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for label in [f for f, _ in formats] + [k for k in kernels.KINDS if (k, "kernel", blocks_rows[0]) in ms]:
        for rows in rows_list:
            if (label, "kernel", rows) not in ms:
                continue
            k, d = ms[label, "kernel", rows], ms.get((label, "dequant", rows))
            used = next(r["way"] for r in table if r["format"] == label and r["rows"] == rows and r["engine"])
            p = ms.get((label, "portable", rows))
            c = ms.get((label, "decoded", rows), ms.get((label, "nodot", rows)))
            print(f"| {label} | {rows} | {rows / k * 1e3:.0f} | {k:.2f} | {'' if d is None else f'{d:.2f}'} | "
                  f"{'' if p is None else f'{p:.2f}'} | {'' if c is None else f'{c:.2f}'} | {used} |")
    print(summary)
    path = write_json(PERF / (f"scratch/{args.out}_quick.json" if args.quick else f"{args.out}.json"),
                      {"summary": summary, **meta, "reps": reps, "shapes": LAYER, "rows": table})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
