"""torch's CPU int4 kernel against what the engine does with an int4 weight today (issue 34, item 1: the groundwork).

Per FFN weight shape of the real 1.5B ([8960, 1536] gate / up, [1536, 8960] down), bfloat16, in one run:

    compute   rows x in @ W^T, at 1 .. 64 rows: the bfloat16 GEMM the layers run on a dequantized streamed weight
              (F.linear), torch's weight-only int8 kernel (`_weight_int8pack_mm`, the packed int8 slots of today),
              and torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, group 64) on the same shape
    load      what the loader spends on one weight before the layer can use it: today's dequantization of the
              stored int4 codes (runtime/formats/int4.py) into the bfloat16 slot, against turning the same stored
              codes into the kernel's layout: through aten's converter (`_convert_weight_to_int4pack_for_cpu`,
              from int32 codes) or by the engine's byte permutation (runtime/models/packed.py `kernel_layout`, at
              this machine's block: checked equal to aten's)

On a CPU-only machine the loader and the layers share the cores, so a pass pays load + compute: the summary's
`int4_kernel_over_dequant_<rows>` is (dequantize + bf16 GEMM) / (permute + int4 kernel) per weight (> 1: the kernel
path does less work), and `int4_kernel_over_bf16_compute_<rows>` the compute alone (the bound when the codes arrive
in the kernel's layout, nothing to convert). Median of REPS timings each, min and max beside.

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_int4_kernel [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from scripts.common import PERF, median_spread, run_meta, timed_samples, write_json
from specoffload.runtime.formats import dequantize_into, weight_format
from specoffload.runtime.models.packed import kernel_layout

SHAPES = ((8960, 1536), (1536, 8960))
ROWS = (1, 4, 8, 16, 32, 64)
GROUP = 64
REPS = 7
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shape, three row counts: a smoke run (scratch/)")
    args = parser.parse_args()
    meta = run_meta("bfloat16")
    reps = 3 if args.quick else REPS
    torch.manual_seed(0)
    fmt = weight_format("int4", GROUP)
    rows_out, summary = [], {}
    for n, k in SHAPES[:1] if args.quick else SHAPES:
        w = torch.randn(n, k) * 0.02  # [N, K]
        parts = fmt.quantize_rows(w)
        codes = torch.empty(n, k, dtype=torch.int32)
        pairs = codes.view(n, k // 2, 2)
        pairs[..., 0], pairs[..., 1] = parts["qweight"] & 0xF, parts["qweight"] >> 4
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        assert torch.equal(kernel_layout(parts["qweight"]), packed), "the probed layout no longer matches aten's"
        # w' = q * scale + min (ours) = (q - 8) * scale + (min + 8 * scale) (the kernel's)
        scale, zero = parts["scale"].float(), parts["zero"].float()  # [N, K / g]
        scales_zeros = torch.stack((scale, zero + 8 * scale), dim=-1).transpose(0, 1).contiguous().bfloat16()
        dense = torch.empty(n, k, dtype=torch.bfloat16)
        dequantize_into(dense, parts, fmt)
        int8_codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        int8_scale = torch.rand(n, dtype=torch.bfloat16) * 1e-3
        load = {"dequantize": timed_samples(partial(dequantize_into, dense, parts, fmt), reps),
                "aten_convert": timed_samples(
                    partial(torch.ops.aten._convert_weight_to_int4pack_for_cpu, codes, 2), reps),
                "permute": timed_samples(partial(kernel_layout, parts["qweight"]), reps)}
        for name, samples in load.items():
            med, lo, hi = median_spread(samples)
            rows_out.append({"shape": [n, k], "kind": "load", "what": name, "ms": med * 1e3, "min_ms": lo * 1e3,
                             "max_ms": hi * 1e3})
        for m in ROWS[1:4] if args.quick else ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            ref = x.float() @ dense.float().T
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
            error = float((out.float() - ref).abs().max() / ref.abs().max())
            compute = {"bf16_linear": timed_samples(partial(F.linear, x, dense), reps),
                       "int8_kernel": timed_samples(
                           partial(torch._weight_int8pack_mm, x, int8_codes, int8_scale), reps),
                       "int4_kernel": timed_samples(
                           partial(torch.ops.aten._weight_int4pack_mm_for_cpu, x, packed, GROUP, scales_zeros), reps)}
            med = {name: statistics.median(s) for name, s in compute.items()}
            for name, samples in compute.items():
                m_, lo, hi = median_spread(samples)
                rows_out.append({"shape": [n, k], "kind": "compute", "rows": m, "what": name, "ms": m_ * 1e3,
                                 "min_ms": lo * 1e3, "max_ms": hi * 1e3,
                                 **({"max_rel_error_vs_dequantized": error} if name == "int4_kernel" else {})})
            dequant = statistics.median(load["dequantize"]) + med["bf16_linear"]
            kernel = statistics.median(load["permute"]) + med["int4_kernel"]
            tag = f"{n}x{k}_{m}"
            summary[f"int4_kernel_over_dequant_{tag}"] = dequant / kernel
            summary[f"int4_kernel_over_bf16_compute_{tag}"] = med["bf16_linear"] / med["int4_kernel"]
    record = {"benchmark": "int4_kernel", **meta, "group": GROUP, "reps": reps, "summary": summary, "rows": rows_out}
    path = PERF / ("scratch/int4_kernel_quick.json" if args.quick else "int4_kernel.json")
    write_json(path, record)
    print("| shape | rows | bf16 GEMM ms | int8 kernel ms | int4 kernel ms |\n|---|---:|---:|---:|---:|")
    by = {(tuple(r["shape"]), r.get("rows"), r["what"]): r for r in rows_out}
    for (shape, m, what), r in by.items():
        if what == "bf16_linear":
            print(f"| {shape} | {m} | {r['ms']:.2f} | {by[(shape, m, 'int8_kernel')]['ms']:.2f} | "
                  f"{by[(shape, m, 'int4_kernel')]['ms']:.2f} |")
    for r in rows_out:
        if r["kind"] == "load":
            print(f"load {r['shape']} {r['what']}: {r['ms']:.1f} ms ({r['min_ms']:.1f}-{r['max_ms']:.1f})")
    print(json.dumps({k: round(v, 3) for k, v in summary.items()}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
