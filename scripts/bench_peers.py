"""Side by side with llama.cpp on the same GGUF file, the same prompts and the same new tokens (issue 36, first cut).

    scripts/setup_llamacpp.sh      # once: llama-cpp-python built from source into its own venv (outside the repo)
    python -m scripts.bench_peers [--gguf FILE] [--prompts 8] [--new-tokens 32] [--reps 3] [--batches 1,8]
        [--llamacpp-batches 1,8] [--packed on,off]

Systems, all resident in host memory on this CPU, greedy, EOS ignored, the prompts (`--prompts` of them split
evenly over `--workloads`: HumanEval by default, aclsum summaries with `summarization`, each corpus's first ones)
tokenized once (the GGUF's own tokenizer) and given to each as token ids:
- llama.cpp at each `--llamacpp-batches` width (1: llama-cpp-python's high-level API, one sequence at a time; more:
  its low-level batch API, that many sequences decoded in one batch), `--threads` threads, its own kernels on the
  GGUF's blocks; run in the peer venv by scripts/peers/llamacpp_runner.py;
- transformers (`--transformers-batches`) on the fp16 conversion of the same file (scripts/get_models.py: the
  same weights), in `--dtype`, generate() on left-padded waves;
- ours on the same GGUF run as stored (runtime/models/gguf.py), in `--dtype`, at each `--batches` batch, with its
  q4_k / q6_k weights kept as their blocks for the ggml kernel (`packed_weights` "on") and dequantized at load
  ("off").
`--dtype auto` (the default) is bfloat16 where the CPU has native bfloat16 GEMMs, float32 where it has not (on AVX2
bfloat16 GEMMs run several times slower than float32 ones: docs/perf kernels_avx2).
The summary's `ours_over_llamacpp_resident(_decode)` is ours at its best batch over llama.cpp at its best.

`--budget` runs the memory-budget case instead (`budget_case`, JSON `<out>_budget`): llama.cpp (batched, weights
mmap'd as stored) and ours (streaming, `--ours-device-memory`) each in a subprocess inside a fresh memory cgroup of
`--memory-limit` bytes (cgroup v1, as root), the model's pages dropped from the page cache first, on `--gguf FILE` (a
trained model larger than the limit: the moefied MoE converted and quantized by llama.cpp's own tools,
scripts/peers/moefied_gguf.sh) or by default a qwen3moe GGUF at Qwen3-30B-A3B's layer shapes (`write_shape_gguf`:
random Q4_K_M-typed blocks, `--layers` layers, written once). Caveat (docs/perf `peers`): a random model repeats one
token, so its routing does not vary as a trained one's. A system killed under the limit (for memory) is a result: its
row says why (`failed`), it is not run again, and the summary lists it (`failed_under_limit`) with no ratio. Ours runs
at `--budget-batch`, llama.cpp at each of `--llamacpp-budget-batches` (n_ubatch `--llamacpp-ubatch`), and the ratio is
over llama.cpp's best. Both run with MALLOC_ARENA_MAX=`--malloc-arena-max` (2: glibc's per-thread arenas otherwise
keep ~0.2 GiB of our loader's and compute thread's freed buffers), ours with `--ours-prefill-chunk` prompt tokens per
pass, without a draft and, for each `--ours-drafters` entry (NAME@K), with that drafter too (summary keys
`ours_<NAME>_...`, its acceptance beside them); ours' row says where its passes went (`per_pass`: loader busy, of
it file reads and block conversion, and compute).
Per system: tokens/s with prefill counted (new tokens over the whole generate) and decode only (the tokens after
the first over the time after the first: llama.cpp's own split; ours from a second call with one new token,
T(N) - T(1)). Repetitions alternate systems. Greedy agreement with llama.cpp is reported (ours in `--dtype` against
llama.cpp's float32 accumulation: equal until a near tie). JSON under docs/perf/ (`peers`) with a "summary".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from scripts.common import PERF, WORKLOADS, median_spread, run_meta, utc_now, workload_prompts, write_json

ROOT = Path(__file__).resolve().parent.parent


def peer_prompts(tok: object, workloads: str, n: int) -> list[list[int]]:
    """`n` prompts as token ids, split evenly over `workloads` (comma-separated, scripts/common.py `WORKLOADS`; the
    first ones take the remainder): each workload's first prompts in corpus order (HumanEval's task order, aclsum's
    paper order), the workloads in the order named."""
    names = workloads.split(",")
    out: list[list[int]] = []
    for i, name in enumerate(names):
        take = n // len(names) + (i < n % len(names))
        out += [tok.encode(p) for p in workload_prompts(name)[:take]]  # type: ignore[attr-defined]
    return out


def llamacpp(python: str, gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int, n_ctx: int,
             batch: int) -> dict:
    req = {"model": str(gguf), "prompts": prompts, "new_tokens": new_tokens, "threads": threads, "n_ctx": n_ctx,
           "batch": batch}
    done = subprocess.run([python, str(ROOT / "scripts" / "peers" / "llamacpp_runner.py")], input=json.dumps(req),
                          capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    prefill, decode = sum(out["prefill_s"]), sum(out["decode_s"])
    n = len(prompts)
    return {"tok_s": n * new_tokens / (prefill + decode), "decode_tok_s": n * (new_tokens - 1) / decode,
            "prefill_s": prefill, "decode_s": decode, "tokens": out["tokens"], "version": out["version"]}


def ours(target: Path, prompts: list[list[int]], new_tokens: int, batch: int, packed: str,
         dtype: str = "bfloat16") -> dict:
    import time

    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.sampling import SamplingParams

    engine = Engine(EngineConfig(target=target, dtype=dtype, max_batch_size=batch, num_draft_tokens=0,
                                 packed_weights=packed))
    try:
        times = {}
        for n in (1, new_tokens):
            params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
            start = time.perf_counter()
            results = engine.generate(prompts, params)
            times[n] = time.perf_counter() - start
        total, first = times[new_tokens], times[1]
        return {"tok_s": len(prompts) * new_tokens / total,
                "decode_tok_s": len(prompts) * (new_tokens - 1) / max(total - first, 1e-9),
                "total_s": total, "first_token_s": first, "tokens": [r.token_ids for r in results]}
    finally:
        engine.close()


def transformers_run(checkpoint: Path, prompts: list[list[int]], new_tokens: int, batch: int, threads: int,
                     dtype: str = "bfloat16") -> dict:
    """transformers' generate on the fp16 conversion of the same GGUF (the same weights), in `dtype`, `batch` prompts
    at a time left-padded, greedy, EOS ignored (min_new_tokens); timed as ours: T(N), and T(N) - T(1) for decode."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype)).eval()
    times, tokens = {}, []
    for n in (1, new_tokens):
        start, out = time.perf_counter(), []
        for i in range(0, len(prompts), batch):
            wave = prompts[i:i + batch]
            width = max(map(len, wave))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in wave])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in wave])
            with torch.inference_mode():
                gen = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=0)
            out += gen[:, width:].tolist()
        times[n] = time.perf_counter() - start
        tokens = out
    total, first = times[new_tokens], times[1]
    return {"tok_s": len(prompts) * new_tokens / total,
            "decode_tok_s": len(prompts) * (new_tokens - 1) / max(total - first, 1e-9), "total_s": total,
            "first_token_s": first, "tokens": tokens}


