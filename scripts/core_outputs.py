"""Greedy outputs of the real models across runners and drafters, to compare two commits byte for byte.

    python -m scripts.core_outputs --out A.json            # on one commit (resident and offloaded, every drafter)
    python -m scripts.core_outputs --compare A.json B.json # the token ids of every case equal? (exit 1 if not)

Cases: the real dense pair (Qwen2.5-Coder 1.5B target, 0.5B draft) and the moefied MoE built from it
(scripts/make_moe.py), each resident (no device_memory) and offloaded (streamed from disk at --budget), with no
draft, the draft model (dense), the target's resident experts ("self", the MoE offloaded), ngram and suffix; float32,
greedy, EOS ignored, the first --prompts HumanEval prompts, --tokens new tokens, batch --batch, k --k. Only the
public API every commit shares is used (`Engine`, `EngineConfig` with drafter names), so the same file runs on an
old checkout. A run records its commit, argv, machine and time beside the token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from scripts.common import ROOT, utc_now, write_json
from scripts.get_models import model_dir


def _cases(budget: str) -> list[tuple[str, str, str | None, str | None]]:
    """(name, model, draft kind, device_memory) per case: model 'dense' or 'moefied'; draft kind None, 'model',
    'self', 'ngram' or 'suffix'."""
    cases = []
    drafts_of = {"dense": (None, "model", "ngram", "suffix"), "moefied": (None, "self", "ngram", "suffix")}
    for model, drafts in drafts_of.items():
        for memory in (None, budget):
            for draft in drafts:
                if draft == "self" and memory is None:
                    continue  # the self drafter runs offloaded only
                where = "resident" if memory is None else "offloaded"
                cases.append((f"{model}/{where}/{draft or 'none'}", model, draft, memory))
    return cases


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict:
    import torch

    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.prompts import humaneval_prompts
    from specoffload.runtime.sampling import SamplingParams

    dirs = {"dense": model_dir("target"), "moefied": model_dir("target").parent / "qwen2.5-coder-1.5b-moefied",
            "draft": model_dir("draft")}
    prompts = humaneval_prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for name, model, draft, memory in _cases(args.budget):
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        kw: dict = dict(dtype="float32", max_batch_size=args.batch, num_draft_tokens=args.k if draft else 0,
                        max_seq_len=512)
        if draft == "model":
            kw["draft"] = str(dirs["draft"])
        elif draft is not None:
            kw["drafter"] = draft
        if memory is not None:
            kw |= dict(device_memory=memory, replan_interval=0)
        start = time.perf_counter()
        engine = Engine(EngineConfig(str(dirs[model]), **kw))
        outputs[name] = [r.token_ids for r in engine.generate(prompts, params)]
        engine.close()
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"{name}: {seconds[name]} s", file=sys.stderr, flush=True)
    return {"commit": _commit(), "argv": sys.argv, "date": utc_now(), "torch": torch.__version__,
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "dtype": "float32", "seconds": seconds, "outputs": outputs}


def compare(a: Path, b: Path) -> int:
    """0 when every case both files ran has the same token ids (and they ran the same cases)."""
    old, new = (json.loads(p.read_text())["outputs"] for p in (a, b))
    if set(old) != set(new):
        print(f"different cases: {sorted(set(old) ^ set(new))}")
        return 1
    bad = [name for name in old if old[name] != new[name]]
    for name in old:
        print(f"{name}: {'identical' if name not in bad else 'DIFFERENT'}")
    print(f"{len(old) - len(bad)} of {len(old)} cases identical")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "perf" / "scratch" / "core_outputs.json")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    ap.add_argument("--prompts", type=int, default=4, help="the first N HumanEval prompts")
    ap.add_argument("--tokens", type=int, default=12, help="new tokens per prompt")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--budget", default="5GiB", help="device_memory of the offloaded cases")
    ap.add_argument("--only", default=None, help="run the cases whose name contains one of these (comma-separated)")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    write_json(args.out, run(args))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
