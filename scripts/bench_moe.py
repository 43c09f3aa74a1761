"""Benchmark: a streamed MoE target under one memory budget, with and without speculation (issues 10 and 11).

Targets are built from the real dense Qwen2.5-Coder-1.5B by `python -m scripts.make_moe` (upcycled: 8 copies of
the dense FFN per layer, outputs equal to the dense model's; moefied: experts that genuinely differ). The target
streams from disk with direct I/O; one budget bounds everything the engine holds (resident parts, the ring, the
drafter and both KV caches). HumanEval prompts (cut to --prompt-tokens), greedy, EOS ignored. Systems:

  (1) transformers + accelerate disk offload of the same checkpoint (page cache dropped before every forward)
  (2) ours, no draft (layer streaming only)
  (3) ours, the 0.5B draft model (two interleaved batches)
  (4) ours, a draft that proposes random tokens (same compute: attribution)
  (5) ours, the target drafting for itself with its resident experts (--resident-experts; draft="self")

Each of ours runs at each batch of its list (its best batch is reported; a batch that does not fit the budget is
said so). The KV caches are sized for --max-seq-len tokens per row (the job's row length) while the run
generates --new-tokens: the rate reported is the **steady-state decode rate** over the passes after each batch's
prefill pass and before its last pass (`Pipeline.verify_log`), with prefill reported separately; per pass it
also reports bytes read, io busy and compute busy time (from the trace, over the same window), so the regime
(I/O-bound or not) is shown, not assumed. The planner's pick at each budget (its search over the same grid, from
the measured profile and the measured acceptance) is compared with the measured best.

    python -m scripts.bench_moe --quick                        # one budget, one batch each, no accelerate
    python -m scripts.bench_moe                                # the issue-10 run (several hours on 2 cores)
    python -m scripts.bench_moe --target moefied --systems 2,3,5 --out moe_self   # the issue-11 run

Writes docs/perf/<out>.json (a top-level "summary") and a section of docs/perf/README.md (and a plot).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from scripts.common import PERF, drop_caches, figure, utc_now, write_json
from scripts.get_models import default_cache, model_dir
from scripts.readme_section import write_section
from specoffload.planner import estimate_step
from specoffload.planner.placement import PlacementError
from specoffload.planner.units import format_bytes, parse_bytes
from specoffload.runtime import EngineConfig, SamplingParams
from specoffload.runtime.engine import Engine
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.offload.profiler import load_or_measure
from specoffload.runtime.planning import ModelPair, make_plan, place_plan
from specoffload.runtime.prompts import humaneval_prompts

SYSTEMS = {
    1: "(1) transformers+accelerate disk offload",
    2: "(2) ours, no draft",
    3: "(3) ours, 0.5B draft",
    4: "(4) ours, random draft",
    5: "(5) ours, self-draft (resident experts)",
}
TARGETS = {"upcycled": "qwen2.5-coder-1.5b-upcycled-8x", "moefied": "qwen2.5-coder-1.5b-moefied"}


def target_dir(name: str) -> Path:
    if name in TARGETS:
        return default_cache() / TARGETS[name]
    return Path(name).expanduser()


def steady_window(log: list[tuple[float, int, int, int]], num_batches: int) -> tuple[float, float, int, int] | None:
    """(start, end, tokens, passes) of the steady decode window of a run's verify log: after each batch's first
    (prefill) pass and before each batch's last pass (its rows may stop drafting near their budget)."""
    firsts = {}
    lasts = {}
    for i, (_, batch, _, _) in enumerate(log):
        firsts.setdefault(batch, i)
        lasts[batch] = i
    start = max(firsts.values())  # the window opens when every batch has had its prefill pass
    end = min(lasts.values())
    if end - start < 2:
        return None
    window = log[start + 1 : end + 1]
    return log[start][0], log[end][0], sum(entry[2] for entry in window), len(window)


