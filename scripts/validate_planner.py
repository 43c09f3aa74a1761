#!/usr/bin/env python
"""Validate the planner against a measured grid: does its pick land near the best measured policy?

Two settings on the real Qwen2.5-Coder pair, the same job (HumanEval prompts cut to --prompt-tokens, greedy,
EOS ignored):
  disk:  the target streams from disk under --budget (everything the engine holds counts);
  ram:   a budget large enough that everything is resident (on this 2-core CPU the target is then
         compute-bound, and speculation may not pay: the planner must then choose little or none).
For each setting: measure the hardware profile (runtime/offload/profiler.py), measure the acceptance rate
on a warm-up, predict every (batch, k) of the grid with the planner's cost model, run every grid policy,
and report the pick's measured throughput / the grid's best (goal >= 0.9) and the median |predicted -
measured| / measured (goal <= 20%). Writes docs/perf/planner_validation.json, a plot of predicted vs measured
(docs/perf/planner_validation.png) and a section of docs/perf/README.md.

    python -m scripts.validate_planner            # ~20 minutes on 2 cores
    python -m scripts.validate_planner --quick    # a smaller grid
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from scripts.common import PERF, utc_now, write_json
from scripts.get_models import model_dir
from scripts.readme_section import write_section
from specoffload.planner import Workload, estimate_workload, search
from specoffload.planner.cost import ModelCosts
from specoffload.planner.placement import PlacementError, PlacementPolicy, place
from specoffload.planner.units import format_bytes, machine_memory_bytes, parse_bytes
from specoffload.runtime import EngineConfig, SamplingParams
from specoffload.runtime.engine import Engine
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.offload.profiler import load_or_measure
from specoffload.runtime.prompts import humaneval_prompts


def measure_alpha(base: EngineConfig, prompts: list[list[int]], new_tokens: int) -> float:
    """Per-position acceptance on a short warm-up over the job's first prompts (k = 4)."""
    engine = Engine(replace(base, max_batch_size=2, num_draft_tokens=4))
    engine.generate(prompts[:4], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    estimate = engine.replanner.tracker.estimate()
    engine.close()
    del engine
    gc.collect()
    return estimate.alpha if estimate is not None else 0.7


def run_setting(name: str, budget: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    target, draft = model_dir("target"), model_dir("draft")
    context = args.prompt_tokens + args.new_tokens
    base = EngineConfig(target=target, draft=draft, device_memory=budget, max_seq_len=context, trace=False)
    profile = load_or_measure(base, log=lambda m: print(f"[{name}] {m}", flush=True))
    alpha = measure_alpha(base, prompts, args.new_tokens)
    print(f"[{name}] budget {format_bytes(budget)}; measured alpha {alpha:.3f}", flush=True)
    t_shape = Transformer(target).loader.shape("target")  # shapes only: nothing is loaded
    d_shape = Transformer(draft).loader.shape("draft")
    workload = Workload(num_prompts=len(prompts), prompt_len=statistics.mean(map(len, prompts)),
                        new_tokens=args.new_tokens)
    costs = ModelCosts.from_shapes(t_shape, d_shape, dtype_bytes=4)
    grid = [(b, k) for b in args.batches for k in args.ks]
    host = machine_memory_bytes()
    rows = []
    for batch, k in grid:
        policy = PlacementPolicy(batch_size=batch, num_batches=2 if k else 1, context=context + k + 1,
                                 num_buffers=2, weights_tier="disk", unified_memory=True)
        try:
            placement = place(t_shape, d_shape if k else None, policy, budget, host)
        except PlacementError:
            rows.append({"batch": batch, "k": k, "fits": False})
            continue
        cost_k = costs if k else ModelCosts.from_shapes(t_shape, None, dtype_bytes=4)
        predicted = estimate_workload(profile, cost_k, placement, batch, k, alpha, workload).tokens_per_s
        config = replace(base, max_batch_size=batch, num_draft_tokens=k)
        engine = Engine(config)
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
        wall = time.perf_counter() - t
        measured = engine.last_stats.generated_tokens / wall
        engine.close()
        del engine
        gc.collect()
        err = abs(predicted - measured) / measured
        print(f"[{name}] batch {batch:3d} k {k}: predicted {predicted:7.2f}  measured {measured:7.2f} tok/s "
              f"(error {100 * err:.0f}%)", flush=True)
        rows.append({"batch": batch, "k": k, "fits": True, "predicted": predicted, "measured": measured,
                     "rel_error": err})
    result = search(profile, t_shape, d_shape, workload, alpha, budget, host, batches=args.batches, ks=args.ks,
                    context=context, dtype_bytes=4, weights_tier="disk", unified_memory=True)
    pick = (result.best.decode_batch, result.best.k)
    measured = [r for r in rows if r["fits"]]
    best = max(measured, key=lambda r: r["measured"])
    pick_row = next(r for r in measured if (r["batch"], r["k"]) == pick)
    summary = {
        "setting": name, "budget": budget, "alpha": alpha, "profile": profile.to_json(), "grid": rows,
        "pick": {"batch": pick[0], "k": pick[1], "predicted": result.best.predicted_tokens_per_s,
                 "measured": pick_row["measured"]},
        "grid_best": {"batch": best["batch"], "k": best["k"], "measured": best["measured"]},
        "pick_over_best": pick_row["measured"] / best["measured"],
        "median_rel_error": statistics.median(r["rel_error"] for r in measured),
    }
    print(f"[{name}] pick {pick} measured {pick_row['measured']:.2f} / best {best['measured']:.2f} "
          f"({best['batch']}, {best['k']}) = {summary['pick_over_best']:.2f}; median error "
          f"{100 * summary['median_rel_error']:.0f}%", flush=True)
    return summary


def plot(settings: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 5))
    hi = 0.0
    for s, marker in zip(settings, "os"):
        pts = [r for r in s["grid"] if r["fits"]]
        xs, ys = [r["predicted"] for r in pts], [r["measured"] for r in pts]
        hi = max(hi, *xs, *ys)
        ax.scatter(xs, ys, marker=marker, label=f"{s['setting']} (alpha {s['alpha']:.2f})")
        for r in pts:
            ax.annotate(f"b{r['batch']}k{r['k']}", (r["predicted"], r["measured"]), fontsize=6)
        ax.scatter([s["pick"]["predicted"]], [s["pick"]["measured"]], marker="*", s=160, color="k")
    ax.plot([0, hi * 1.05], [0, hi * 1.05], "k--", linewidth=0.8, label="predicted = measured")
    ax.set_xlabel("predicted tokens/s")
    ax.set_ylabel("measured tokens/s")
    ax.set_title("Planner: predicted vs measured (star = planner's pick)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--disk-budget", default="4.5GiB")
    ap.add_argument("--ram-budget", default="14GiB")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--batches", default="4,8,16")
    ap.add_argument("--ks", default="0,1,2,4")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--settings", default="disk,ram")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.batches, args.ks = 8, 6, "4,8", "0,2"
    args.batches = tuple(int(b) for b in args.batches.split(","))
    args.ks = tuple(int(k) for k in args.ks.split(","))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir("target"))
    prompts = [tok.encode(p)[: args.prompt_tokens] for p in humaneval_prompts(args.prompts)]
    budgets = {"disk": parse_bytes(args.disk_budget), "ram": parse_bytes(args.ram_budget)}
    settings = [run_setting(name, budgets[name], args, prompts) for name in args.settings.split(",")]
    meta = {"date": utc_now(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "batches": args.batches, "ks": args.ks, "quick": args.quick}
    write_json(PERF / "planner_validation.json", {"meta": meta, "settings": settings})
    has_plot = plot(settings, PERF / "planner_validation.png")
    lines = [f"Run {meta['date']}, torch {meta['torch']} ({meta['threads']} threads); {args.prompts} HumanEval "
             f"prompts cut to {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy; grid batch "
             f"{list(args.batches)} x k {list(args.ks)} (k = 0: no draft, one batch; k >= 1: two batches)."]
    for s in settings:
        lines += ["", f"**{s['setting']}** (budget {format_bytes(s['budget'])}, measured alpha {s['alpha']:.3f}): "
                  f"pick (batch {s['pick']['batch']}, k {s['pick']['k']}) measured {s['pick']['measured']:.2f} "
                  f"tok/s; grid best (batch {s['grid_best']['batch']}, k {s['grid_best']['k']}) "
                  f"{s['grid_best']['measured']:.2f} tok/s; **pick / best = {s['pick_over_best']:.2f}** (goal >= "
                  f"0.9); **median |predicted - measured| / measured = {100 * s['median_rel_error']:.0f}%** (goal "
                  "<= 20%).", "", "| batch | k | predicted tok/s | measured tok/s | error |",
                  "|---:|---:|---:|---:|---:|"]
        for r in s["grid"]:
            if r["fits"]:
                lines.append(f"| {r['batch']} | {r['k']} | {r['predicted']:.2f} | {r['measured']:.2f} | "
                             f"{100 * r['rel_error']:.0f}% |")
            else:
                lines.append(f"| {r['batch']} | {r['k']} | does not fit | | |")
    if has_plot:
        lines += ["", "![predicted vs measured](planner_validation.png)"]
    section = "\n".join(lines)
    write_section(PERF / "README.md", "planner_validation", section,
                  heading="planner validation (`scripts/validate_planner.py`)")
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
