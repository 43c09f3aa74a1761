#!/usr/bin/env python
"""Benchmark: a layer's KV write + read on the paged cache (runtime/kv_blocks.py) vs the contiguous one.

`KVCache.keys_values` returns a view of its storage; `PagedKVCache.keys_values` gathers each row's blocks from the
pool (one index_select for K, one for V). This times, per call on one layer, `write` of T new positions plus
`keys_values` over every row's positions, and the same followed by the attention itself (scaled dot-product with
the causal mask, as runtime/models/layers.py `attention_forward` does), for

    decode   T = 1 at `--tokens` positions per row
    verify   T = k + 1 = 5 at `--tokens` positions per row
    prefill  T = `--tokens` into empty rows

Both caches run alternately, `--reps` rounds of `--calls` calls each (median and min per call and layer,
microseconds; prefill with attention runs a tenth of the calls). A call goes through `--layers` layers: with one,
the contiguous cache of one layer (K and V of 16 rows x 600 tokens: 20 MB) stays in a large L3 cache between calls
while the gather reads and writes it again; with several, neither fits, as in a real model. The caches agree on
every valid position (checked once per case). One torch thread unless --threads.

    python -m scripts.bench_kv_blocks                 # 1 layer, 16 rows, 2 kv heads, 14 heads, 128 dims, 600 tokens
    python -m scripts.bench_kv_blocks --layers 8      # the same shape, 8 layers per call
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specoffload.runtime.kv_blocks import BlockPool, PagedKVCache
from specoffload.runtime.kv_cache import KVCache
from specoffload.runtime.models.layers import attention_mask


def per_call_us(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, kv, dim, n = args.rows, args.kv_heads, args.head_dim, args.tokens
    gen = torch.Generator().manual_seed(0)
    context = torch.randn(rows, kv, n, dim, generator=gen)  # [rows, kv_heads, n, dim]
    print(f"{args.layers} layer(s), {rows} rows, {kv} kv heads ({args.heads} heads), head dim {dim}, {n} tokens, fp32, "
          f"block size {args.block_size}, {args.threads} thread(s); microseconds per call and layer, median (min)")
    for case, steps, filled in (("decode", 1, n), ("verify", 5, n), ("prefill", n, 0)):
        run_case(args, case, steps, filled, context, gen)


def run_case(args: argparse.Namespace, case: str, steps: int, filled: int, context: torch.Tensor,
             gen: torch.Generator) -> None:
    """Time both caches on one case (module docstring) and print a line per measure."""
    rows, kv, dim, layers = args.rows, args.kv_heads, args.head_dim, args.layers
    capacity = filled + steps + args.block_size
    contiguous = KVCache(layers, rows, kv, dim, capacity)
    pool = BlockPool(layers, rows * (-(-capacity // args.block_size)), args.block_size, kv, dim)
    paged = PagedKVCache(pool, rows, capacity)
    for cache in (contiguous, paged):
        if filled:
            for layer in range(layers):
                cache.write(layer, context, context)
            cache.advance(filled)
    k_new = torch.randn(rows, kv, steps, dim, generator=gen)  # [rows, kv_heads, T, dim]
    q = torch.randn(rows, args.heads, steps, dim, generator=gen)  # [rows, heads, T, dim]
    positions = contiguous.lengths[:, None] + torch.arange(steps)  # [rows, T]
    mask = attention_mask(positions, filled + steps, None)  # [rows, 1, T, S]

    def kv_only(cache: KVCache | PagedKVCache) -> Callable[[], None]:
        def call() -> None:
            for layer in range(layers):
                cache.write(layer, k_new, k_new)
                cache.keys_values(layer, filled + steps)
        return call

    def with_attention(cache: KVCache | PagedKVCache) -> Callable[[], None]:
        def call() -> None:
            for layer in range(layers):
                cache.write(layer, k_new, k_new)
                keys, values = cache.keys_values(layer, filled + steps)  # [rows, kv_heads, S, dim]
                F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return call

    kv_only(contiguous)()
    kv_only(paged)()
    assert torch.equal(contiguous.keys_values(0, filled + steps)[0], paged.keys_values(0, filled + steps)[0]), case
    for label, make in (("write + keys_values", kv_only), ("+ attention", with_attention)):
        times: dict[str, list[float]] = {"contiguous": [], "paged": []}
        calls = max(1, args.calls // 10) if steps > 5 and make is with_attention else args.calls
        for _ in range(args.reps):
            times["contiguous"].append(per_call_us(make(contiguous), calls) / layers)
            times["paged"].append(per_call_us(make(paged), calls) / layers)
        c, p = statistics.median(times["contiguous"]), statistics.median(times["paged"])
        print(f"{case:8s} T={steps:<4d} {label:20s} contiguous {c:9.0f} ({min(times['contiguous']):.0f})   "
              f"paged {p:9.0f} ({min(times['paged']):.0f})   paged - contiguous {p - c:+8.0f}   x{p / c:.2f}")

if __name__ == "__main__":
    main()
