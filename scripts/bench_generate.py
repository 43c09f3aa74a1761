#!/usr/bin/env python
"""Benchmark: transformers vs SpecOffload's in-process Engine on the real Qwen2.5-Coder pair.

All systems run in ONE process, alternating A/B within each repetition, on the same HumanEval
prompts with the same number of new tokens (EOS ignored), greedy:

  plain:     transformers `generate`            vs  ours without draft      (batch 1 and B)
  assisted:  transformers assisted generation   vs  ours with draft, k      (batch 1; ours also at B)

for float32 and bfloat16. The machine's roofline (memory bandwidth, matmul throughput) is measured in
the same run. Writes docs/perf/generate.json and the table in docs/perf/README.md.

    python -m scripts.bench_generate            # full run (tens of minutes on 2 cores)
    python -m scripts.bench_generate --quick    # a few minutes
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts.common import PERF, median_spread, utc_now, write_json
from scripts.get_models import model_dir
from scripts.readme_section import write_section
from specoffload.runtime import Engine, EngineConfig, SamplingParams
from specoffload.runtime.models.linear import linear
from specoffload.runtime.prompts import humaneval_prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- roofline --------------------------------------------------------------------------------
def measure_roofline(reps: int = 5) -> dict[str, float]:
    """Memory read bandwidth (GB/s, a 1 GiB fp32 reduction) and matmul throughput (GFLOP/s)."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    x.sum()
    bw = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        bw.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    del x
    out: dict[str, float] = {"mem_read_GBps": statistics.median(bw)}
    # Matmul throughput at a decode-like shape ([rows, 1536] x [1536, 8960]) through the runtime's linear().
    for name, dtype in DTYPES.items():
        w = torch.randn(8960, 1536, dtype=dtype)
        for rows in (1, 16, 80):
            x = torch.randn(rows, 1536, dtype=dtype)
            linear(x, w)
            fl = []
            for _ in range(reps):
                t = time.perf_counter()
                linear(x, w)
                fl.append(2 * rows * w.numel() / (time.perf_counter() - t) / 1e9)
            out[f"matmul_{name}_rows{rows}_GFLOPs"] = statistics.median(fl)
    return out


# ---- systems ---------------------------------------------------------------------------------
class HFRunner:
    def __init__(self, target: Path, draft: Path, dtype: torch.dtype) -> None:
        self.tok = AutoTokenizer.from_pretrained(str(target), padding_side="left")
        self.target = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(str(draft), dtype=dtype).eval()
        # Same semantics as our ignore_eos: never stop at EOS, but do not suppress it either
        # (min_new_tokens would mask EOS logits and change the greedy tokens).
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        for model in (self.target, self.draft):
            model.generation_config.eos_token_id = None

    def run(self, prompts: list[str], batch: int, new_tokens: int, assisted: bool) -> list[list[int]]:
        outs: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            enc = self.tok(chunk, return_tensors="pt", padding=True)
            kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad_id)
            if assisted:
                kwargs["assistant_model"] = self.draft
            with torch.inference_mode():
                gen = self.target.generate(**enc, **kwargs)
            outs.extend(gen[:, enc["input_ids"].shape[1]:].tolist())
        return outs