def run_ours(label: str, config: EngineConfig, prompts: list[list[int]], params: SamplingParams, workers=None,  # noqa: ANN001
             reps: int = 1) -> dict:
    row: dict = {"system": label, "batch": config.max_batch_size, "k": config.num_draft_tokens}
    try:
        engine = Engine(config, workers=workers)
    except PlacementError as exc:
        print(f"  {label} batch {config.max_batch_size}: does not fit ({str(exc)[:120]})", flush=True)
        return row | {"fits": False, "error": str(exc)}
    rows_needed = config.max_batch_size * engine.plan.num_batches
    placement = engine.placement
    kv_item = next(i for i in placement.items if i.name == "target KV cache")
    row |= {"fits": True, "rows": rows_needed, "kv_bytes_per_row": kv_item.nbytes // rows_needed,
            "placement_table": engine.describe_placement(), "device_bytes": placement.device_bytes(),
            "streamed_layers": len(placement.streamed_layers), "selected_experts": engine.weight_plan.selected_experts}
    runs = []
    tokens = None
    for _ in range(reps):
        drop_caches()
        start = time.perf_counter()
        results = engine.generate(prompts[:rows_needed], params)
        stats = engine.last_stats
        window = steady_window(list(engine.pipeline.verify_log), engine.plan.num_batches)
        run = {"wall_s": stats.wall_s, "passes": stats.passes, "generated": stats.generated_tokens,
               "bytes_per_pass": stats.bytes_read / max(stats.passes, 1),
               "acceptance": stats.acceptance_rate if stats.num_drafted else None,
               "expert_hit_rate": stats.expert_hit_rate, "migrated_bytes": stats.migrated_bytes}
        if window is not None:
            lo, hi, tok, passes = window
            table = engine.tracer.breakdown(window=(lo, hi))
            busy = {u.resource: u.busy for u in table.resources}
            run |= {"steady_tok_s": tok / (hi - lo), "steady_passes": passes, "s_per_pass": (hi - lo) / passes,
                    "tokens_per_pass": tok / passes, "io_s_per_pass": busy.get("io", 0.0) / passes,
                    "cpu_s_per_pass": busy.get("cpu", 0.0) / passes, "device_s_per_pass": busy.get("device", 0.0)
                    / passes, "overlap_efficiency": table.overlap_efficiency,
                    "prefill_s": lo - start}  # start of generate .. every batch's prefill pass verified
        runs.append(run)
        tokens = [r.token_ids for r in results]
        print(f"  {label} batch {config.max_batch_size}: steady {run.get('steady_tok_s', float('nan')):.3f} tok/s, "
              f"{run.get('s_per_pass', float('nan')):.1f} s/pass (io {run.get('io_s_per_pass', float('nan')):.1f}, "
              f"device {run.get('device_s_per_pass', float('nan')):.1f}), acceptance {run['acceptance']}", flush=True)
    engine.close()
    del engine
    gc.collect()
    rates = [r["steady_tok_s"] for r in runs if "steady_tok_s" in r]
    median = statistics.median(rates) if rates else None
    return row | {"runs": runs, "tokens": tokens, "tok_s_median": median,
                  "tok_s_min": min(rates, default=None), "tok_s_max": max(rates, default=None),
                  **{key: statistics.median(r[key] for r in runs if r.get(key) is not None)
                     for key in ("s_per_pass", "tokens_per_pass", "io_s_per_pass", "cpu_s_per_pass",
                                 "device_s_per_pass", "bytes_per_pass", "overlap_efficiency", "prefill_s")
                     if any(r.get(key) is not None for r in runs)},
                  "acceptance": runs[-1]["acceptance"], "expert_hit_rate": runs[-1]["expert_hit_rate"],
                  "migrated_bytes": runs[-1]["migrated_bytes"]}