SHAPES = Path.home() / ".cache" / "specoffload" / "shapes"
CGROUP = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller (this machine's; v2 would be memory.max)
#: the layer shapes of Qwen3-30B-A3B (scripts/bench_families.py): hidden 2048, 32 heads / 4 KV heads of 128,
#: 128 experts of 768, top 8, vocab 151936 (Qwen2.5's tokenizer: the same 151936 ids)
QWEN3_30B = {"hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128, "top_k": 8,
             "expert_width": 768, "vocab": 151936}


def _random_blocks(rng, rows: int, cols: int, kind: str):  # noqa: ANN001, ANN202
    """rows x cols weights of GGML type `kind` (Q4_K / Q6_K) as random blocks with small finite float16 scales."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    group, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(rows, cols // group, size), dtype=np.uint8)
    for at, scale in {"Q4_K": ((0, 2e-4), (2, 2e-4)), "Q6_K": ((208, 1e-5),)}[kind]:
        d = np.abs(rng.normal(0, scale, size=raw.shape[:2])).astype(np.float16)
        raw[..., at:at + 2] = d[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_shape_gguf(layers: int, tokenizer_from: Path, out: Path) -> Path:
    """A qwen3moe GGUF at Qwen3-30B-A3B's layer shapes with `layers` layers, written once: random blocks typed as a
    Q4_K_M file types them (Q4_K; Q6_K for attn_v, every other layer's ffn_down and the head; norms and routers
    F32), the tokenizer metadata of `tokenizer_from` (the same 151936-token vocabulary). Both engines run it as
    stored (random weights: the tokens are meaningless, the work is a real model's)."""
    import gguf
    import numpy as np

    if out.is_file():
        return out
    c, rng = QWEN3_30B, np.random.default_rng(0)
    h, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "qwen3moe")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 40960), (w.add_embedding_length, h),
                       (w.add_feed_forward_length, 6144), (w.add_head_count, c["heads"]),
                       (w.add_head_count_kv, c["kv_heads"]), (w.add_key_length, c["head_dim"]),
                       (w.add_value_length, c["head_dim"]), (w.add_rope_freq_base, 1e6),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_expert_count, c["experts"]),
                       (w.add_expert_used_count, c["top_k"]), (w.add_expert_feed_forward_length, c["expert_width"])):
        add(value)
    reader = gguf.GGUFReader(str(tokenizer_from))
    f = reader.fields
    w.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    w.add_token_list(f["tokenizer.ggml.tokens"].contents())
    w.add_token_types(f["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(f["tokenizer.ggml.merges"].contents())
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"].contents())
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"].contents())
    w.add_pad_token_id(f["tokenizer.ggml.padding_token_id"].contents())
    w.add_add_bos_token(False)

    def blocks(name: str, rows: int, cols: int, kind: str, experts: int = 0) -> None:
        data = _random_blocks(rng, rows * max(experts, 1), cols, kind)
        if experts:
            data = data.reshape(experts, rows, -1)
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])

    def floats(name: str, *shape: int, ones: bool = False) -> None:
        w.add_tensor(name, np.ones(shape, np.float32) if ones else rng.normal(0, 0.02, shape).astype(np.float32))

    blocks("token_embd.weight", c["vocab"], h, "Q4_K")
    for i in range(layers):
        b = f"blk.{i}."
        floats(b + "attn_norm.weight", h, ones=True)
        blocks(b + "attn_q.weight", q, h, "Q4_K")
        blocks(b + "attn_k.weight", kv, h, "Q4_K")
        blocks(b + "attn_v.weight", kv, h, "Q6_K")
        blocks(b + "attn_output.weight", h, q, "Q4_K")
        floats(b + "attn_q_norm.weight", c["head_dim"], ones=True)
        floats(b + "attn_k_norm.weight", c["head_dim"], ones=True)
        floats(b + "ffn_norm.weight", h, ones=True)
        floats(b + "ffn_gate_inp.weight", c["experts"], h)
        blocks(b + "ffn_gate_exps.weight", c["expert_width"], h, "Q4_K", c["experts"])
        blocks(b + "ffn_up_exps.weight", c["expert_width"], h, "Q4_K", c["experts"])
        blocks(b + "ffn_down_exps.weight", h, c["expert_width"], "Q6_K" if i % 2 else "Q4_K", c["experts"])
    floats("output_norm.weight", h, ones=True)
    blocks("output.weight", c["vocab"], h, "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def _drop_cached(path: Path) -> None:
    """Evict `path`'s pages from the page cache (clean pages: POSIX_FADV_DONTNEED), so that a run under a memory
    limit cannot use pages another process's cgroup paid for."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def limited(argv: list[str], request: dict, limit: int, model: Path, arena_max: int = 0) -> dict:
    """Run `argv` (a runner reading `request` as JSON on stdin) in a fresh memory cgroup of `limit` bytes, the
    model's pages dropped from the page cache first, with MALLOC_ARENA_MAX=`arena_max` when > 0 (glibc keeps freed
    memory in per-thread arenas; a streaming engine's loader and compute threads each grow one); its JSON output,
    plus the cgroup's peak memory and wall time."""
    import os
    import time

    group = CGROUP / f"specoffload-peers-{os.getpid()}"
    group.mkdir(exist_ok=True)
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        _drop_cached(model)
        wrapper = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *argv]
        start = time.perf_counter()
        env = os.environ | ({"MALLOC_ARENA_MAX": str(arena_max)} if arena_max > 0 else {})
        done = subprocess.run(wrapper, input=json.dumps(request), capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            why = " (killed for memory)" if done.returncode in (-9, 137) else ""
            raise RuntimeError(f"{argv[-1]} under a {limit / 2**30:.2f} GiB limit exited {done.returncode}{why}: "
                               f"{done.stderr[-2000:]}")
        out = json.loads(done.stdout)
        out["peak_bytes"] = int((group / "memory.max_usage_in_bytes").read_text())
        out["wall_s"] = wall
        return out
    finally:
        for _ in range(50):  # the cgroup empties once its last process is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def budget_case(args: argparse.Namespace, python: str, tokenizer_from: Path) -> int:
    """llama.cpp (mmap) and ours (streaming) under one memory limit on a model larger than it (module docstring)."""
    from specoffload.planner.units import parse_bytes
    from specoffload.runtime.models.gguf import resolve_model
    from specoffload.runtime.tokenizer import load_tokenizer

    meta = run_meta(args.dtype)
    limit = parse_bytes(args.memory_limit)
    shaped = SHAPES / f"qwen3_30b_a3b-{args.layers}l-q4km.gguf"
    gguf = args.gguf or write_shape_gguf(args.layers, tokenizer_from, shaped)
    target = resolve_model(gguf)  # the companion (config, tokenizer) made here, outside the limit
    tok = load_tokenizer(target)
    prompts = peer_prompts(tok, args.workloads, args.prompts)
    n_ctx = max(map(len, prompts)) + args.new_tokens + 8
    device_memory = parse_bytes(args.ours_device_memory)
    peers = ROOT / "scripts" / "peers"
    llama_batches = [int(b) for b in (args.llamacpp_budget_batches or str(args.budget_batch)).split(",")]
    systems = {
        f"llama.cpp b{b}": lambda b=b: _llamacpp_result(limited(
            [python, str(peers / "llamacpp_runner.py")],
            {"model": str(gguf), "prompts": prompts, "new_tokens": args.new_tokens, "threads": args.threads,
             "n_ctx": n_ctx, "batch": b, "repack": False, "ubatch": args.llamacpp_ubatch}, limit, gguf,
            args.malloc_arena_max), len(prompts), args.new_tokens)
        for b in llama_batches}
    ours_names = {}  # system name -> drafter name ("none": ours without a draft, the summary's headline)
    for drafter, k in [("none", 0), *_drafters(args.ours_drafters)]:
        name = f"ours b{args.budget_batch}" + (f" {drafter} k{k}" if k else "")
        ours_names[name] = drafter
        systems[name] = lambda drafter=drafter, k=k: _ours_result(limited(
            [sys.executable, "-m", "scripts.peers.ours_runner"],  # (from ROOT: it imports scripts.common)
            {"model": str(target), "prompts": prompts, "new_tokens": args.new_tokens, "batch": args.budget_batch,
             "device_memory": device_memory, "packed_weights": "auto", "prefill_chunk": args.ours_prefill_chunk,
             "dtype": args.dtype, "drafter": drafter, "k": k},
            limit, gguf, args.malloc_arena_max), len(prompts), args.new_tokens)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    failed: dict[str, str] = {}  # a system that cannot run under the limit (killed for memory): not run again
    for rep in range(args.reps):
        for name, run in systems.items():
            if name in failed:
                continue
            try:
                r = run()
            except RuntimeError as exc:
                failed[name] = str(exc)
                print(f"rep {rep} {name}: {exc}", file=sys.stderr)
                continue
            runs[name].append(r)
            print(f"rep {rep} {name}: {r['tok_s']:.2f} tok/s (decode {r['decode_tok_s']:.2f}), peak "
                  f"{r['peak_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    results: dict[str, dict] = {name: {"failed": why} for name, why in failed.items()}
    for name, rs in runs.items():
        if name in failed or not rs:
            continue
        med, lo, hi = median_spread(r["tok_s"] for r in rs)
        dmed, dlo, dhi = median_spread(r["decode_tok_s"] for r in rs)
        results[name] = {"tok_s_median": med, "tok_s_min": lo, "tok_s_max": hi, "decode_tok_s_median": dmed,
                         "decode_tok_s_min": dlo, "decode_tok_s_max": dhi,
                         "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]}
    ran = [f"llama.cpp b{b}" for b in llama_batches if f"llama.cpp b{b}" not in failed and runs[f"llama.cpp b{b}"]]
    llama_name = max(ran, key=lambda n: results[n]["tok_s_median"]) if ran else None  # llama.cpp at its best batch
    llama_decode = max(ran, key=lambda n: results[n]["decode_tok_s_median"]) if ran else None
    summary = {"gguf": gguf.name, "prompts": len(prompts), "workloads": args.workloads,
               "memory_limit_bytes": limit, "model_bytes": gguf.stat().st_size, "ours_device_memory": device_memory,
               "failed_under_limit": sorted(failed),
               "best_llamacpp": llama_name}
    degenerate = [name for name, rs in runs.items() if rs and name not in failed and _degenerate(rs[0]["tokens"])]
    summary["degenerate_output"] = degenerate  # every row one repeated id (llama.cpp: NaN logits argmax to 0)
    for name in degenerate:
        results[name]["degenerate_output"] = True
    for ours_name, drafter in ours_names.items():
        if llama_name is None or ours_name in failed or not runs[ours_name]:
            continue
        # summary keys: ours_<what> without a draft (the headline), ours_<drafter>_<what> with one
        key = "ours_" if drafter == "none" else f"ours_{drafter}_"
        reference = runs[llama_name][0]["tokens"]
        same = sum(a == b for x, y in zip(runs[ours_name][0]["tokens"], reference) for a, b in zip(x, y))
        results[ours_name]["greedy_agreement_with_llamacpp"] = same / max(sum(map(len, reference)), 1)
        results[ours_name]["bytes_read_per_token"] = statistics.median(
            r["bytes_read"] / (len(prompts) * args.new_tokens) for r in runs[ours_name])
        # where ours' passes went (medians over reps, seconds per pass of the N-token call): the loader's busy time
        # and, of it, reading the file and turning stored blocks into the kernels' layouts; the pass's compute
        per_pass = {what: round(statistics.median(r[what] / max(r["passes"], 1) for r in runs[ours_name]), 4)
                    for what in ("load_s", "read_s", "decompress_s", "compute_s")}
        results[ours_name]["per_pass"] = per_pass
        summary |= {f"{key}load_s_per_pass": per_pass["load_s"], f"{key}read_s_per_pass": per_pass["read_s"],
                    f"{key}decompress_s_per_pass": per_pass["decompress_s"],
                    f"{key}compute_s_per_pass": per_pass["compute_s"],
                    f"{key}io_over_compute": round(per_pass["load_s"] / per_pass["compute_s"], 3)
                    if per_pass["compute_s"] else None}
        if drafter != "none":
            accepted = [r["acceptance"] for r in runs[ours_name] if r.get("acceptance") is not None]
            summary[f"{key}acceptance"] = round(statistics.median(accepted), 3) if accepted else None
        if not degenerate:  # both ran and computed the model
            summary |= {f"{key}over_llamacpp_budget": round(results[ours_name]["tok_s_median"]
                                                            / results[llama_name]["tok_s_median"], 3),
                        f"{key}over_llamacpp_budget_decode": round(results[ours_name]["decode_tok_s_median"]
                                                                   / results[llama_decode]["decode_tok_s_median"], 3)}
    print(summary)
    name = f"scratch/{args.out}_budget_quick.json" if args.quick else f"{args.out}_budget.json"
    path = write_json(PERF / name, {"summary": summary, **meta, "end": utc_now(),
                                    "args": vars(args) | {"gguf": str(gguf)}, "results": results})
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _drafters(text: str) -> list[tuple[str, int]]:
    """`--ours-drafters` "suffix@4,ngram@3" -> [("suffix", 4), ("ngram", 3)] (no @K: k 4)."""
    out = []
    for entry in filter(None, text.split(",")):
        name, _, k = entry.partition("@")
        out.append((name, int(k) if k else 4))
    return out


def _degenerate(tokens: list[list[int]]) -> bool:
    """Every row one repeated token id: a system that did not compute the model (NaN logits), not a result."""
    return all(len(set(row)) <= 1 for row in tokens) and len(tokens) > 0 and all(len(row) > 1 for row in tokens)


def _llamacpp_result(out: dict, prompts: int, new_tokens: int) -> dict:
    prefill, decode = sum(out["prefill_s"]), sum(out["decode_s"])
    return out | {"tok_s": prompts * new_tokens / (prefill + decode),
                  "decode_tok_s": prompts * (new_tokens - 1) / decode}


def _ours_result(out: dict, prompts: int, new_tokens: int) -> dict:
    total, first = out["total_s"], out["first_token_s"]
    return out | {"tok_s": prompts * new_tokens / total,
                  "decode_tok_s": prompts * (new_tokens - 1) / max(total - first, 1e-9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="default: the target's Q4_K_M (scripts/get_models.py)")
    ap.add_argument("--prompts", type=int, default=8, help="split evenly over --workloads")
    ap.add_argument("--workloads", default="code", help=f"comma-separated, of {', '.join(WORKLOADS)}: code is "
                    "HumanEval, summarization aclsum (each workload's first prompts in corpus order)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8", help="ours: batch sizes")
    ap.add_argument("--llamacpp-batches", default="1,8", help="llama.cpp: sequences per batch (1: its high-level API)")
    ap.add_argument("--transformers-batches", default="8",
                    help="transformers (bfloat16, the fp16 conversion); '' for none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="compute dtype of ours and transformers; auto: bfloat16 where the CPU has native bfloat16 "
                         "GEMMs, else float32 (resident case); bfloat16 under --budget")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 8 new tokens, 1 rep (scratch/)")
    ap.add_argument("--budget", action="store_true",
                    help="the memory-budget case instead: both engines in a memory cgroup of --memory-limit on a "
                         "Qwen3-30B-A3B-shaped Q4_K_M GGUF of --layers layers (larger than the limit)")
    ap.add_argument("--memory-limit", default="3GiB")
    ap.add_argument("--ours-device-memory", default="1.75GiB", help="ours' --device-memory under the limit")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget-batch", type=int, default=8, help="ours' batch under the limit")
    ap.add_argument("--llamacpp-budget-batches", default="",
                    help="llama.cpp's sequences per batch under the limit, comma-separated (default: --budget-batch); "
                         "the ratio is over its best")
    ap.add_argument("--ours-drafters", default="",
                    help="under the limit, ours also with each of these drafters, NAME@K comma-separated (e.g. "
                         "suffix@4): summary keys ours_<NAME>_over_llamacpp_budget and its acceptance")
    ap.add_argument("--llamacpp-ubatch", type=int, default=0,
                    help="llama.cpp's n_ubatch under the limit (0: a wave's whole prefill in one step)")
    ap.add_argument("--ours-prefill-chunk", type=int, default=256,
                    help="ours' prefill_chunk under the limit (prompt tokens per pass: bounds prefill activations)")
    ap.add_argument("--malloc-arena-max", type=int, default=2,
                    help="MALLOC_ARENA_MAX for both systems under the limit (0: glibc's default)")
    ap.add_argument("--packed", default="on,off",
                    help="ours' packed_weights at each batch: on (the blocks, ggml kernel), off (dequantized at load)")
    ap.add_argument("--out", default="peers")
    args = ap.parse_args()
    if not set(args.packed.split(",")) <= {"on", "off"}:
        ap.error(f"--packed takes on, off or on,off, got {args.packed!r}")
    try:
        drafters = _drafters(args.ours_drafters)
    except ValueError:
        ap.error(f"--ours-drafters takes NAME@K entries, comma-separated, got {args.ours_drafters!r}")
    from specoffload.runtime.offload.drafters import DRAFTERS

    if any(k < 1 for _, k in drafters):
        ap.error(f"--ours-drafters: K is the draft tokens per row per pass, at least 1, got {args.ours_drafters!r}")
    unknown = [name for name, _ in drafters if name not in DRAFTERS or name == "none"]
    if unknown:
        known = ", ".join(sorted(set(DRAFTERS) - {"none"}))
        ap.error(f"--ours-drafters: unknown drafter {unknown[0]!r}; one of {known}")
    if not args.workloads or not set(args.workloads.split(",")) <= set(WORKLOADS):
        ap.error(f"--workloads takes a comma-separated subset of {', '.join(WORKLOADS)}, got {args.workloads!r}")
    if args.quick:
        args.prompts, args.new_tokens, args.reps = 2, 8, 1
    if args.dtype == "auto":
        import torch

        from specoffload.runtime.models.row_buckets import native_16bit

        # under a memory limit bfloat16 either way: float32 doubles KV, activations and the host-resident parts (the
        # moefied GGUF at 16 rows needs 374 MiB of device budget in float32 against 348 given, docs/perf `peers`)
        args.dtype = "bfloat16" if args.budget or native_16bit(torch.bfloat16) else "float32"
    meta = run_meta(args.dtype)
    python = subprocess.run([str(ROOT / "scripts" / "setup_llamacpp.sh")], capture_output=True, text=True,
                            check=True).stdout.strip().splitlines()[-1]
    from scripts.get_models import SPECS, default_cache, fetch_gguf
    from specoffload.runtime.models.gguf import resolve_model
    from specoffload.runtime.tokenizer import load_tokenizer

    if args.budget:
        return budget_case(args, python, fetch_gguf(SPECS["target"], default_cache()))
    gguf = args.gguf or fetch_gguf(SPECS["target"], default_cache())
    target = resolve_model(gguf)
    tok = load_tokenizer(target)
    prompts = peer_prompts(tok, args.workloads, args.prompts)
    n_ctx = max(map(len, prompts)) + args.new_tokens + 8
    systems = {f"llama.cpp b{b}": lambda b=b: llamacpp(python, gguf, prompts, args.new_tokens, args.threads, n_ctx, b)
               for b in map(int, args.llamacpp_batches.split(","))}
    if args.transformers_batches:
        converted = default_cache() / SPECS["target"].name  # the same GGUF converted to fp16 (scripts/get_models.py)
        for b in map(int, args.transformers_batches.split(",")):
            systems[f"transformers b{b}"] = lambda b=b: transformers_run(converted, prompts, args.new_tokens, b,
                                                                         args.threads, args.dtype)
    for b in map(int, args.batches.split(",")):
        for packed in args.packed.split(","):
            systems[f"ours b{b} packed-{packed}"] = lambda b=b, packed=packed: ours(target, prompts, args.new_tokens,
                                                                                   b, packed, args.dtype)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for rep in range(args.reps):
        for name, run in systems.items():
            r = run()
            runs[name].append(r)
            print(f"rep {rep} {name}: {r['tok_s']:.2f} tok/s (decode {r['decode_tok_s']:.2f})", file=sys.stderr)
    first = next(n for n in runs if n.startswith("llama.cpp"))
    reference = runs[first][0]["tokens"]
    results, summary = {}, {"gguf": gguf.name, "prompts": len(prompts), "workloads": args.workloads,
                            "new_tokens": args.new_tokens,
                            "threads": args.threads, "dtype": args.dtype,
                            "llama_cpp_python": runs[first][0]["version"]}
    for name, rs in runs.items():
        med, lo, hi = median_spread(r["tok_s"] for r in rs)
        dmed, dlo, dhi = median_spread(r["decode_tok_s"] for r in rs)
        same = sum(a == b for x, y in zip(rs[0]["tokens"], reference) for a, b in zip(x, y))
        results[name] = {"tok_s_median": med, "tok_s_min": lo, "tok_s_max": hi, "decode_tok_s_median": dmed,
                         "decode_tok_s_min": dlo, "decode_tok_s_max": dhi,
                         "greedy_agreement_with_llamacpp": same / sum(map(len, reference)),
                         "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]}
    def best(prefix: str, key: str) -> str:
        return max((n for n in results if n.startswith(prefix)), key=lambda n: results[n][key])

    # each system at its own best batch: ours' best over llama.cpp's best, with prefill counted and decode only
    base = results[best("llama.cpp", "tok_s_median")]
    summary |= {"best_ours": best("ours", "tok_s_median"), "best_llamacpp": best("llama.cpp", "tok_s_median"),
                "ours_over_llamacpp_resident": round(results[best("ours", "tok_s_median")]["tok_s_median"]
                                                     / base["tok_s_median"], 3),
                "ours_over_llamacpp_resident_decode": round(
                    results[best("ours", "decode_tok_s_median")]["decode_tok_s_median"]
                    / results[best("llama.cpp", "decode_tok_s_median")]["decode_tok_s_median"], 3)}
    for name in results:
        if name.startswith("ours"):
            key = name.replace("ours ", "").replace(" ", "_").replace("-", "_")
            summary[f"{key}_over_llamacpp"] = round(results[name]["tok_s_median"] / base["tok_s_median"], 3)
    if any(n.startswith("transformers") for n in results):
        summary["ours_over_transformers"] = round(results[best("ours", "tok_s_median")]["tok_s_median"]
                                                  / results[best("transformers", "tok_s_median")]["tok_s_median"], 3)
    print("\n| system | tok/s with prefill (median, min-max) | decode tok/s (median, min-max) | greedy = llama.cpp |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['tok_s_median']:.2f} ({r['tok_s_min']:.2f}-{r['tok_s_max']:.2f}) | "
              f"{r['decode_tok_s_median']:.2f} ({r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f}) | "
              f"{r['greedy_agreement_with_llamacpp']:.3f} |")
    print(summary)
    path = write_json(PERF / (f"scratch/{args.out}_quick.json" if args.quick else f"{args.out}.json"), {
        "summary": summary, **meta, "end": utc_now(), "args": vars(args) | {"gguf": str(gguf)},
        "results": results})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
