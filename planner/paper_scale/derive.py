"""Derive `rtx4090_pcie4.json`: a *modelled* (not measured) HardwareProfile of a 24 GB consumer GPU on PCIe 4.0 x16.

Run `python -m specoffload.planner.paper_scale.derive` to rewrite the JSON; README.md explains each number.
`--from-gpu-check docs/perf/gpu.json` also writes `h200_measured.json`: the same profile with the terms that
scripts/gpu_check.py measured on a GPU machine put in place of the modelled ones (`derive_measured`).

    stream    pinned host RAM -> device over PCIe 4.0 x16: 32 GB/s raw, ~25 GB/s effective
    GEMM      bf16, weights read from device memory: FLOP/s(rows) = min(0.6 * 165.2e12, rows * 0.8 * 1008e9)
              (a weight of 2 bytes serves 2 FLOPs per row: memory-bound rate = rows * bandwidth, until the
              tensor-core roof; 165.2 TFLOP/s is the dense fp16/bf16 rate with fp32 accumulation)
    attention per layer = c0 + c1 * new_tokens + c2 * new_tokens * attended_len:
              c0  kernel launches + the q/k/v/o projections' weight read on the GPU (84 MB / 806 GB/s)
              c1  q, k, v to the host and the output back over PCIe (10240 bf16 values per token)
              c2  CPU attention core of a 16-core desktop: max(16384 FLOP / 3e11 FLOP/s, 4096 KV bytes / 60e9 B/s)
                  per (token, key): 2 * 2 * heads * head_dim FLOPs, 2 * kv_heads * head_dim * 2 bytes of K and V
    draft     one token step of Mistral 7B: max(weights / bandwidth, rows * FLOPs / roof) + its KV at 512 keys
              read per row + 0.5 ms of launches
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..profile import HardwareProfile
from .shapes import load_config, shape_from_config

HERE = Path(__file__).resolve().parent
PROFILE_PATH = HERE / "rtx4090_pcie4.json"
MEASURED_PROFILE_PATH = HERE / "h200_measured.json"  # from docs/perf/gpu.json (derive_measured)

PCIE_BYTES_PER_S = 25e9  # pinned RAM -> GPU, PCIe 4.0 x16 effective
GPU_BANDWIDTH = 0.8 * 1008e9  # achievable share of the RTX 4090's 1008 GB/s GDDR6X
GPU_ROOF = 0.6 * 165.2e12  # achievable share of the dense bf16 tensor rate (fp32 accumulate)
CPU_ATTENTION_FLOPS = 3e11  # 16-core desktop CPU, fp32 math over bf16 KV, effective on attention
CPU_BANDWIDTH = 60e9  # dual-channel DDR5, effective
LAUNCH_S = 5e-5  # per attention op: kernel launches and synchronisation
DRAFT_LAUNCH_S = 5e-4  # per draft token step (32 layers of kernels)
DRAFT_CONTEXT = 512  # keys the draft attends to in the modelled step
PASS_OVERHEAD_S = 2e-3  # embed, verify, bookkeeping per target pass
ROWS = tuple(2**i for i in range(14))  # 1 .. 8192


def attention_fit(gpu_bytes_per_s: float, link_bytes_per_s: float) -> tuple[float, float, float]:
    """(c0, c1, c2) of Mixtral's attention per layer (module docstring): the projections' weights read on the GPU
    at `gpu_bytes_per_s`, q / k / v to the host and the output back at `link_bytes_per_s`, the CPU core modelled."""
    cfg = load_config("mixtral_8x7b")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    projection_bytes = 2 * (2 * heads * head_dim * hidden + 2 * kv_heads * head_dim * hidden)
    c0 = LAUNCH_S + projection_bytes / gpu_bytes_per_s
    c1 = 2 * (2 * heads * head_dim + 2 * kv_heads * head_dim) / link_bytes_per_s  # q, k, v down; output up
    c2 = max(4 * heads * head_dim / CPU_ATTENTION_FLOPS, 2 * kv_heads * head_dim * 2 / CPU_BANDWIDTH)
    return c0, c1, c2


def draft_sizes() -> tuple[float, float]:
    """Mistral 7B's (weight bytes without the embedding, KV bytes read per row at DRAFT_CONTEXT keys); in bf16 its
    FLOPs per row-token equal its weight bytes (2 FLOPs per 2-byte parameter)."""
    draft, _ = shape_from_config("mistral_7b", load_config("mistral_7b"))
    return sum(n for key, n in draft.parts if key.kind != "embedding"), draft.kv_bytes_per_token * DRAFT_CONTEXT


def derive() -> HardwareProfile:
    draft_weights, draft_kv = draft_sizes()
    draft_flops = draft_weights  # 2 FLOPs per bf16 parameter (2 bytes)

    def draft_step(rows: int) -> float:
        return max(draft_weights / GPU_BANDWIDTH, rows * draft_flops / GPU_ROOF) + rows * draft_kv / GPU_BANDWIDTH + (
            DRAFT_LAUNCH_S
        )

    return HardwareProfile(
        provenance={
            "kind": "modelled, not measured: see planner/paper_scale/README.md",
            "machine": "RTX 4090 24 GB on PCIe 4.0 x16, 16-core desktop CPU, 256 GB DDR5",
            "device": "cuda",
            "models": ["mistralai/Mixtral-8x7B-v0.1", "mistralai/Mistral-7B-v0.1"],
            "dtype": "bfloat16",
        },
        device="cuda",
        shared_compute=False,
        weights_tier="ram",
        stream_bytes_per_s=PCIE_BYTES_PER_S,
        ffn_flops_per_s=tuple((r, min(GPU_ROOF, r * GPU_BANDWIDTH)) for r in ROWS),
        attention_fit=attention_fit(GPU_BANDWIDTH, PCIE_BYTES_PER_S),
        draft_step_s=tuple((r, draft_step(r)) for r in ROWS),
        head_flops_per_s=None,
        pass_overhead_s=PASS_OVERHEAD_S,
    )


def derive_measured(gpu_check: Mapping[str, Any]) -> HardwareProfile:
    """The modelled profile with what scripts/gpu_check.py measured (its JSON) in place of the modelled terms:

        stream    the pinned host -> device copy rate (`realistic.link.h2d_pinned_GBps`)
        GEMM      TFLOP/s versus rows of one Mixtral-shaped expert's gated MLP (hidden 4096, intermediate 14336:
                  Mistral 7B's MLP has the same shape), in the measured dtype (`realistic.gemm`)
        draft     Mistral 7B's step at each measured row count: 2 FLOPs per parameter per row at the GEMM rate
                  measured there, + its KV read at the rate one row reaches (a 1-row bf16 GEMM is bound by reading its
                  weights: FLOP/s = bytes/s) + DRAFT_LAUNCH_S
        attention the projections' weight read at that same one-row rate, q/k/v over the measured link; the CPU
                  attention core stays modelled (c2: a 16-core CPU as in `derive`; gpu_check's CPU time per pass
                  mixes prefill and decode at 64-96 keys, too few to fit c2)
    Still modelled: c2, the launch overheads, the pass overhead."""
    run = gpu_check["realistic"]
    link = float(run["link"]["h2d_pinned_GBps"]) * 1e9
    gemm = sorted((int(rows), float(tflops) * 1e12) for rows, tflops in run["gemm"].items())
    one_row_bytes_per_s = gemm[0][1] / gemm[0][0]  # bf16: 2 FLOPs per 2-byte weight per row

    draft_flops, draft_kv = draft_sizes()  # (bf16: FLOPs per row-token = weight bytes)

    def draft_step(rows: int, flops_per_s: float) -> float:
        return rows * draft_flops / flops_per_s + rows * draft_kv / one_row_bytes_per_s + DRAFT_LAUNCH_S

    machine = gpu_check.get("machine", {})
    return replace(
        derive(),
        provenance={
            "kind": "measured link and GEMM (scripts/gpu_check.py), the rest modelled: see README.md",
            "machine": f"{machine.get('gpu', '?')} ({machine.get('gpu_memory_GiB', 0):.0f} GiB), "
                       f"{machine.get('cpus', '?')} CPUs; torch {machine.get('torch', '?')}",
            "device": "cuda",
            "models": ["mistralai/Mixtral-8x7B-v0.1", "mistralai/Mistral-7B-v0.1"],
            "dtype": str(run.get("dtype", "bfloat16")).removeprefix("torch."),
            "measured": {"h2d_pinned_GBps": link / 1e9, "gemm_tflops": dict((str(r), f / 1e12) for r, f in gemm)},
        },
        stream_bytes_per_s=link,
        ffn_flops_per_s=tuple(gemm),
        attention_fit=attention_fit(one_row_bytes_per_s, link),
        draft_step_s=tuple((r, draft_step(r, f)) for r, f in gemm),  # at the measured rows (linear between)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-gpu-check", type=Path, metavar="JSON",
                        help="also write h200_measured.json from a scripts/gpu_check.py result")
    args = parser.parse_args(argv)
    derive().save(PROFILE_PATH)
    print(f"wrote {PROFILE_PATH}")
    if args.from_gpu_check is not None:
        derive_measured(json.loads(args.from_gpu_check.read_text())).save(MEASURED_PROFILE_PATH)
        print(f"wrote {MEASURED_PROFILE_PATH}")


if __name__ == "__main__":
    main()
