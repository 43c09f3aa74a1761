"""A fine-grained MoE layer's experts against dense GEMMs with the same active parameters (issue 41, item 2).

Per expert shape of the families people offload (random bfloat16 weights, routing by top-k of a random softmax), at
8, 32 and 128 tokens, in one run:

    grouped     layers.experts_forward: (token, slot) pairs sorted by expert once, one slice and three GEMMs per
                active expert, one weight multiply, a rank-by-rank sum (the engine's MoE pass)
    loop        `per_expert_loop`: the pass it replaced (a mask and a gather per expert, one index_add each)
    dense       one gated MLP k x I wide over the same tokens: the same FLOPs as the MoE (each token through k
                experts), the weights of k experts: "a dense GEMM with the same active parameters" per token
    read        one gated MLP over the weights of every expert the batch activates (their union), at one token:
                the time to read those bytes through the GEMM, the MoE's memory bound (a batch of N tokens routed
                top-k touches ~min(E, N k) experts, where the dense GEMM touches k)

The summary's `fine_moe_over_dense_gemm_<N>` is grouped / dense for the Qwen3-30B-A3B shape (the issue's ratio),
`fine_moe_over_bound_<N>` grouped / max(dense, read) (the bound: the MoE cannot beat the time to read what it
touches, nor the dense rate for its FLOPs), and `grouped_over_loop_<N>` the loop's time / grouped. Median of REPS
timings each, min and max beside.

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_fine_moe [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from scripts.common import PERF, median_spread, run_meta, timed_samples, utc_now, write_json
from specoffload.runtime.models import layers
from specoffload.runtime.models.weights import ExpertWeights

#: name -> (hidden, expert width, experts, top-k): the routed experts of each model's MoE layer
SHAPES = {
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "olmoe_1b_7b": (2048, 1024, 64, 8),
    "deepseek_v2_lite": (2048, 1408, 64, 6),
    "gpt_oss_20b": (2880, 2880, 32, 4),
}
HEADLINE = "qwen3_30b_a3b"
TOKENS = (8, 32, 128)
REPS = 7


@dataclass(frozen=True)
class _Cfg:
    """The ModelConfig fields the expert pass reads."""

    num_experts: int
    hidden_act: str = "silu"
    swiglu_limit: float | None = None


def per_expert_loop(cfg: _Cfg, normed: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    experts: Mapping[int, ExpertWeights], token_mask: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, only: range | None = None) -> torch.Tensor:
    """The expert pass before the grouped one (kept as the baseline here and as the oracle of
    tests/test_grouped_experts.py): per selected expert in ascending id, its tokens by a mask, its gated MLP, the
    routing weight, one index_add."""
    out = torch.zeros_like(normed) if out is None else out  # [N, H]
    hits = topk_ids[:, :, None] == torch.arange(cfg.num_experts)  # [N, k, E]
    if token_mask is not None:
        hits &= token_mask.reshape(-1, 1, 1)
    for e in layers.selected_experts(topk_ids, token_mask):
        if only is not None and e not in only:
            continue
        tokens, slots = torch.where(hits[:, :, e])  # [n_e], [n_e]
        y = layers.gated_mlp(normed[tokens], experts[e], cfg.hidden_act)  # [n_e, H]
        y = y * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _mlp(width: int, hidden: int, gen: torch.Generator) -> ExpertWeights:
    def w(*shape: int) -> torch.Tensor:
        return (0.02 * torch.randn(*shape, generator=gen)).to(torch.bfloat16)

    return ExpertWeights(w(width, hidden), w(width, hidden), w(hidden, width))


def measure(shape: str, tokens: tuple[int, ...], reps: int) -> list[dict]:
    hidden, width, num_experts, top_k = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    experts = {e: _mlp(width, hidden, gen) for e in range(num_experts)}
    cfg = _Cfg(num_experts)
    rows = []
    for n in tokens:
        normed = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)  # [N, H]
        weights, ids = torch.topk(torch.softmax(torch.randn(n, num_experts, generator=gen), -1), top_k)  # [N, k]
        weights = weights.to(torch.bfloat16)
        active = ids.unique().tolist()
        grouped = timed_samples(lambda: layers.experts_forward(cfg, normed, ids, weights, experts), reps)  # noqa: B023
        loop = timed_samples(lambda: per_expert_loop(cfg, normed, ids, weights, experts), reps)  # noqa: B023
        assert torch.equal(layers.experts_forward(cfg, normed, ids, weights, experts),
                           per_expert_loop(cfg, normed, ids, weights, experts))
        dense_w = _mlp(top_k * width, hidden, gen)
        dense = timed_samples(lambda: layers.gated_mlp(normed, dense_w, "silu"), reps)  # noqa: B023
        union = ExpertWeights(*(torch.cat([getattr(experts[e], f) for e in active], dim=0 if f != "down" else 1)
                                for f in ("gate", "up", "down")))
        one = normed[:1]
        read = timed_samples(lambda: layers.gated_mlp(one, union, "silu"), reps)  # noqa: B023
        m = {name: median_spread(x) for name, x in
             (("grouped", grouped), ("loop", loop), ("dense", dense), ("read", read))}
        bound = max(m["dense"][0], m["read"][0])
        expert_bytes = 3 * hidden * width * 2
        rows.append({
            "shape": shape, "tokens": n, "hidden": hidden, "expert_width": width, "experts": num_experts,
            "top_k": top_k, "active_experts": len(active), "active_bytes": len(active) * expert_bytes,
            "dense_bytes": top_k * expert_bytes, "flops": 2 * 3 * n * top_k * hidden * width,
            **{f"{name}_s": {"median": v[0], "min": v[1], "max": v[2]} for name, v in m.items()},
            "grouped_over_dense": m["grouped"][0] / m["dense"][0],
            "grouped_over_bound": m["grouped"][0] / bound,
            "loop_over_grouped": m["loop"][0] / m["grouped"][0],
            "grouped_read_gb_s": len(active) * expert_bytes / m["grouped"][0] / 1e9,
        })
        r = rows[-1]
        print(f"{shape:18s} {n:4d} {len(active):4d} {m['grouped'][0] * 1e3:8.2f} {m['loop'][0] * 1e3:8.2f} "
              f"{m['dense'][0] * 1e3:8.2f} {m['read'][0] * 1e3:8.2f} {r['grouped_over_dense']:6.2f} "
              f"{r['grouped_over_bound']:6.2f} {r['loop_over_grouped']:6.2f} {r['grouped_read_gb_s']:6.1f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the headline shape, 3 repetitions, into docs/perf/scratch")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default docs/perf/fine_moe.json)")
    args = parser.parse_args()
    meta = run_meta("bfloat16")
    shapes = [HEADLINE] if args.quick else list(SHAPES)
    reps = 3 if args.quick else REPS
    print(f"{'shape':18s} {'N':>4s} {'act':>4s} {'grouped':>8s} {'loop':>8s} {'dense':>8s} {'read':>8s} "
          f"{'/dense':>6s} {'/bound':>6s} {'loop/g':>6s} {'GB/s':>6s}   (ms)")
    rows = [r for shape in shapes for r in measure(shape, TOKENS, reps)]
    head = {r["tokens"]: r for r in rows if r["shape"] == HEADLINE}
    summary = {}
    for n, r in head.items():
        summary[f"fine_moe_over_dense_gemm_{n}"] = round(r["grouped_over_dense"], 3)
        summary[f"fine_moe_over_bound_{n}"] = round(r["grouped_over_bound"], 3)
        summary[f"grouped_over_loop_{n}"] = round(r["loop_over_grouped"], 3)
    out = args.out or (PERF / "scratch" / "fine_moe_quick.json" if args.quick else PERF / "fine_moe.json")
    write_json(out, {"summary": summary, **meta, "end": utc_now(),
                     "reps": reps, "rows": rows})
    print(f"summary: {summary}\nwrote {out}")


if __name__ == "__main__":
    main()
