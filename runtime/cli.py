"""`specoffload` command line: `specoffload generate ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from .config import EngineConfig
from .models.errors import SpecOffloadError
from .prompts import PromptFileError, humaneval_prompts, read_prompts_file
from .sampling import SamplingParams


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts from a file (or HumanEval) into JSONL")
    p.add_argument("--target", required=True, help="target checkpoint directory (HF safetensors)")
    p.add_argument("--draft", default=None, help="draft checkpoint directory (same vocabulary); omit for none")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", type=Path, help=".jsonl ({'prompt': ...} or {'token_ids': [...]}) or .txt file")
    src.add_argument("--humaneval", type=int, metavar="N", help="the first N HumanEval prompts (0: all 164)")
    p.add_argument("--output", "-o", type=Path, default=None, help="output JSONL (default: stdout)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("-k", "--num-draft-tokens", type=_int_or_auto, default=None,
                   help="draft tokens per step, or 'auto' (planner; the default with --device-memory, else 4)")
    p.add_argument("--batch-size", type=_int_or_auto, default=None,
                   help="max rows decoded together, or 'auto' (the default with --device-memory, else 16)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true")
    o = p.add_argument_group("offloading (set --device-memory to stream the target's weights)")
    o.add_argument("--device-memory", default=None, help="memory budget where compute runs, e.g. 3GiB")
    o.add_argument("--host-memory", default=None, help="host RAM for the target KV cache / ram tier")
    o.add_argument("--weights-tier", default="disk", choices=["disk", "ram"], help="where streamed weights live")
    o.add_argument("--num-buffers", type=int, default=2, help="ring slots of streamed layer weights")
    o.add_argument("--max-seq-len", type=int, default=None, help="prompt + output tokens per row the KV is sized for")
    o.add_argument("--expert-loading", default="auto", choices=["auto", "selected", "all"])
    o.add_argument("--trace", type=Path, default=None, help="write a Chrome/Perfetto trace JSON of the pipeline")
    o.add_argument("--show-placement", action="store_true", help="print the memory placement table to stderr")


def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="measure the hardware profile and print the planner's choice of batch and k")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--device-memory", required=True, help="memory budget, e.g. 4.5GiB")
    p.add_argument("--host-memory", default=None)
    p.add_argument("--weights-tier", default="disk", choices=["disk", "ram"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=Path, default=None,
                   help="the job's prompts: workload shape, and a short warm-up that measures the acceptance rate")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--alpha", type=float, default=None, help="acceptance rate to assume (default: measure / 0.7)")
    p.add_argument("--top", type=int, default=8, help="alternatives to print")
    p.add_argument("--quick-profile", action="store_true", help="fewer measurement points")


def _plan(args: argparse.Namespace) -> int:
    from specoffload.planner import Workload, search

    from .models.model import Transformer
    from .offload.engine import OffloadEngine
    from .offload.memory import format_bytes, machine_memory_bytes
    from .offload.placement import ModelShape
    from .offload.profiler import load_or_measure, profile_path
    from .tokenizer import load_tokenizer

    base = EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype, device_memory=args.device_memory,
                        host_memory=args.host_memory, weights_tier=args.weights_tier, max_seq_len=args.max_seq_len)
    profile = load_or_measure(base, quick=args.quick_profile, log=lambda m: print(m, file=sys.stderr))
    print(f"hardware profile: {profile_path(base)}", file=sys.stderr)
    prompts: list[list[int]] = []
    if args.prompts:
        tok = load_tokenizer(args.target)
        for p in read_prompts_file(args.prompts):
            prompts.append(tok.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p))
    alpha, alpha_source = args.alpha, "--alpha"
    if alpha is None and prompts and args.draft:
        seq = args.max_seq_len or max(len(p) for p in prompts[:4]) + 32
        warm = OffloadEngine(replace(base, max_batch_size=2, num_draft_tokens=4, max_seq_len=seq))
        warm.generate(prompts[:4], SamplingParams(max_new_tokens=16, ignore_eos=True))
        estimate = warm.tracker.estimate()
        if estimate is not None:
            alpha = estimate.alpha
            alpha_source = f"warm-up on 4 of the job's prompts ({estimate.trials:.0f} draft positions tried)"
        del warm
    if alpha is None:
        alpha, alpha_source = base.acceptance_prior, "prior (no prompts to measure it on)"
    mean_prompt = sum(map(len, prompts)) / len(prompts) if prompts else 256
    context = args.max_seq_len or int(max(map(len, prompts), default=256) + args.max_new_tokens)
    workload = Workload(num_prompts=len(prompts) or 256, prompt_len=mean_prompt, new_tokens=args.max_new_tokens)
    target = Transformer(args.target, dtype=base.torch_dtype)  # shapes only: no weights are loaded
    draft = Transformer(args.draft, dtype=base.torch_dtype) if args.draft else None
    result = search(
        profile, ModelShape.from_loader("target", target.loader),
        ModelShape.from_loader("draft", draft.loader) if draft else None, workload, alpha,
        int(base.device_memory), int(base.host_memory or machine_memory_bytes()), context=context,
        weights_tier=base.weights_tier, unified_memory=base.host_memory is None,
        dtype_bytes=base.torch_dtype.itemsize,
        top_k=target.config.num_experts_per_tok if target.config.num_experts else 0,
    )
    best = result.best
    print(f"workload: {workload.num_prompts} prompts x {workload.prompt_len:.0f} tokens, "
          f"{workload.new_tokens} new tokens; acceptance alpha = {alpha:.3f} ({alpha_source})")
    print(f"chosen policy: batch {best.decode_batch} (prefill = decode = draft batch), k = {best.k}: "
          f"predicted {best.predicted_tokens_per_s:.2f} tokens/s")
    print(best.placement_table)
    print("\n| batch | k | predicted tok/s | bound | device memory |")
    print("|---:|---:|---:|---|---:|")
    for p in result.alternatives[: args.top]:
        bound = p.estimate.step.bound if p.estimate is not None else ""
        print(f"| {p.decode_batch} | {p.k} | {p.predicted_tokens_per_s:.2f} | {bound} | "
              f"{format_bytes(int(p.memory.get('device_footprint', 0)))} |")
    if result.infeasible:
        print(f"\n{len(result.infeasible)} (batch, k) pairs do not fit the budget, e.g. "
              f"{result.infeasible[0][0]}, {result.infeasible[0][1]}: {result.infeasible[0][2][:160]}")
    return 0


def _write_jsonl(records: list[dict], output: Path | None) -> None:
    """Write atomically: a crash mid-write never leaves a truncated output file."""
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if output is None:
        sys.stdout.write(lines)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(lines)
    os.replace(tmp, output)


def _generate(args: argparse.Namespace) -> int:
    from .engine import Engine  # heavy import (torch, transformers) only when needed
    from .offload.engine import OffloadEngine

    prompts = read_prompts_file(args.prompts) if args.prompts else humaneval_prompts(args.humaneval or None)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    config = EngineConfig(
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        num_draft_tokens=args.num_draft_tokens,
        max_batch_size=args.batch_size,
        num_threads=args.threads,
        device_memory=args.device_memory,
        host_memory=args.host_memory,
        weights_tier=args.weights_tier,
        num_buffers=args.num_buffers,
        max_seq_len=args.max_seq_len,
        expert_loading=args.expert_loading,
        trace=args.trace is not None,
    )
    engine = OffloadEngine(config) if config.offloaded else Engine(config)
    if args.show_placement and isinstance(engine, OffloadEngine):
        print(engine.describe_placement(), file=sys.stderr)
    results = engine.generate(prompts, params, progress=not args.no_progress)
    records = [
        {
            "index": r.index,
            "prompt": prompts[r.index] if isinstance(prompts[r.index], str) else None,
            "text": r.text,
            "token_ids": r.token_ids,
            "finish_reason": r.finish_reason,
            "num_drafted": r.num_drafted,
            "num_accepted": r.num_accepted,
        }
        for r in results
    ]
    _write_jsonl(records, args.output)
    s = engine.last_stats
    assert s is not None
    summary = (
        f"{s.num_prompts} prompts, {s.generated_tokens} new tokens in {s.wall_s:.1f} s: "
        f"{s.tokens_per_s:.1f} tokens/s"
    )
    if isinstance(engine, OffloadEngine) and engine.policy is not None:
        print(f"planner: batch {engine.config.max_batch_size}, k {engine.k}"
              f" (re-planned {len(engine.replans)} times)", file=sys.stderr)
    if args.draft:
        summary += f", acceptance {s.acceptance_rate:.2f} ({s.num_accepted}/{s.num_drafted} draft tokens)"
    print(summary, file=sys.stderr)
    if isinstance(engine, OffloadEngine):
        print(f"weights read: {s.bytes_read / 1e9:.2f} GB in {s.passes} streamed passes", file=sys.stderr)
        if args.trace is not None:
            path = engine.tracer.save_chrome_trace(args.trace)
            print(engine.tracer.breakdown().table(), file=sys.stderr)
            print(f"trace: {path} (open in https://ui.perfetto.dev)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specoffload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_plan(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "plan":
            return _plan(args)
    except (SpecOffloadError, PromptFileError, ValueError, FileNotFoundError) as e:
        print(f"specoffload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specoffload: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