class OursRunner:
    def __init__(self, target: Path, draft: Path, dtype: str, k: int, max_batch: int) -> None:
        # One engine, one copy of each model's weights; plain decoding runs it with its draft detached.
        self.engine = Engine(EngineConfig(target=target, draft=draft, dtype=dtype, num_draft_tokens=k,
                                          max_batch_size=max_batch))
        self.draft = self.engine.draft

    def run(self, prompts: list[str], batch: int, new_tokens: int, assisted: bool) -> tuple[list[list[int]], float]:
        engine = self.engine
        engine.draft = self.draft if assisted else None
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        outs: list[list[int]] = []
        drafted = accepted = 0
        for i in range(0, len(prompts), batch):
            res = engine.generate(prompts[i : i + batch], params)
            outs.extend(r.token_ids for r in res)
            drafted += sum(r.num_drafted for r in res)
            accepted += sum(r.num_accepted for r in res)
        return outs, (accepted / drafted if drafted else float("nan"))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of rows whose token sequences are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each row's tokens before the first divergence."""
    fr = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fr.append(n / max(len(x), 1))
    return sum(fr) / len(fr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens, repetitions and a smaller batch")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="the large batch size (default 16; quick 4)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", type=Path, default=PERF / "generate.json")
    args = ap.parse_args()
    reps = args.reps or (2 if args.quick else 3)
    big = args.batch or (4 if args.quick else 16)
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    n_single = 2  # prompts run one at a time at batch 1
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    target, draft = model_dir("target"), model_dir("draft")
    prompts = humaneval_prompts(max(big, n_single))
    print(f"torch threads {torch.get_num_threads()}; measuring roofline ...", flush=True)
    roof = measure_roofline()
    print("roofline:", {k: round(v, 1) for k, v in roof.items()}, flush=True)
    rows: list[dict] = []
    for dtype in args.dtypes.split(","):
        print(f"== {dtype}: loading models", flush=True)
        hf = HFRunner(target, draft, DTYPES[dtype])
        ours = OursRunner(target, draft, dtype, args.k, big)
        # (label, batch, assisted, prompts)
        cases = [("plain", 1, False, prompts[:n_single]), ("plain", big, False, prompts[:big]),
                 ("assisted", 1, True, prompts[:n_single]), ("assisted", big, True, prompts[:big])]
        # Warm-up (not timed): ours loads weights lazily on first use; both systems touch every code path once.
        for assisted in (False, True):
            hf.run(prompts[:1], 1, 2, assisted)
            ours.run(prompts[:1], 1, 2, assisted)
        outputs: dict[tuple, list[list[int]]] = {}
        times: dict[tuple, list[float]] = {}
        accept: dict[tuple, float] = {}
        for rep in range(reps):
            for label, batch, assisted, ps in cases:
                # A/B alternation: transformers then ours, same prompts, same batch.
                systems = [("ours", None)] if (assisted and batch > 1) else [("transformers", hf), ("ours", None)]
                for system, _ in systems:
                    key = (system, label, batch)
                    gc.collect()
                    t = time.perf_counter()
                    if system == "transformers":
                        out = hf.run(ps, batch, new_tokens, assisted)
                    else:
                        out, acc = ours.run(ps, batch, new_tokens, assisted)
                        accept[key] = acc
                    dt = time.perf_counter() - t
                    toks = sum(len(o) for o in out)
                    times.setdefault(key, []).append(toks / dt)
                    outputs[key] = out
                    print(f"  rep {rep} {system:12s} {label:8s} batch {batch:2d}: {toks / dt:7.2f} tok/s", flush=True)
        ref1 = outputs[("transformers", "plain", 1)]
        refb = outputs[("transformers", "plain", big)]
        ours_plain = {1: outputs[("ours", "plain", 1)], big: outputs[("ours", "plain", big)]}
        for (system, label, batch), tps in times.items():
            out = outputs[(system, label, batch)]
            ref = ref1 if batch == 1 else refb
            median, low, high = median_spread(tps)
            rows.append({
                "dtype": dtype, "system": system, "mode": label, "batch": batch,
                "k": args.k if label == "assisted" else 0,
                "tokens_per_s_median": median, "tokens_per_s_min": low, "tokens_per_s_max": high, "reps": len(tps),
                "acceptance": accept.get((system, label, batch)),
                "identical_to_transformers_greedy": agreement(out, ref),
                "identical_to_ours_no_draft": agreement(out, ours_plain[batch]),
                "prefix_agreement_with_ours_no_draft": prefix_agreement(out, ours_plain[batch]),
            })
        del hf, ours
        gc.collect()
    result = {
        "benchmark": "bench_generate",
        "date": utc_now(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cores": torch.get_num_threads(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "settings": {"quick": args.quick, "reps": reps, "new_tokens": new_tokens, "big_batch": big,
                     "k": args.k, "prompts": "HumanEval (first N)", "target": target.name, "draft": draft.name},
        "roofline": roof,
        "rows": rows,
    }
    write_json(args.out, result)
    table = render_table(result)
    print(table)
    write_section(args.out.parent / "README.md", args.out.stem, table)


def render_table(result: dict) -> str:
    roof = result["roofline"]
    s = result["settings"]
    lines = [
        f"Run {result['date']} on {result['machine']['processor']} ({result['machine']['cores']} threads), "
        f"torch {result['machine']['torch']}, transformers {result['machine']['transformers']}; "
        f"{s['new_tokens']} new tokens per prompt (EOS ignored), greedy, k={s['k']}, {s['reps']} reps"
        f"{' (quick)' if s['quick'] else ''}.",
        f"Roofline measured in the same run: memory read {roof['mem_read_GBps']:.1f} GB/s; matmul "
        "[rows x 1536] x [1536 x 8960] GFLOP/s at 1 / 16 / 80 rows: fp32 "
        + " / ".join(f"{roof[f'matmul_float32_rows{r}_GFLOPs']:.0f}" for r in (1, 16, 80))
        + ", bf16 "
        + " / ".join(f"{roof[f'matmul_bfloat16_rows{r}_GFLOPs']:.0f}" for r in (1, 16, 80))
        + ".",
        "",
        "| dtype | mode | batch | system | tok/s median | min–max | acceptance "
        "| = transformers greedy | = ours no-draft |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "–"
        lines.append(
            f"| {r['dtype']} | {r['mode']} | {r['batch']} | {r['system']} | {r['tokens_per_s_median']:.2f} | "
            f"{r['tokens_per_s_min']:.2f}–{r['tokens_per_s_max']:.2f} | {acc} | "
            f"{r['identical_to_transformers_greedy']:.2f} | {r['identical_to_ours_no_draft']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
