"""`specoffload` command line: `specoffload generate ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
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
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="max rows decoded together")
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
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
    except (SpecOffloadError, PromptFileError, ValueError, FileNotFoundError) as e:
        print(f"specoffload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specoffload: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