def run_hf(target: Path, budget: int, prompts: list[list[int]], new_tokens: int, batches: list[int]) -> list[dict]:
    """accelerate disk offload at each batch, every forward reading its disk weights cold (see hf_disk_offload)."""
    from scripts.hf_disk_offload import generate_hf, load_hf_disk_offload

    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-offload-", dir=str(default_cache())) as folder:
        drop_caches()
        model = load_hf_disk_offload(target, budget, folder, torch.float32)
        for batch in batches:
            run = generate_hf(model, prompts[:batch], new_tokens, batch, pad_token_id=0, cold_every_step=True)
            rate = run.tokens_per_second
            print(f"  (1) accelerate batch {batch}: {rate:.3f} tok/s (whole generate, prefill included), map "
                  f"{run.device_map_summary}", flush=True)
            rows.append({"system": SYSTEMS[1], "batch": batch, "fits": True, "tok_s_median": rate, "tok_s_min": rate,
                         "tok_s_max": rate, "tokens": run.tokens, "device_map": run.device_map_summary,
                         "disk_bytes": run.disk_bytes, "seconds": run.seconds})
        del model
        gc.collect()
    return rows


def dense_reference(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the dense 1.5B target, every weight resident (float32): what the upcycled model equals."""
    engine = Engine(EngineConfig(model_dir("target"), max_batch_size=16))
    out = [r.token_ids for r in engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens,
                                                                        ignore_eos=True))]
    del engine
    gc.collect()
    return out


def planner_pick(base: EngineConfig, budget: int, alpha: float, grid: list[tuple[int, int]], attended_len: int) -> dict:
    """The planner's choice over the measured grid at this budget: its predicted steady decode rate of every
    (batch, k) that places, from the measured profile and the acceptance measured in this run; the pick is the
    argmax (as `planner.search` ranks, over the same candidates)."""
    config = replace(base, device_memory=budget)
    target = Transformer(config.target, dtype=config.torch_dtype)
    draft = Transformer(config.draft, dtype=config.torch_dtype) if config.drafter_class.needs_checkpoint else None
    models = ModelPair.of(target, draft)
    profile = load_or_measure(config, log=lambda m: print(f"  [profile] {m}", flush=True), open_engine=Engine)
    predictions: dict[str, float] = {}
    what_if: dict[str, dict[str, float]] = {}  # acceptance -> (batch, k) -> predicted tok/s: what would pay
    for batch, k in grid:
        fixed = replace(config, max_batch_size=batch, num_draft_tokens=k)
        pair = models if k else ModelPair.of(target, None)
        try:
            placement = place_plan(fixed, make_plan(fixed, pair, base.max_seq_len), pair)
        except PlacementError:
            continue
        for a in (alpha, 0.75, 0.9, 0.95):
            step = estimate_step(profile, pair.costs(k > 0), placement, batch, k, a, attended_len,
                                 config.expert_loading, config.interleave is not False)
            what_if.setdefault(f"{a:.3f}", {})[f"{batch},{k}"] = step.tokens_per_s
        predictions[f"{batch},{k}"] = what_if[f"{alpha:.3f}"][f"{batch},{k}"]
    pick = max(predictions, key=predictions.get) if predictions else None
    ratio = {}
    for a, rates in what_if.items():
        spec = [v for key, v in rates.items() if not key.endswith(",0")]
        plain = [v for key, v in rates.items() if key.endswith(",0")]
        if spec and plain:
            ratio[a] = max(spec) / max(plain)
    return {"pick": [int(x) for x in pick.split(",")] if pick else None, "predictions": predictions,
            "predicted_draft_over_nodraft_at_alpha": ratio}


def best(rows: list[dict], label: str) -> dict | None:
    fitting = [r for r in rows if r["system"] == label and r.get("fits") and r.get("tok_s_median")]
    return max(fitting, key=lambda r: r["tok_s_median"]) if fitting else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="upcycled", help="upcycled | moefied | a checkpoint directory")
    ap.add_argument("--budgets", default="6GiB,8GiB,12GiB")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="tokens per row the KV caches are sized for")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--systems", default="1,2,3,4")
    ap.add_argument("--batches-nodraft", default="16,32,64")
    ap.add_argument("--batches-draft", default="8,16,32")
    ap.add_argument("--hf-batches", default="16,64")
    ap.add_argument("--resident-experts", default="4", help="(5): experts per layer the self-drafter keeps, list")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--expert-group", type=int, default=None, help="experts per ring slot (default: whole layers)")
    ap.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16"], help="(3), (4): the draft's")
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--interleave", default="off", choices=["on", "off"],
                    help="drafting systems: two alternating batches (on) or one drafting between its passes (off)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one budget, one batch each, 8 new tokens, no (1)")
    ap.add_argument("--no-planner", action="store_true",
                    help="skip the planner's pick (it measures a hardware profile for a new target: minutes)")
    ap.add_argument("--out", default="moe")
    args = ap.parse_args()
    if args.quick:
        args.budgets, args.new_tokens = args.budgets.split(",")[0], 8
        args.batches_nodraft, args.batches_draft = args.batches_nodraft.split(",")[0], args.batches_draft.split(",")[0]
        args.systems = ",".join(s for s in args.systems.split(",") if s != "1")
    systems = [int(s) for s in args.systems.split(",")]
    target = target_dir(args.target)
    if not (target / "config.json").exists():
        raise SystemExit(f"no MoE checkpoint at {target}: build it with `python -m scripts.make_moe` first")
    draft = model_dir("draft")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    needed = 2 * max(int(b) for b in args.batches_draft.split(","))
    needed = max(needed, max(int(b) for b in args.batches_nodraft.split(",")))
    prompts = [tok.encode(p)[: args.prompt_tokens] for p in humaneval_prompts()][:needed]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    started = time.time()
    print(f"target {target.name}, {len(prompts)} prompts x {args.prompt_tokens} tokens, {args.new_tokens} new, KV "
          f"sized for {args.max_seq_len} tokens per row, k={args.k}, dtype {args.dtype}", flush=True)
    reference = dense_reference(prompts[:8], args.new_tokens) if args.target == "upcycled" else None
    base = EngineConfig(target, device_memory="1GiB", max_seq_len=args.max_seq_len, num_draft_tokens=args.k,
                        dtype=args.dtype, trace=True, expert_loading="auto", expert_group=args.expert_group,
                        num_buffers=args.num_buffers, interleave=args.interleave == "on", draft_dtype=args.draft_dtype)
    from scripts.bench_offload import roofline

    roof = roofline(target)
    print(f"roofline: {roof}", flush=True)
    from scripts.bench_offload import RANDOM_DRAFT_WORKERS

    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    results = []
    for budget in budgets:
        print(f"budget {format_bytes(budget)}", flush=True)
        rows: list[dict] = []
        if 1 in systems and budget == budgets[0]:  # the baseline at the first (memory-bound) budget
            rows += run_hf(target, budget, prompts, args.new_tokens, [int(b) for b in args.hf_batches.split(",")])
        for b in map(int, args.batches_nodraft.split(",")):
            if 2 in systems:
                rows.append(run_ours(SYSTEMS[2], replace(base, device_memory=budget, max_batch_size=b,
                                                         num_draft_tokens=0), prompts, params, reps=args.reps))
        for b in map(int, args.batches_draft.split(",")):
            if 3 in systems:
                rows.append(run_ours(SYSTEMS[3], replace(base, device_memory=budget, max_batch_size=b, draft=draft),
                                     prompts, params, reps=args.reps))
            for n in map(int, args.resident_experts.split(",")) if 5 in systems else ():
                self_draft = replace(base, device_memory=budget, max_batch_size=b, draft="self",
                                     drafter_options={"resident_experts": n})
                rows.append(run_ours(SYSTEMS[5], self_draft, prompts, params, reps=args.reps)
                            | {"resident_experts": n})
        best3 = best(rows, SYSTEMS[3])
        if 4 in systems and best3 is not None:
            rows.append(run_ours(SYSTEMS[4], replace(base, device_memory=budget, max_batch_size=best3["batch"],
                                                     draft=draft), prompts, params, RANDOM_DRAFT_WORKERS, args.reps))
        pick = None
        alpha = best3["acceptance"] if best3 is not None else None
        if alpha is not None and not args.no_planner:
            grid = [(b, 0) for b in map(int, args.batches_nodraft.split(","))]
            grid += [(b, args.k) for b in map(int, args.batches_draft.split(","))]
            pick = planner_pick(replace(base, draft=draft), budget, alpha, grid,
                                args.prompt_tokens + args.new_tokens // 2)
        results.append({"budget": budget, "rows": rows, "planner": pick})
    report(args, target, budgets, results, reference, time.time() - started, roof)
    return 0


def report(args: argparse.Namespace, target: Path, budgets: list[int], results: list[dict],
           reference: list[list[int]] | None, elapsed: float, roof: dict) -> None:
    summary: dict = {}
    per_budget = []
    all_tokens = []
    for result in results:
        rows = result["rows"]
        b = {n: best(rows, SYSTEMS[n]) for n in SYSTEMS}
        entry = {"budget": result["budget"]}
        for n, row in b.items():
            if row is not None:
                entry[f"best_{n}"] = {"batch": row["batch"], "tok_s": row["tok_s_median"]}
                if row.get("tokens") is not None:
                    all_tokens.append(row["tokens"])
        if b[2] and b[3]:
            entry["draft_over_nodraft"] = b[3]["tok_s_median"] / b[2]["tok_s_median"]
        if b[2] and b[5]:
            entry["self_over_nodraft"] = b[5]["tok_s_median"] / b[2]["tok_s_median"]
        if b[3] and b[5]:
            entry["self_over_draft"] = b[5]["tok_s_median"] / b[3]["tok_s_median"]
        ours = [r for r in (b[2], b[3], b[5]) if r]
        if b[1] and ours:
            entry["ours_over_accelerate"] = max(r["tok_s_median"] for r in ours) / b[1]["tok_s_median"]
        planner = result.get("planner")
        if planner:
            measured = {f"{r['batch']},{0 if r['system'] == SYSTEMS[2] else r['k']}": r["tok_s_median"]
                        for r in rows if r["system"] in (SYSTEMS[2], SYSTEMS[3]) and r.get("tok_s_median")}
            key = f"{planner['pick'][0]},{planner['pick'][1]}" if planner.get("pick") else None
            if measured:
                best_measured = max(measured.values())
                entry["planner_pick"] = planner["pick"]
                entry["pick_over_best"] = measured[key] / best_measured if key in measured else None
                errors = [abs(planner["predictions"][k] - v) / v for k, v in measured.items()
                          if k in planner["predictions"]]
                entry["median_prediction_error"] = statistics.median(errors) if errors else None
            entry["predicted_draft_over_nodraft_at_alpha"] = planner.get("predicted_draft_over_nodraft_at_alpha")
        per_budget.append(entry)
    identical = all(t[: len(all_tokens[0])] == all_tokens[0][: len(t)] for t in all_tokens) if all_tokens else None
    for key in ("draft_over_nodraft", "self_over_nodraft", "self_over_draft", "ours_over_accelerate"):
        values = [e[key] for e in per_budget if e.get(key) is not None]
        if values:
            summary[key] = max(values)
    summary["greedy_tokens_identical"] = identical
    if reference is not None and all_tokens:
        summary["equal_to_dense_target"] = all(t[: len(reference)] == reference[: len(t)] for t in all_tokens)
    picks = [e["pick_over_best"] for e in per_budget if e.get("pick_over_best") is not None]
    if picks:
        summary["worst_pick_over_best"] = min(picks)
    errors = [e["median_prediction_error"] for e in per_budget if e.get("median_prediction_error") is not None]
    if errors:
        summary["median_prediction_error"] = statistics.median(errors)
    effs = [r.get("overlap_efficiency") for res in results for r in res["rows"] if r.get("overlap_efficiency")]
    if effs:
        summary["best_overlap_efficiency"] = max(effs)
    meta = {"date": utc_now(), "target": target.name, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "max_seq_len": args.max_seq_len, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "k": args.k, "dtype": args.dtype, "reps": args.reps, "quick": args.quick, "elapsed_s": elapsed,
            "expert_group": args.expert_group, "num_buffers": args.num_buffers, "interleave": args.interleave,
            "draft_dtype": args.draft_dtype,
            "roofline": roof}
    clean = [{"budget": r["budget"], "planner": r["planner"],
              "rows": [{k: v for k, v in row.items() if k != "tokens"} for row in r["rows"]]} for r in results]
    self_rows = [r for res in results for r in res["rows"] if r.get("resident_experts") and r.get("fits")]
    if self_rows:
        by_n: dict[int, list[dict]] = {}
        for r in self_rows:
            by_n.setdefault(r["resident_experts"], []).append(r)
        summary["acceptance_by_resident_experts"] = {
            str(n): statistics.median(r["acceptance"] for r in rows if r.get("acceptance") is not None)
            for n, rows in sorted(by_n.items()) if any(r.get("acceptance") is not None for r in rows)}
        summary["hit_rate_by_resident_experts"] = {
            str(n): statistics.median(r["expert_hit_rate"] for r in rows if r.get("expert_hit_rate") is not None)
            for n, rows in sorted(by_n.items()) if any(r.get("expert_hit_rate") is not None for r in rows)}
        summary["migrated_bytes"] = sum(r.get("migrated_bytes") or 0 for r in self_rows)
    write_json(PERF / f"{args.out}.json", {"summary": summary, "per_budget": per_budget, "meta": meta,
                                           "results": clean})
    lines = [f"Run {meta['date']}, target `{target.name}` streamed from disk (O_DIRECT), {meta['threads']} threads, "
             f"{args.dtype}; HumanEval prompts cut to {args.prompt_tokens} tokens, {args.new_tokens} new tokens, "
             f"KV sized for {args.max_seq_len} tokens per row; k = {args.k}; steady-state decode rate (after each "
             f"batch's prefill pass, before its last pass){' (--quick)' if args.quick else ''}.", "",
             "| budget | system | batch | tok/s | s/pass | io s/pass | device s/pass | tokens/pass | GB read/pass "
             "| KV/row | acceptance | hit rate |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        for r in result["rows"]:
            if not r.get("fits"):
                lines.append(f"| {format_bytes(result['budget'])} | {r['system']} | {r['batch']} | does not fit "
                             "| | | | | | | | |")
                continue

            def fmt(key: str, scale: float = 1.0, digits: int = 2, row: dict = r) -> str:
                value = row.get(key)
                return f"{value / scale:.{digits}f}" if isinstance(value, (int, float)) else "–"

            kv = format_bytes(r["kv_bytes_per_row"]) if r.get("kv_bytes_per_row") else "–"
            lines.append(f"| {format_bytes(result['budget'])} | {r['system']}"
                         f"{' n=' + str(r['resident_experts']) if r.get('resident_experts') else ''} | {r['batch']} "
                         f"| {fmt('tok_s_median', digits=3)} | {fmt('s_per_pass', digits=1)} "
                         f"| {fmt('io_s_per_pass', digits=1)} | {fmt('device_s_per_pass', digits=1)} "
                         f"| {fmt('tokens_per_pass', digits=1)} | {fmt('bytes_per_pass', 1e9)} | {kv} "
                         f"| {fmt('acceptance')} | {fmt('expert_hit_rate')} |")
    def pairs(items: dict, digits: int) -> str:
        return ", ".join(f"{k} = {v:.{digits}f}" if isinstance(v, float) else f"{k} = {v}" for k, v in items.items())

    budget_lines = [f"{format_bytes(e['budget'])}: " + pairs({k: v for k, v in e.items()
                                                             if k != "budget" and not k.startswith("best")}, 2)
                    for e in per_budget]
    lines += ["", "Per budget: " + "; ".join(budget_lines), "", "Summary: " + pairs(summary, 3)]
    lines += ["", f"Roofline measured in the same run: cold O_DIRECT disk read {roof['disk_read_GBps']:.2f} GB/s; fp32 "
              "matmul " + ", ".join(f"{v:.0f} GFLOP/s at {k.split('_')[2]}" for k, v in roof.items()
                                    if k.startswith("matmul")) + "."]
    if self_rows:
        curve = plot_acceptance(args, summary)
        lines += ["", f"Self-draft acceptance and hit rate vs resident experts per layer: `{curve.name}`; "
                      f"acceptance {summary['acceptance_by_resident_experts']}, hit rate "
                      f"{summary['hit_rate_by_resident_experts']}, migrated {summary['migrated_bytes'] / 1e9:.2f} GB."]
    plot = plot_sweep(args, per_budget)
    if plot is not None:
        lines += ["", f"Budget sweep: `{plot.name}` (best steady tok/s of each system, the planner's pick per budget)."]
    text = "\n".join(lines)
    write_section(PERF / "README.md", args.out, text, heading=f"{args.out} (`scripts/bench_moe.py`)")
    print(text)


def plot_acceptance(args: argparse.Namespace, summary: dict) -> Path:
    """Self-draft acceptance and resident hit rate against resident experts per layer: <out>_acceptance.png."""
    path = PERF / f"{args.out}_acceptance.png"
    with figure(path, (5.6, 3.6)) as ax:
        for key, label in (("acceptance_by_resident_experts", "acceptance (per draft token)"),
                           ("hit_rate_by_resident_experts", "hit rate (target picks resident)")):
            points = sorted((int(n), v) for n, v in summary.get(key, {}).items())
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xlabel("resident experts per layer")
        ax.set_ylim(0, 1)
        ax.set_title(f"{args.target}: resident-expert drafting")
        ax.legend(fontsize=7)
    return path


def plot_sweep(args: argparse.Namespace, per_budget: list[dict]) -> Path | None:
    """Best steady tok/s per system against the budget, with the planner's pick marked: docs/perf/<out>_sweep.png."""
    if len(per_budget) < 2:
        return None
    path = PERF / f"{args.out}_sweep.png"
    with figure(path, (6.4, 4.0)) as ax:
        gib = [e["budget"] / 2**30 for e in per_budget]
        for n, label in SYSTEMS.items():
            points = [(g, e[f"best_{n}"]["tok_s"]) for g, e in zip(gib, per_budget) if e.get(f"best_{n}")]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        for g, e in zip(gib, per_budget):
            if e.get("planner_pick"):
                ax.annotate(f"pick b={e['planner_pick'][0]}, k={e['planner_pick'][1]}", (g, 0),
                            textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        ax.set_xlabel("memory budget (GiB, everything the engine holds)")
        ax.set_ylabel("steady decode tokens/s (best batch)")
        ax.set_ylim(bottom=0)
        leaders = {max(((e[f"best_{n}"]["tok_s"], label) for n, label in SYSTEMS.items() if e.get(f"best_{n}")),
                       default=(0, "-"))[1] for e in per_budget}
        lead = (f"{next(iter(leaders))} leads at every budget" if len(leaders) == 1
                else "the lead changes with the budget")
        ax.set_title(f"{args.target}\nbest steady tok/s per system vs budget: {lead}", fontsize=9)
        ax.legend(fontsize=7)
    return path


if __name__ == "__main__":
    sys.exit(main())
