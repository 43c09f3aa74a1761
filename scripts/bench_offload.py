#!/usr/bin/env python
"""Benchmark: the offloaded target (weights streamed from disk) with and without a draft, vs accelerate.

One process, one memory budget (`--budget`, everything the engine holds counts: resident weights, the draft,
the ring of weight buffers and both KV caches), the real Qwen2.5-Coder pair, HumanEval prompts (cut to
`--prompt-tokens`), greedy, EOS ignored so every system generates the same tokens:

  (1) transformers + accelerate disk offload (device_map with max_memory = the budget; hf_device_map checked;
      the page cache of its offloaded weights is dropped before every forward, as our reads bypass it)
  (2) ours, no draft: layer streaming only (FlexGen style)
  (3) ours, with the draft, two interleaved batches
  (4) ours with a draft that proposes random tokens (same compute; shows the gain comes from accepted tokens)

Ours run at each batch size of their list (each at its own best batch under the same budget; a batch that
does not fit the budget is reported as such). Page cache dropped before every run; our streamed reads use
O_DIRECT. Reports tok/s (median, min-max over reps), the batch, bytes read per generated token, overlap
efficiency (max resource busy / wall) and the per-resource breakdown of the best (3) run, and saves a Chrome
trace of one of its steps. Writes docs/perf/offload.json and a section of docs/perf/README.md.

    python -m scripts.bench_offload            # ~30-40 minutes on 2 cores
    python -m scripts.bench_offload --quick    # a few minutes
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from scripts.common import PERF, drop_caches, median_spread, utc_now, write_json
from scripts.get_models import model_dir
from scripts.readme_section import write_section
from specoffload.planner.placement import PlacementError
from specoffload.planner.units import format_bytes, parse_bytes
from specoffload.runtime import EngineConfig, SamplingParams
from specoffload.runtime.engine import Engine
from specoffload.runtime.offload.direct_io import AlignedBuffer, DirectReader
from specoffload.runtime.offload.drafters.model import ModelDrafter
from specoffload.runtime.offload.workers import local_workers
from specoffload.runtime.prompts import humaneval_prompts


def roofline(checkpoint: Path) -> dict[str, float]:
    """Cold O_DIRECT read bandwidth of the checkpoint file and fp32 matmul throughput at decode-like shapes."""
    drop_caches()
    file = next(checkpoint.glob("*.safetensors"))
    reader, buf = DirectReader(), AlignedBuffer(64 << 20)
    size = min(file.stat().st_size, 1 << 30)
    t = time.perf_counter()
    for offset in range(0, size - (64 << 20), 64 << 20):
        reader.read_into(str(file), offset, 64 << 20, buf)
    disk = reader.bytes_read / (time.perf_counter() - t) / 1e9
    reader.close()
    out = {"disk_read_GBps": disk}
    w = torch.randn(8960, 1536)
    for rows in (16, 64, 256):
        x = torch.randn(rows, 1536)
        (w @ x.T).sum()
        t = time.perf_counter()
        for _ in range(5):
            w @ x.T
        out[f"matmul_fp32_{rows}rows_GFLOPs"] = 2 * w.numel() * rows * 5 / (time.perf_counter() - t) / 1e9
    return out


class RandomDrafter(ModelDrafter):
    """Runs the real draft model (same compute, same KV) but proposes uniformly random tokens: attribution of the
    speed-up to accepted tokens rather than to the draft's compute (greedy; sampled, its probs are uniform)."""

    def __init__(self, config: EngineConfig, weights=None, slots=None) -> None:  # noqa: ANN001
        super().__init__(config, weights, slots)
        self.rand = torch.Generator().manual_seed(0)

    def propose(self, batch, ids, num_new, params, seeds=None):  # noqa: ANN001, ANN201
        token, probs = super().propose(batch, ids, num_new, params, seeds)
        rand = torch.randint(0, self.model.config.vocab_size, token.shape, generator=self.rand)
        return rand, None if probs is None else torch.full_like(probs, 1.0 / probs.shape[-1])


RANDOM_DRAFT_WORKERS = functools.partial(local_workers, drafter=RandomDrafter)


