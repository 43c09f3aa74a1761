"""Derive `rtx4090_pcie4.json`: a *modelled* (not measured) HardwareProfile of a 24 GB consumer GPU on PCIe 4.0 x16.

Run `python -m specoffload.planner.paper_scale.derive` to rewrite the JSON; README.md explains each number.

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

from pathlib import Path

from ..profile import HardwareProfile
from .shapes import load_config, shape_from_config

HERE = Path(__file__).resolve().parent
PROFILE_PATH = HERE / "rtx4090_pcie4.json"

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


def derive() -> HardwareProfile:
    target_cfg, draft_cfg = load_config("mixtral_8x7b"), load_config("mistral_7b")
    draft, _ = shape_from_config("mistral_7b", draft_cfg)
    hidden, heads = target_cfg["hidden_size"], target_cfg["num_attention_heads"]
    kv_heads, head_dim = target_cfg["num_key_value_heads"], target_cfg["head_dim"]
    projection_bytes = 2 * (2 * heads * head_dim * hidden + 2 * kv_heads * head_dim * hidden)
    c0 = LAUNCH_S + projection_bytes / GPU_BANDWIDTH
    c1 = 2 * (2 * heads * head_dim + 2 * kv_heads * head_dim) / PCIE_BYTES_PER_S  # q, k, v down; output up
    c2 = max(4 * heads * head_dim / CPU_ATTENTION_FLOPS, 2 * kv_heads * head_dim * 2 / CPU_BANDWIDTH)
    draft_weights = sum(n for key, n in draft.parts if key.kind != "embedding")
    draft_flops = 2 * draft_weights / 2  # 2 FLOPs per bf16 parameter (2 bytes)
    draft_kv = draft.kv_bytes_per_token * DRAFT_CONTEXT

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
        attention_fit=(c0, c1, c2),
        draft_step_s=tuple((r, draft_step(r)) for r in ROWS),
        head_flops_per_s=None,
        pass_overhead_s=PASS_OVERHEAD_S,
    )


def main() -> None:
    derive().save(PROFILE_PATH)
    print(f"wrote {PROFILE_PATH}")


if __name__ == "__main__":
    main()
