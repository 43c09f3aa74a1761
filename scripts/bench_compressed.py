"""Compressed weight streaming (issue 23): fp16, int8 and int4 of one model streamed under the same budget, in one run.

    python -m scripts.bench_compressed [--target dense|moefied|DIR] [--budget 4.5GiB] [--dtype bfloat16]
                                       [--regime tight|moe|dense] [--packed-weights auto|on|off] [--quick]

Each variant runs without a draft at its own batch (`--batch auto`: the planner's pick for that checkpoint under the
budget; an integer: the same for all), HumanEval prompts, greedy, `--reps` repetitions (median and spread of decode
tokens/s). The compressed variants are built with `specoffload quantize` beside the source (or in `--variants-dir`)
unless they exist. Reported per variant: tokens/s, bytes read per target pass, and from the trace the loader's busy
time (its decompression share) against the compute (attention + ffn + head) per pass. int8 and int4 weights stay
packed in the slots where `EngineConfig.packed_weights` "auto" says (bfloat16 on a CPU with native bfloat16 GEMMs;
`--packed-weights off` measures the dequantizing loader instead); the variants "int4u" / "int8u" run the same
checkpoints with packed slots off, in the same run (`int4_packed_over_dequantized`). The fp16 run's io / compute is
the bound no format can beat (`io_over_compute_fp16`). The summary's ratios are named by `--regime` (the issue's
`int8_over_fp16_tight` at the smallest budget where fp16 runs a batch of 8; `_moe` / `_dense` roomy; default: by
target). `--dtype` is the compute dtype (bfloat16 where the CPU has native 16-bit GEMMs, runtime/models/linear.py).
The variant "int4k" is int4 g64 with its codes stored in the CPU kernel's layout (read into the slots as stored,
`int4k_over_int4_*`); "int4kh" compresses the LM head too (`quantize --head`, `int4kh_over_int4k_*`). "int8_g32" is
int8 per group of 32 (format int8g), "int4_g32" int4 per group of 32 (int4k's layout); "int8ah" / "int4kah" compress
the attention projections and the LM head beside the FFN (all but the embedding, norms and routers). "bf16" is the
source rounded to bfloat16 (`bf16_copy`, built once beside it): with `--dtype bfloat16` the baseline that streams
16-bit weights without a cast per load (`<variant>_over_bf16_*` beside `_over_fp16_*`; per repetition in
`<variant>_over_bf16_*_per_rep`, and the most the variant could gain, `<variant>_bound_over_bf16_*`: bf16's seconds
per pass over the variant's max(load, compute) per pass, `overlap_bound`). The variant
"gguf" runs the Q4_K_M GGUF the dense target was converted from, as stored (runtime/models/gguf.py; `--gguf FILE`,
default: fetched by scripts/get_models.py), named `gguf_q4km_*` in the summary; its q4_k / q6_k weights stay as
their blocks, multiplied by the engine's ggml kernel (runtime/kernels) where it builds. "gguf_repack" runs the same
file with that kernel off (`SPECOFFLOAD_GGML_KERNEL=off`: q4_k repacked for torch's int4 kernel and q6_k dequantized
on every load, as before the kernel), in the same run: `gguf_q4km_kernel_over_repack_*`; "gguf_portable" with the
kernel's portable build (`SPECOFFLOAD_GGML_KERNEL=generic`: no AVX-512 / AVX2 path), `gguf_q4km_kernel_over_portable_*`.
Accuracy beside the speed: scripts/quant_accuracy.py against the source (top-1 agreement, mean KL, greedy 32 tokens;
--quick: 4 windows, 4 prompts). JSON under docs/perf/ with a top-level "summary" holding the ratios the issue names.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from scripts.common import PERF, io_compute_seconds, median_spread, run_meta, timed_generate, write_json
from scripts.get_models import model_dir
from scripts.quant_accuracy import compare, held_out
from specoffload.planner.units import format_bytes, parse_bytes
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.formats import WeightFormat, ggml, weight_format
from specoffload.runtime.prompts import humaneval_prompts
from specoffload.runtime.quantize import quantize_checkpoint
from specoffload.runtime.sampling import SamplingParams

TARGETS = {"dense": "target", "moefied": "qwen2.5-coder-1.5b-moefied"}
VARIANTS = {"fp16": None, "bf16": None, "int8": weight_format("int8"), "int4": weight_format("int4", 64),
            "int8a": weight_format("int8"), "int4u": weight_format("int4", 64), "int8u": weight_format("int8"),
            "int4k": weight_format("int4k", 64), "int4kh": weight_format("int4k", 64), "gguf": None,
            "gguf_repack": None, "gguf_portable": None,
            "int8_g32": weight_format("int8g", 32), "int4_g32": weight_format("int4k", 32),
            "int8ah": weight_format("int8"), "int4kah": weight_format("int4k", 64)}
#: the compressed variants the summary reports against the baselines (fp16, bf16)
RATIOS = ("int8", "int4", "int4k", "int4kh", "int8a", "int8_g32", "int4_g32", "int8ah", "int4kah")
#: variants run with their weights dequantized into the slots (packed_weights "off"): the loader path the packed
#: kernels replace, on the same checkpoint as the variant without the "u"
UNPACKED = {"int4u", "int8u"}
#: variants that compress the attention projections too (`specoffload quantize --attention`)
WITH_ATTENTION = {"int8a", "int8ah", "int4kah"}
#: variants that compress the LM head too (`specoffload quantize --head`)
WITH_HEAD = {"int4kh", "int8ah", "int4kah"}


def variant_dir(source: Path, name: str, spec: WeightFormat | None, where: Path | None,
                gguf: Path | None = None) -> Path:
    """The checkpoint of a variant: the source for fp16, the GGUF's companion directory for gguf, else its
    compressed copy (built once)."""
    if name in GGUF_KEYS:
        from scripts.get_models import SPECS, default_cache, fetch_gguf
        from specoffload.runtime.models.gguf import resolve_model

        return resolve_model(gguf or fetch_gguf(SPECS["target"], default_cache()))
    if name == "bf16":
        out = (where or source.parent) / f"{source.name}-bf16"
        if not out.exists():
            print(f"writing a bfloat16 copy of {source.name} -> {out}", file=sys.stderr)
            bf16_copy(source, out)
        return out
    if spec is None:
        return source
    suffix = spec.label + ("-attn" if name in WITH_ATTENTION else "") + ("-head" if name in WITH_HEAD else "")
    out = (where or source.parent) / f"{source.name}-{suffix}"
    if not out.exists():
        print(f"quantizing {source.name} -> {out}", file=sys.stderr)
        quantize_checkpoint(source, out, spec, attention=name in WITH_ATTENTION, head=name in WITH_HEAD)
    return out


def bf16_copy(source: Path, out: Path) -> None:
    """`source` with its floating tensors rounded to bfloat16 (the baseline that streams 16-bit weights the bfloat16
    compute dtype takes as stored, no cast per load), beside its config (dtype bfloat16), tokenizer and index; the
    files written under a temporary name, renamed when whole."""
    import json
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.suffix == ".safetensors":
            with safe_open(f, "pt") as st:
                tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 (safe_open has no iterator)
            save_file({k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()},
                      tmp / f.name, metadata={"format": "pt"})
            del tensors
        elif f.name == "config.json":
            config = json.loads(f.read_text())
            config["dtype"] = config["torch_dtype"] = "bfloat16"
            (tmp / f.name).write_text(json.dumps(config, indent=2))
        elif f.is_file() and f.name != "provenance.json":  # (the source's hashes: not this copy's)
            shutil.copy2(f, tmp / f.name)
    tmp.rename(out)


#: summary names of the GGUF variants
GGUF_KEYS = {"gguf": "gguf_q4km", "gguf_repack": "gguf_q4km_repack", "gguf_portable": "gguf_q4km_portable"}
#: variants run with another $SPECOFFLOAD_GGML_KERNEL (runtime/kernels): "off", the GGUF's blocks converted on every
#: load; "generic", the kernel's portable build
KERNEL_MODE = {"gguf_repack": "off", "gguf_portable": "generic"}


@contextlib.contextmanager
def ggml_kernel_mode(mode: str | None) -> Iterator[None]:
    """Engines built inside run with SPECOFFLOAD_GGML_KERNEL=`mode` in this process (None: as it is)."""
    if mode is None:
        yield
        return
    with mock.patch.dict(os.environ, {"SPECOFFLOAD_GGML_KERNEL": mode}):
        ggml.reload_kernel()
        try:
            yield
        finally:
            ggml.reload_kernel()


def overlap_bound(variant: dict, baseline: dict) -> float | None:
    """The most `variant` can gain over `baseline` in tokens/s at the same batch: the baseline's measured seconds
    per pass (wall / passes, medians over reps) over the variant's max(load, compute) seconds per pass (a pass that
    hides all of its load behind its compute, or the reverse). None without a trace."""
    period = statistics.median(r["wall_s"] / max(r["passes"], 1) for r in baseline["runs"])
    floor = max(variant["load_s_per_pass"], variant["compute_s_per_pass"])
    return round(period / floor, 3) if floor > 0 else None


def run(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> dict:
    def extra(engine: Engine, _: float) -> dict:
        stats = engine.last_stats
        load, compute = io_compute_seconds(engine)
        passes = max(stats.passes, 1)
        # the local backend's loader: its decompression and read seconds (the trace has the whole load op only)
        streamer = getattr(getattr(getattr(engine.pipeline, "workers", None), "prefetch", None), "streamer", None)
        return {"batch": engine.plan.batch, "packed_slots": engine.config.packed_slots,
                "bytes_per_pass": stats.bytes_read / passes,
                "load_s_per_pass": load / passes,
                "decompress_s_per_pass": (streamer.decompress_seconds if streamer else 0.0) / passes,
                "read_s_per_pass": (streamer.read_seconds if streamer else 0.0) / passes,
                "compute_s_per_pass": compute / passes,
                "io_over_compute": load / compute if compute else None}

    out = timed_generate(config, prompts, params, extra=extra)
    del out["token_ids"]  # (this benchmark compares formats: their tokens may differ)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="dense", help="dense | moefied | a checkpoint directory")
    ap.add_argument("--budget", default="4.5GiB")
    ap.add_argument("--dtype", default="float32", help="compute dtype: float32 | bfloat16 | float16")
    ap.add_argument("--regime", default=None, choices=["tight", "roomy", "moe", "dense"],
                    help="names the summary's ratios (default: moe for the moefied target, else dense)")
    ap.add_argument("--packed-weights", default="auto", choices=["auto", "on", "off"],
                    help="int8 weights kept packed in the slots (runtime/models/packed.py)")
    ap.add_argument("--weights-tier", default="disk", choices=["disk", "ram"])
    ap.add_argument("--batch", default="auto", help="rows per batch, or auto: the planner's pick per variant")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="fp16,int8,int4",
                    help="comma-separated names of VARIANTS (module docstring): fp16, bf16, int8, int8_g32, int4 "
                         "(group 64), int4_g32, int4k, int4kh, int8a (int8 with the attention projections), gguf")
    ap.add_argument("--variants-dir", type=Path, default=None, help="where compressed copies are built / found")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF of variant gguf (default: the target's Q4_K_M)")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--accuracy-only", action="store_true", help="no speed runs (no speed rows, no speed ratios)")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 16 new tokens, batch 4, 1 rep, quick accuracy")
    ap.add_argument("--out", default="compressed")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.reps = 8, 16, 1
        args.batch = "4" if args.batch == "auto" else args.batch
    meta = run_meta(args.dtype)  # machine, torch, dtype, commit, argv, date: at the start of the run
    source = model_dir(TARGETS[args.target]) if args.target in TARGETS else Path(args.target)
    names = args.variants.split(",")
    dirs = {n: variant_dir(source, n, VARIANTS[n], args.variants_dir, args.gguf) for n in names}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    prompts = [tok.encode(p) for p in humaneval_prompts(args.prompts)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    batch = args.batch if args.batch == "auto" else int(args.batch)
    seq = max(len(p) for p in prompts) + args.new_tokens
    results: dict[str, dict] = {}
    # variants interleaved per repetition: the disk's drift hits all alike
    for rep in range(0 if args.accuracy_only else args.reps):
        for n in names:
            config = EngineConfig(target=dirs[n], device_memory=args.budget, weights_tier=args.weights_tier,
                                  max_batch_size=batch, num_draft_tokens=0, max_seq_len=seq, trace=True,
                                  dtype=args.dtype,
                                  packed_weights="off" if n in UNPACKED else args.packed_weights)
            with ggml_kernel_mode(KERNEL_MODE.get(n)):
                r = run(config, prompts, params)
            results.setdefault(n, {"runs": []})["runs"].append(r)
            print(f"rep {rep} {n}: {r['tok_s']:.2f} tok/s at batch {r['batch']}, "
                  f"{format_bytes(int(r['bytes_per_pass']))} per pass", file=sys.stderr)
    for n, res in results.items():
        med, lo, hi = median_spread(r["tok_s"] for r in res["runs"])
        res |= {"tok_s_median": med, "tok_s_min": lo, "tok_s_max": hi, "dir": str(dirs[n]),
                **{k: statistics.median(r[k] for r in res["runs"]) for k in
                   ("bytes_per_pass", "load_s_per_pass", "decompress_s_per_pass", "compute_s_per_pass")}}
    accuracy = {}
    if not args.no_accuracy:
        rows, greedy_prompts = held_out(source, *((4, 128, 4) if args.quick else (12, 256, 32)))
        for n in names:
            if (VARIANTS[n] is not None or n in ("gguf", "bf16")) and n not in UNPACKED | set(KERNEL_MODE):
                accuracy[n] = compare(source, dirs[n], rows, greedy_prompts, 32)
    fp16 = results.get("fp16")
    summary: dict[str, object] = {"target": source.name, "budget": args.budget, "dtype": args.dtype,
                                  "quick": args.quick}
    regime = args.regime or ("moe" if args.target == "moefied" else "dense")
    if fp16:
        io = statistics.median(r["io_over_compute"] or 0.0 for r in fp16["runs"])
        summary["io_over_compute_fp16"] = round(io, 3)
        for n in RATIOS:
            if n in results:
                summary[f"{n}_over_fp16_{regime}"] = round(results[n]["tok_s_median"] / fp16["tok_s_median"], 3)
        for n in UNPACKED & set(results):
            summary[f"{n}_over_fp16_{regime}"] = round(results[n]["tok_s_median"] / fp16["tok_s_median"], 3)
        if "gguf_repack" in results:
            summary[f"gguf_q4km_repack_over_fp16_{regime}"] = round(results["gguf_repack"]["tok_s_median"]
                                                                    / fp16["tok_s_median"], 3)
        if "gguf" in results:
            summary[f"gguf_q4km_over_fp16_{regime}"] = round(results["gguf"]["tok_s_median"] / fp16["tok_s_median"], 3)
            summary["bytes_per_pass_ratio_gguf_q4km"] = round(results["gguf"]["bytes_per_pass"]
                                                              / fp16["bytes_per_pass"], 3)
        for n in ("int4", "int4k"):
            if n in results and fp16["bytes_per_pass"]:
                summary[f"bytes_per_pass_ratio_{n}"] = round(results[n]["bytes_per_pass"] / fp16["bytes_per_pass"], 3)
    bf16 = results.get("bf16")
    if bf16:  # the baseline of a bfloat16 compute dtype: 16-bit weights streamed as the compute dtype takes them
        summary["io_over_compute_bf16"] = round(statistics.median(r["io_over_compute"] or 0.0 for r in bf16["runs"]), 3)
        for n in RATIOS + ("fp16", *GGUF_KEYS):
            if n in results:
                key = GGUF_KEYS.get(n, n)
                summary[f"{key}_over_bf16_{regime}"] = round(results[n]["tok_s_median"] / bf16["tok_s_median"], 3)
                summary[f"bytes_per_pass_ratio_{key}_over_bf16"] = round(results[n]["bytes_per_pass"]
                                                                         / bf16["bytes_per_pass"], 3)
                summary[f"{key}_over_bf16_{regime}_per_rep"] = [  # (reps alternate: rep i against bf16's rep i)
                    round(r["tok_s"] / b["tok_s"], 3) for r, b in zip(results[n]["runs"], bf16["runs"])]
                summary[f"{key}_bound_over_bf16_{regime}"] = overlap_bound(results[n], bf16)
    if "gguf" in results and "gguf_repack" in results:  # the ggml kernel against converting the blocks per load
        summary[f"gguf_q4km_kernel_over_repack_{regime}"] = round(results["gguf"]["tok_s_median"]
                                                                  / results["gguf_repack"]["tok_s_median"], 3)
        summary[f"gguf_q4km_kernel_over_repack_{regime}_per_rep"] = [
            round(a["tok_s"] / b["tok_s"], 3) for a, b in zip(results["gguf"]["runs"], results["gguf_repack"]["runs"])]
    if "gguf" in results and "gguf_portable" in results:  # the kernel's vector path against its portable build
        summary[f"gguf_q4km_kernel_over_portable_{regime}"] = round(results["gguf"]["tok_s_median"]
                                                                    / results["gguf_portable"]["tok_s_median"], 3)
        summary[f"gguf_q4km_kernel_over_portable_{regime}_per_rep"] = [
            round(a["tok_s"] / b["tok_s"], 3)
            for a, b in zip(results["gguf"]["runs"], results["gguf_portable"]["runs"])]
    if "gguf" in results:
        summary["ggml_isa"] = ggml.block_kernel().isa if ggml.block_kernel() else None
    if "int4k" in results and "int4kh" in results:  # the head compressed too: more of the budget for layers
        summary[f"int4kh_over_int4k_{regime}"] = round(results["int4kh"]["tok_s_median"]
                                                       / results["int4k"]["tok_s_median"], 3)
    if "int4" in results and "int4k" in results:  # codes stored in the kernel's layout against permuted per load
        summary[f"int4k_over_int4_{regime}"] = round(results["int4k"]["tok_s_median"] / results["int4"]["tok_s_median"],
                                                     3)
    for packed, unpacked in (("int4", "int4u"), ("int8", "int8u")):
        if packed in results and unpacked in results:  # the packed kernels against the dequantizing loader
            summary[f"{packed}_packed_over_dequantized_{regime}"] = round(
                results[packed]["tok_s_median"] / results[unpacked]["tok_s_median"], 3)
    for n, a in accuracy.items():
        key = "gguf_q4km" if n == "gguf" else n
        summary[f"{key}_top1_agreement"] = a["top1_agreement"]
        summary[f"{key}_mean_kl"] = round(a["mean_kl"], 5)
        summary[f"{key}_greedy32_identical"] = f"{a['greedy_identical']}/{a['greedy_prompts']}"
    print("\n| variant | batch | tok/s (median, min-max) | bytes/pass | load s/pass | of it decompress "
          "| compute s/pass |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n, res in results.items():
        print(f"| {n} | {res['runs'][0]['batch']} | {res['tok_s_median']:.2f} ({res['tok_s_min']:.2f}-"
              f"{res['tok_s_max']:.2f}) | {format_bytes(int(res['bytes_per_pass']))} | {res['load_s_per_pass']:.2f} | "
              f"{res['decompress_s_per_pass']:.2f} | {res['compute_s_per_pass']:.2f} |")
    print(summary)
    path = write_json(PERF / (f"scratch/{args.out}_quick.json" if args.quick else f"{args.out}.json"), {
        "summary": summary, **meta, "args": vars(args) | {"variants_dir": str(args.variants_dir)},
        "budget_bytes": parse_bytes(args.budget), "results": results, "accuracy": accuracy})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
