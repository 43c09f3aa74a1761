"""`specoffload` command line: `specoffload generate ...`."""

from __future__ import annotations

import argparse
import sys
import time
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
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already in --output and generate only the missing prompts")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--chunk-size", type=int, default=256,
                   help="prompts per chunk; each finished chunk is appended to --output and fsynced (default 256)")
    p.add_argument("--backend", default="local", choices=["local", "ray"],
                   help="local: one process; ray: the Ray actor runtime (needs --device-memory)")
    p.add_argument("--ray-address", default=None,
                   help="Ray to join with --backend ray (default: RAY_ADDRESS, e.g. inside `ray job submit`, "
                        "else a local Ray)")
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


class _LocalBackend:
    """The in-process engine behind the chunk loop (resident Engine, or OffloadEngine with --device-memory)."""

    def __init__(self, config: EngineConfig, args: argparse.Namespace) -> None:
        from .engine import Engine  # heavy import (torch, transformers) only when needed
        from .offload.engine import OffloadEngine

        self.engine = OffloadEngine(config) if config.offloaded else Engine(config)
        self.offloaded = isinstance(self.engine, OffloadEngine)
        self.progress = not args.no_progress
        self.bytes_read = self.passes = 0
        if args.show_placement and self.offloaded:
            print(self.engine.describe_placement(), file=sys.stderr)

    def generate(self, prompts: list, params: SamplingParams) -> list:
        results = self.engine.generate(prompts, params, progress=self.progress)
        if self.offloaded:
            self.bytes_read += self.engine.last_stats.bytes_read
            self.passes += self.engine.last_stats.passes
        return results

    def report(self, args: argparse.Namespace) -> None:
        if not self.offloaded:
            return
        engine = self.engine
        if engine.policy is not None:
            print(f"planner: batch {engine.config.max_batch_size}, k {engine.k}"
                  f" (re-planned {len(engine.replans)} times)", file=sys.stderr)
        print(f"weights read: {self.bytes_read / 1e9:.2f} GB in {self.passes} streamed passes", file=sys.stderr)
        if args.trace is not None:
            path = engine.tracer.save_chrome_trace(args.trace)
            print(engine.tracer.breakdown().table(), file=sys.stderr)
            print(f"trace: {path} (open in https://ui.perfetto.dev)", file=sys.stderr)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class _RayBackend:
    """The Ray actor runtime (`specoffload.actors.connect`) behind the same chunk loop."""

    def __init__(self, config: EngineConfig, args: argparse.Namespace) -> None:
        if not config.offloaded:
            raise ValueError("--backend ray runs the offloaded engine: give --device-memory")
        if args.trace is not None:
            raise ValueError("--trace is recorded by the local backend only; drop it or use --backend local")
        # The one place the runtime reaches into actors/ (and so Ray): only when asked for, at call time.
        from specoffload.actors import connect

        self.handle = connect(config, args.ray_address)
        self.bytes_read = self.passes = self.recoveries = 0
        if args.show_placement:
            print(self.handle.placement, file=sys.stderr)

    def generate(self, prompts: list, params: SamplingParams) -> list:
        results = self.handle.generate(prompts, params)
        s = self.handle.stats()
        self.bytes_read += int(s.get("bytes_read", 0))
        self.passes += int(s.get("passes", 0))
        self.recoveries += int(s.get("recoveries", 0))
        return results

    def report(self, args: argparse.Namespace) -> None:
        print(f"weights read: {self.bytes_read / 1e9:.2f} GB in {self.passes} streamed passes; "
              f"{self.recoveries} recoveries from lost actors", file=sys.stderr)

    def close(self) -> None:
        self.handle.shutdown()


def _generate(args: argparse.Namespace) -> int:
    from .outputs import JsonlSink

    if args.chunk_size < 1:
        raise ValueError(f"--chunk-size must be >= 1, got {args.chunk_size}")
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
    with JsonlSink(args.output, resume=args.resume, overwrite=args.overwrite) as sink:
        sink.check_matches(prompts)
        # Chunks are cut on input indices and a chunk is redone whole, with its own seed: a batch's rows share a
        # random stream, so only whole chunks reproduce what an uninterrupted run writes.
        size = args.chunk_size
        unfinished = {i // size for i in range(len(prompts)) if i not in sink.done}
        redo = {i for i in sink.done if i // size in unfinished}
        if redo:
            print(f"resuming {args.output}: {len(redo)} row(s) of unfinished chunks will be generated again",
                  file=sys.stderr)
            sink.forget(redo)
        todo = [i for i in range(len(prompts)) if i not in sink.done]
        if sink.done:
            print(f"resuming {args.output}: {len(sink.done)} of {len(prompts)} prompts already done", file=sys.stderr)
        if not todo:
            print("nothing to do: every prompt has a row", file=sys.stderr)
            return 0
        backend = _RayBackend(config, args) if args.backend == "ray" else _LocalBackend(config, args)
        tokens = drafted = accepted = 0
        start = time.perf_counter()
        try:
            chunks: dict[int, list[int]] = {}
            for i in todo:
                chunks.setdefault(i // size, []).append(i)
            for number, (c, indices) in enumerate(sorted(chunks.items()), 1):
                chunk_params = params if params.seed is None else replace(params, seed=params.seed + c)
                results = backend.generate([prompts[i] for i in indices], chunk_params)
                rows = []
                for r in sorted(results, key=lambda r: r.index):
                    index = indices[r.index]
                    rows.append({
                        "index": index,
                        "prompt": prompts[index] if isinstance(prompts[index], str) else None,
                        "text": r.text,
                        "token_ids": r.token_ids,
                        "finish_reason": r.finish_reason,
                        "num_drafted": r.num_drafted,
                        "num_accepted": r.num_accepted,
                    })
                    tokens += len(r.token_ids)
                    drafted += r.num_drafted
                    accepted += r.num_accepted
                sink.write(rows)
                if len(chunks) > 1 and not args.no_progress:
                    print(f"chunk {number}/{len(chunks)}: {len(rows)} rows written", file=sys.stderr)
            wall = time.perf_counter() - start
            rate = tokens / max(wall, 1e-9)
            summary = f"{len(todo)} prompts, {tokens} new tokens in {wall:.1f} s: {rate:.1f} tokens/s"
            if args.draft:
                summary += f", acceptance {accepted / max(drafted, 1):.2f} ({accepted}/{drafted} draft tokens)"
            backend.report(args)
            print(summary, file=sys.stderr)
        finally:
            backend.close()
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
    except (SpecOffloadError, PromptFileError, ValueError, FileNotFoundError, OSError) as e:
        print(f"specoffload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specoffload: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