def run_ours(label: str, config: EngineConfig, prompts: list[list[int]], params: SamplingParams,
             reps: int, workers=None) -> dict:  # noqa: ANN001 - a WorkerFactory
    try:
        engine = Engine(config, workers=workers)
    except PlacementError as exc:
        print(f"  {label} batch {config.max_batch_size}: does not fit: {exc}", flush=True)
        return {"system": label, "batch": config.max_batch_size, "fits": False, "error": str(exc)}
    runs, tokens = [], None
    for _ in range(reps):
        drop_caches()
        results = engine.generate(prompts, params)
        s = engine.last_stats
        table = engine.tracer.breakdown()
        runs.append({
            "tok_s": s.tokens_per_s, "wall_s": s.wall_s, "generated": s.generated_tokens, "passes": s.passes,
            "bytes_read": s.bytes_read, "acceptance": s.acceptance_rate if s.num_drafted else None,
            "overlap_efficiency": table.overlap_efficiency, "breakdown": table.to_dict(),
        })
        tokens = [r.token_ids for r in results]
        print(f"  {label} batch {config.max_batch_size}: {s.tokens_per_s:.2f} tok/s, {s.passes} passes, "
              f"acceptance {runs[-1]['acceptance']}, efficiency {table.overlap_efficiency:.2f}", flush=True)
    median, low, high = median_spread(r["tok_s"] for r in runs)
    row = {
        "system": label, "batch": config.max_batch_size, "fits": True, "runs": runs, "tokens": tokens,
        "tok_s_median": median, "tok_s_min": low, "tok_s_max": high,
        "bytes_per_token": statistics.median(r["bytes_read"] / r["generated"] for r in runs),
        "overlap_efficiency": statistics.median(r["overlap_efficiency"] for r in runs),
        "acceptance": runs[-1]["acceptance"], "placement": engine.placement.to_dict(),
        "placement_table": engine.describe_placement(),
    }
    if label.startswith("(3)"):
        spans = engine.tracer.spans
        steps = sorted({s.args.get("step") for s in spans if "step" in s.args})
        mid = steps[len(steps) // 2]
        step_spans = [s for s in spans if s.args.get("step") == mid]
        window = (min(s.start for s in step_spans), max(s.end for s in step_spans))
        row["trace_window_step"] = mid
        row["_tracer"], row["_window"] = engine.tracer, window
    engine.close()
    del engine
    gc.collect()
    return row


def run_hf(target: Path, budget: int, prompts: list[list[int]], new_tokens: int, batches: list[int]) -> list[dict]:
    """accelerate disk offload at each batch (one batch of prompts each), every step reading from disk."""
    from scripts.hf_disk_offload import generate_hf, load_hf_disk_offload

    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-offload-") as folder:
        drop_caches()
        model = load_hf_disk_offload(target, budget, folder, torch.float32)
        for batch in batches:
            rows.append(_hf_row(generate_hf(model, prompts[:batch], new_tokens, batch, pad_token_id=0,
                                            cold_every_step=True), new_tokens))
        del model
        gc.collect()
    return rows


def _hf_row(run, new_tokens: int) -> dict:  # noqa: ANN001
    batch = run.batch_size
    print(f"  (1) accelerate batch {batch}: {run.tokens_per_second:.3f} tok/s, map {run.device_map_summary}",
          flush=True)
    return {
        "system": "(1) transformers+accelerate disk offload", "batch": batch, "fits": True,
        "tok_s_median": run.tokens_per_second, "tok_s_min": run.tokens_per_second,
        "tok_s_max": run.tokens_per_second, "tokens": run.tokens, "device_map": run.device_map_summary,
        "disk_bytes": run.disk_bytes, "bytes_per_token": run.disk_bytes * (new_tokens + 1) / run.generated_tokens,
        "seconds": run.seconds, "overlap_efficiency": None, "acceptance": None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="4.5GiB")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--plain-batches", default="16,32")
    ap.add_argument("--draft-batches", default="8,16")
    ap.add_argument("--hf-batches", default="8,32,64")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 8 tokens, 1 rep, one batch each")
    ap.add_argument("--out", default="offload")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.reps = 8, 8, 1
        args.plain_batches, args.draft_batches, args.hf_batches = "8", "4", "4"
    budget = parse_bytes(args.budget)
    target, draft = model_dir("target"), model_dir("draft")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok.encode(p)[: args.prompt_tokens] for p in humaneval_prompts(args.prompts)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    print(f"budget {format_bytes(budget)}, {len(prompts)} prompts x {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, k={args.k}, {args.reps} reps", flush=True)
    roof = roofline(target)
    print(f"roofline: {roof}", flush=True)
    rows = []
    if not args.skip_hf:
        rows += run_hf(target, budget, prompts, args.new_tokens, [int(b) for b in args.hf_batches.split(",")])
    common = dict(target=target, max_seq_len=args.prompt_tokens + args.new_tokens, device_memory=budget,
                  num_draft_tokens=args.k, trace=True)
    for b in map(int, args.plain_batches.split(",")):
        rows.append(run_ours("(2) ours, no draft", EngineConfig(**common, max_batch_size=b),
                             prompts, params, args.reps))
    for b in map(int, args.draft_batches.split(",")):
        rows.append(run_ours("(3) ours, draft", EngineConfig(**common, draft=draft, max_batch_size=b), prompts,
                             params, args.reps))
    fitting3 = [r for r in rows if r["system"].startswith("(3)") and r["fits"]]
    if fitting3:
        b3 = max(fitting3, key=lambda r: r["tok_s_median"])["batch"]
        rows.append(run_ours("(4) ours, random draft", EngineConfig(**common, draft=draft, max_batch_size=b3),
                             prompts, params, args.reps, workers=RANDOM_DRAFT_WORKERS))
    report(args, budget, roof, rows)
    return 0


def best(rows: list[dict], prefix: str) -> dict | None:
    fitting = [r for r in rows if r["system"].startswith(prefix) and r["fits"]]
    return max(fitting, key=lambda r: r["tok_s_median"]) if fitting else None


def report(args: argparse.Namespace, budget: int, roof: dict, rows: list[dict]) -> None:
    reference = best(rows, "(2)")
    ref_tokens = reference["tokens"] if reference else None
    for r in rows:
        if r.get("tokens") is not None and ref_tokens is not None:
            n = len(r["tokens"])
            r["equal_to_ours_no_draft"] = r["tokens"] == ref_tokens[:n]
    b1, b2, b3, b4 = (best(rows, p) for p in ("(1)", "(2)", "(3)", "(4)"))
    ratios = {}
    if b2 and b3:
        ratios["(3)/(2)"] = b3["tok_s_median"] / b2["tok_s_median"]
    if b1 and b3:
        ratios["(3)/(1)"] = b3["tok_s_median"] / b1["tok_s_median"]
    if b2 and b4:
        ratios["(4)/(2)"] = b4["tok_s_median"] / b2["tok_s_median"]
    meta = {
        "date": utc_now(), "machine": platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "budget_bytes": budget,
        "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "k": args.k,
        "reps": args.reps, "quick": args.quick, "roofline": roof,
    }
    trace_note = ""
    if b3 and "_tracer" in b3:
        trace_path = PERF / f"{args.out}_trace.json"
        b3["_tracer"].save_chrome_trace(trace_path, window=b3["_window"])
        step_table = b3["_tracer"].breakdown(window=b3["_window"]).table()
        trace_note = f"Trace of step {b3['trace_window_step']} of the best (3) run: `{trace_path.name}` (Perfetto)."
    clean = [{k: v for k, v in r.items() if not k.startswith("_") and k != "tokens"} for r in rows]
    write_json(PERF / f"{args.out}.json", {"meta": meta, "ratios": ratios, "rows": clean})
    lines = [
        f"Run {meta['date']} on {meta['machine']} ({meta['threads']} threads), torch {meta['torch']}; budget "
        f"{format_bytes(budget)} for everything the engine holds; {args.prompts} HumanEval prompts cut to "
        f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens (EOS ignored), greedy, k={args.k}, "
        f"{args.reps} reps{' (--quick)' if args.quick else ''}.",
        "",
        f"Roofline measured in the same run: cold O_DIRECT disk read {roof['disk_read_GBps']:.2f} GB/s; fp32 matmul "
        + ", ".join(f"{v:.0f} GFLOP/s at {k.split('_')[2]}" for k, v in roof.items() if k.startswith("matmul")) + ".",
        "",
        "| system | batch | tok/s median | min–max | bytes read / token | overlap eff. | acceptance "
        "| = ours no-draft |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['system']} | {r['batch']} | does not fit | | | | | |")
            continue
        eff = f"{r['overlap_efficiency']:.2f}" if r.get("overlap_efficiency") is not None else "–"
        acc = f"{r['acceptance']:.2f}" if r.get("acceptance") is not None else "–"
        eq = {True: "yes", False: "NO"}.get(r.get("equal_to_ours_no_draft"), "–")
        lines.append(
            f"| {r['system']} | {r['batch']} | {r['tok_s_median']:.3f} | {r['tok_s_min']:.3f}–{r['tok_s_max']:.3f} | "
            f"{format_bytes(int(r['bytes_per_token']))} | {eff} | {acc} | {eq} |"
        )
    lines += ["", "Ratios of the best rows: " + ", ".join(f"{k} = {v:.2f}" for k, v in ratios.items()) + "."]
    if b1:
        lines += ["", f"(1) device map: {b1['device_map']} (disk bytes {format_bytes(b1['disk_bytes'])})."]
    if b3:
        lines += ["", "Placement of the best (3) run:", "", "```", b3["placement_table"], "```"]
    if trace_note:
        lines += ["", trace_note, "", step_table]
    section = "\n".join(lines)
    write_section(PERF / "README.md", args.out, section, heading=f"{args.out} (`scripts/bench_offload.py`)")
    print(section)


if __name__ == "__main__":
    sys.exit(main())
