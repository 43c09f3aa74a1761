"""A GGUF's F16 matrices kept as stored (runtime/formats/ggml.py `F16`, ggml.c `tile_f16`) against what the engine did
before: convert them into the slot in the compute dtype at load, then its GEMM (`linear`).

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_f16 [--quick]

Shapes: one MoE layer's F16 expert projections of the moefied 1.5B's GGUF (`ffn_down_exps`: 16 experts of
[1536, 336], which no 32-input block type fits, so llama.cpp's quantizer keeps them F16) and one dense FFN projection
of an F16 GGUF ([8960, 1536]). Per row count and compute dtype (float32, bfloat16), same run, REPS timings
alternating, median (min, max):

    kernel     ggml.c over the float16 rows where they lie (what the slot now holds: 2 bytes a weight, nothing done
               at load), `PackedBlocks.matmul`
    converted  the engine's `linear` on the weight converted to the compute dtype (what the slot held before: 4 bytes a
               weight in float32), the conversion not counted
    convert    the load-side conversion that the stored slot no longer pays, per pass (once per weight)

Summary: `f16_kernel_over_converted_<dtype>_<rows>` (the multiply alone, both from a ready slot), and
`f16_kernel_over_converted_with_load_<dtype>_<rows>` (each row-count's pass with the conversion counted, the way a
streamed layer pays it). The bound beside: the multiply's share of a decode pass is what this can move; on the
moefied budget run the F16 experts are a third of the streamed bytes. A quick run writes docs/perf/scratch/.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from scripts.common import PERF, median_spread, run_meta, timed_samples, write_json
from specoffload.runtime.formats.ggml import FORMATS_BY_NAME, block_kernel
from specoffload.runtime.kernels import random_blocks
from specoffload.runtime.models.linear import linear
from specoffload.runtime.models.packed import PackedBlocks

SHAPES = {"moe_down_exps": (16, 1536, 336), "dense_ffn": (1, 8960, 1536)}  # (matrices, out, in)
ROWS = (1, 4, 8, 16, 32)
REPS = 7


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rows 1 and 8, 3 reps: a smoke run (scratch/)")
    ap.add_argument("--out", default="kernels_f16", help="docs/perf/<out>.json")
    args = ap.parse_args()
    rows_list, reps = ((1, 8), 3) if args.quick else (ROWS, REPS)
    kernel = block_kernel()
    if kernel is None:
        print("no ggml kernel on this machine: nothing to compare", file=sys.stderr)
        return 1
    fmt = FORMATS_BY_NAME["f16"]
    g = torch.Generator().manual_seed(0)
    meta = run_meta("float32+bfloat16")
    table, summary = [], {"ggml_isa": kernel.isa}
    for shape_name, (count, out, inputs) in SHAPES.items():
        stored = [random_blocks("f16", out, inputs, g) for _ in range(count)]  # [out, in * 2] uint8 each
        for dtype in (torch.float32, torch.bfloat16):
            packed = [PackedBlocks(s, fmt, inputs, dtype) for s in stored]
            converted = [s.view(torch.float16).to(dtype) for s in stored]  # [out, in] each
            dest = [torch.empty(out, inputs, dtype=dtype) for _ in range(count)]

            def convert(dest: list = dest, stored: list = stored) -> None:  # noqa: B006
                for d, s in zip(dest, stored):
                    fmt.dequantize_direct(d, {"qweight": s})

            convert_s = median_spread(timed_samples(convert, reps))
            label = str(dtype).removeprefix("torch.")
            for rows in rows_list:
                x = torch.randn(rows, inputs).to(dtype)  # [rows, in]
                ways = {"kernel": lambda x=x, packed=packed: [p.matmul(x) for p in packed],
                        "converted": lambda x=x, converted=converted: [linear(x, w) for w in converted]}
                samples: dict[str, list[float]] = {w: [] for w in ways}
                for fn in ways.values():
                    fn()
                for _ in range(reps):  # alternating
                    for way, fn in ways.items():
                        start = time.perf_counter()
                        fn()
                        samples[way].append(time.perf_counter() - start)
                k, c = median_spread(samples["kernel"]), median_spread(samples["converted"])
                row = {"shape": shape_name, "matrices": count, "out": out, "in": inputs, "dtype": label,
                       "rows": rows, "kernel_ms": [v * 1e3 for v in k], "converted_ms": [v * 1e3 for v in c],
                       "convert_ms": [v * 1e3 for v in convert_s]}
                table.append(row)
                summary[f"f16_kernel_over_converted_{shape_name}_{label}_{rows}"] = round(c[0] / k[0], 3)
                summary[f"f16_kernel_over_converted_with_load_{shape_name}_{label}_{rows}"] = round(
                    (c[0] + convert_s[0]) / k[0], 3)
                print(f"{shape_name:14s} {label:9s} rows {rows:3d}  kernel {k[0] * 1e3:7.2f} ms "
                      f"({k[1] * 1e3:.2f}-{k[2] * 1e3:.2f})  converted {c[0] * 1e3:7.2f} ms "
                      f"({c[1] * 1e3:.2f}-{c[2] * 1e3:.2f})  + convert {convert_s[0] * 1e3:6.2f} ms")
    path = PERF / "scratch" / f"{args.out}_quick.json" if args.quick else PERF / f"{args.out}.json"
    out = write_json(path, {"summary": summary, **meta, "rows": table, "reps": reps})
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
