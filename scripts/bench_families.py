"""The newest families at real layer shapes, streamed from disk (issue 41, items 3 and the measure list).

Random-weight checkpoints at the layer shapes of released models, a few layers each, written once (by `write_shape`,
into ~/.cache/specoffload/shapes/, bfloat16, HF's per-expert tensor names, shards of <= 2 GB):

    qwen3_30b_a3b      Qwen3-MoE: hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768, top 8, vocab 151936
    olmoe_1b_7b        OLMoE: hidden 2048, 16 heads of 128, 64 experts of 1024, top 8, vocab 50304
    deepseek_v2_lite   DeepSeek-V2-Lite: hidden 2048, 16 heads of latent attention (latent 512 + rotary 64; 128 + 64
                       query-key and 128 value dims a head), layer 0 dense (10944), 64 experts of 1408, top 6, two
                       shared, YaRN, vocab 102400
    gpt_oss_20b        gpt-oss-20b: hidden 2880, 64 heads / 8 KV heads of 64, sinks, window 128 on alternate layers,
                       32 experts of 2880 (stored fused, transposed), top 4, vocab 201088
    coarse_8x       the qwen3_30b_a3b layer's expert bytes as 8 experts of 12288 (a Mixtral-like layer), top 2

Measured, in one run:

  read      one MoE layer's experts through the engine's streamer (O_DIRECT, coalesced, the page cache not used;
            a first load of each touches the slot's pages, untimed): every expert of a 128-expert layer against
            every expert of the 8-expert layer of the same bytes (`many_expert_read_rate_ratio`: the 128-expert
            layer's GB/s over the 8-expert one's), and the subset a batch of 8 tokens routes to (top 8 of 128:
            ~50 experts, read in file order) -- 7 times, alternating
  engine    tokens/s of the offloaded engine (no draft, greedy, EOS ignored, random prompts) on each family shape at
            two budgets: the smallest that places it and half way to all resident; the trace's
            I/O (load ops and the routed experts the ffn op reads) and compute (attention, ffn, head, less those
            reads) seconds per pass beside it

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_families [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from scripts.common import PERF, io_compute_seconds, median_spread, run_meta, utc_now, write_json

CACHE = Path.home() / ".cache" / "specoffload" / "shapes"
SHARD_BYTES = 2 << 30
REPS = 3


FAMILIES = ("qwen3_30b_a3b", "olmoe_1b_7b", "deepseek_v2_lite", "gpt_oss_20b")


def _configs(layers: int) -> dict:
    from transformers import DeepseekV2Config, GptOssConfig, OlmoeConfig, Qwen3MoeConfig

    return {
        "deepseek_v2_lite": DeepseekV2Config(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
            num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
            routed_scaling_factor=1.0, max_position_embeddings=163840, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 4096},
            bos_token_id=100000, eos_token_id=100001),
        "gpt_oss_20b": GptOssConfig(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
            sliding_window=128, max_position_embeddings=131072, tie_word_embeddings=False, swiglu_limit=7.0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
            bos_token_id=199998, eos_token_id=200002, pad_token_id=199999),
        "qwen3_30b_a3b": Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
            tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
        "olmoe_1b_7b": OlmoeConfig(
            vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=layers,
            num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
            max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None, eos_token_id=50279,
            pad_token_id=1),
        "coarse_8x": Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=12288,
            num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False,
            bos_token_id=151643, eos_token_id=151645),
    }


def _tensors(config) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
    """(name, shape) of every tensor of the HF checkpoint, experts in HF's per-expert form, in layer order."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = []
    fused = config.model_type == "gpt_oss"  # stored fused and transposed, as its release is
    for name, t in model.state_dict().items():
        if fused:
            out.append((name, tuple(t.shape)))
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> per expert gate_proj, up_proj [I, H]
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(f"{base}{e}.gate_proj.weight", (inter, t.shape[2])),
                        (f"{base}{e}.up_proj.weight", (inter, t.shape[2]))]
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            base = name[: -len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", tuple(t.shape[1:])) for e in range(t.shape[0])]
        else:
            out.append((name, tuple(t.shape)))
    return out


def write_shape(name: str, layers: int, root: Path = CACHE) -> Path:
    """Write the random-weight checkpoint `name` (of `_configs`) with `layers` layers once; returns its directory."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    path = root / f"{name}-{layers}l"
    if (path / "model.safetensors.index.json").is_file():
        return path
    config = _configs(layers)[name]
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, shard_bytes, files = {}, {}, 0, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            files.append(file)
            weight_map.update(dict.fromkeys(shard, file))
            shard, shard_bytes = {}, 0

    for tensor, shape in _tensors(config):
        if tensor.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        if shard_bytes + t.nbytes > SHARD_BYTES:
            flush()
        shard[tensor], shard_bytes = t, shard_bytes + t.nbytes
    flush()
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(path)
    GenerationConfig(eos_token_id=config.eos_token_id).save_pretrained(path)
    total = sum((path / f).stat().st_size for f in files)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=1))
    return path


def _streamer(path: Path):  # noqa: ANN202
    from specoffload.planner.shapes import PartKey
    from specoffload.runtime.models.checkpoint import Checkpoint
    from specoffload.runtime.models.config import ModelConfig
    from specoffload.runtime.models.weights import WeightLoader
    from specoffload.runtime.offload.streamer import WeightStreamer

    config = ModelConfig.from_dir(path)
    loader = WeightLoader(Checkpoint(path), config, torch.bfloat16, "cpu")
    keys = [PartKey("expert", 0, e) for e in range(config.num_experts)]
    slot = sum(loader.nbytes(k) for k in keys) + 64 * len(keys) + (1 << 20)
    return WeightStreamer(loader, slot, 1, "disk", "cpu"), keys, config


def read_rates(many: Path, few: Path, reps: int) -> dict:
    """GB/s of one MoE layer's experts read by the streamer: all of the 128-expert layer, all of the 8-expert layer
    (same bytes), and the experts 8 tokens route to in the 128-expert layer; alternating, `reps` times."""
    many_s, many_keys, many_cfg = _streamer(many)
    few_s, few_keys, _ = _streamer(few)
    rng = random.Random(0)
    num_experts, top_k = many_cfg.num_experts, many_cfg.num_experts_per_tok
    subset = sorted({e for _ in range(8) for e in rng.sample(range(num_experts), top_k)})
    rates: dict[str, list[float]] = {"many_all": [], "few_all": [], "many_subset_8_tokens": []}
    many_s.load(0, many_keys)  # first touch of the slots' pages, outside the timings
    few_s.load(0, few_keys)
    for _ in range(reps):
        for name, streamer, keys in (("many_all", many_s, many_keys), ("few_all", few_s, few_keys),
                                     ("many_subset_8_tokens", many_s, [many_keys[e] for e in subset])):
            before = streamer.bytes_read
            start = time.perf_counter()
            streamer.load(0, keys)
            rates[name].append((streamer.bytes_read - before) / (time.perf_counter() - start) / 1e9)
    out = {name: dict(zip(("median", "min", "max"), median_spread(v), strict=True)) for name, v in rates.items()}
    out["subset_experts"] = len(subset)
    out["reads"] = {"many": many_s.reader.reads, "few": few_s.reader.reads}
    many_s.close()
    few_s.close()
    return out


def _timed_run(config, prompts: list[list[int]], params) -> dict:  # noqa: ANN001
    """One generate call on a fresh engine: tokens/s, and per pass the trace's I/O (load ops plus the routed
    experts the ffn op reads itself, timed here around the verifier's expert loader) and compute (attention, ffn,
    head, less those expert reads)."""
    from specoffload.runtime.engine import Engine

    engine = Engine(config)
    expert_s = [0.0]
    loader = engine.workers.verifier.reader.expert_loader
    if loader is not None:
        load = loader.load

        def timed(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return load(*args, **kw)
            finally:
                expert_s[0] += time.perf_counter() - start

        loader.load = timed
    try:
        start = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - start
        stats = engine.last_stats
        io, compute = io_compute_seconds(engine)
        passes = max(stats.passes, 1)
        return {"tok_s": stats.generated_tokens / wall, "passes": stats.passes,
                "io_s_per_pass": (io + expert_s[0]) / passes, "compute_s_per_pass": (compute - expert_s[0]) / passes,
                "bytes_read_per_pass": stats.bytes_read / passes,
                "streamed_layers": len(engine.placement.streamed_layers)}
    finally:
        engine.close()


def engine_rates(path: Path, rows: int, prompt_tokens: int, new_tokens: int, reps: int) -> list[dict]:
    """tokens/s of the offloaded engine (disk tier, no draft) at its smallest budget and half way from it to the
    budget that keeps everything resident."""
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.models.config import ModelConfig
    from specoffload.runtime.sampling import SamplingParams

    gen = torch.Generator().manual_seed(1)
    probe_config = EngineConfig(target=path, device_memory="64GiB", max_batch_size=rows, dtype="bfloat16",
                                max_seq_len=prompt_tokens + new_tokens, trace=True)
    probe = Engine(probe_config)
    low, high = probe.minimum_device_memory(), probe.placement.device_bytes()
    probe.close()
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = torch.randint(100, min(vocab, 50000), (rows, prompt_tokens), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    out = []
    for budget in (low, (low + high) // 2):
        config = EngineConfig(target=path, device_memory=budget, max_batch_size=rows, dtype="bfloat16",
                              max_seq_len=prompt_tokens + new_tokens, trace=True)
        runs = [_timed_run(config, prompts, params) for _ in range(reps)]
        tok = median_spread(r["tok_s"] for r in runs)
        last = runs[-1]
        out.append({"budget_bytes": budget, "tok_s": dict(zip(("median", "min", "max"), tok, strict=True)),
                    **{k: last[k] for k in ("io_s_per_pass", "compute_s_per_pass", "bytes_read_per_pass",
                                            "streamed_layers", "passes")}})
        r = out[-1]
        print(f"  budget {budget / 2**30:6.2f} GiB: {tok[0]:6.2f} tok/s ({tok[1]:.2f}-{tok[2]:.2f}), "
              f"io {r['io_s_per_pass']:.2f} s/pass, compute {r['compute_s_per_pass']:.2f} s/pass, "
              f"{r['bytes_read_per_pass'] / 1e9:.2f} GB read/pass", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer, 1 repetition, into docs/perf/scratch")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    meta = run_meta("bfloat16")
    layers, reps = (1, 1) if args.quick else (args.layers, REPS)
    paths = {name: write_shape(name, layers) for name in FAMILIES}
    paths["coarse_8x"] = write_shape("coarse_8x", 1)  # the read test reads layer 0 only
    reads = read_rates(paths["qwen3_30b_a3b"], paths["coarse_8x"], 3 if args.quick else 7)
    print(f"read GB/s: 128 experts {reads['many_all']['median']:.2f}, 8 experts {reads['few_all']['median']:.2f}, "
          f"the {reads['subset_experts']} experts of 8 tokens {reads['many_subset_8_tokens']['median']:.2f}")
    engines = {}
    for name in FAMILIES:
        print(name, flush=True)
        engines[name] = engine_rates(paths[name], args.rows, 16, args.new_tokens, reps)
    summary = {"many_expert_read_rate_ratio": round(reads["many_all"]["median"] / reads["few_all"]["median"], 3),
               "subset_over_whole_read_rate": round(reads["many_subset_8_tokens"]["median"]
                                                    / reads["many_all"]["median"], 3)}
    for name, runs in engines.items():
        for label, r in zip(("tight", "half"), runs, strict=True):
            summary[f"{name}_tok_s_{label}"] = round(r["tok_s"]["median"], 3)
            summary[f"{name}_io_over_compute_{label}"] = round(r["io_s_per_pass"] / r["compute_s_per_pass"], 3)
    out = PERF / "scratch" / "families_quick.json" if args.quick else PERF / "families.json"
    write_json(out, {"summary": summary, **meta, "end": utc_now(),
                     "layers": layers, "reps": reps, "rows": args.rows, "new_tokens": args.new_tokens,
                     "checkpoints": {n: str(p) for n, p in paths.items()}, "read": reads, "engine": engines})
    print(f"summary: {summary}\nwrote {out}")


if __name__ == "__main__":
    main()
