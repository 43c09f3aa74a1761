"""Side by side with llama.cpp on the same GGUF file, the same prompts and the same new tokens (issue 36, first cut).

    scripts/setup_llamacpp.sh      # once: llama-cpp-python built from source into its own venv (outside the repo)
    python -m scripts.bench_peers [--gguf FILE] [--prompts 8] [--new-tokens 32] [--reps 3] [--batches 1,8]
        [--llamacpp-batches 1,8]

Systems, all resident in host memory on this CPU, greedy, EOS ignored, the prompts tokenized once (the GGUF's own
tokenizer) and given to each as token ids:
- llama.cpp at each `--llamacpp-batches` width (1: llama-cpp-python's high-level API, one sequence at a time; more:
  its low-level batch API, that many sequences decoded in one batch), `--threads` threads, its own kernels on the
  GGUF's blocks; run in the peer venv by scripts/peers/llamacpp_runner.py;
- transformers (`--transformers-batches`) on the fp16 conversion of the same file (scripts/get_models.py: the
  same weights), bfloat16, generate() on left-padded waves;
- ours on the same GGUF run as stored (runtime/models/gguf.py), bfloat16, at each `--batches` batch, with its
  q4 weights packed for torch's int4 kernel (`packed_weights` "on") and dequantized at load ("off").
The summary's `ours_over_llamacpp_resident(_decode)` is ours at its best batch over llama.cpp at its best.
Per system: tokens/s with prefill counted (new tokens over the whole generate) and decode only (the tokens after
the first over the time after the first: llama.cpp's own split; ours from a second call with one new token,
T(N) - T(1)). Repetitions alternate systems. Greedy agreement with llama.cpp is reported (bfloat16 against
llama.cpp's float32 accumulation: equal until a near tie). JSON under docs/perf/ (`peers`) with a "summary".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from scripts.common import PERF, median_spread, run_meta, utc_now, write_json

ROOT = Path(__file__).resolve().parent.parent


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


def ours(target: Path, prompts: list[list[int]], new_tokens: int, batch: int, packed: str) -> dict:
    import time

    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.sampling import SamplingParams

    engine = Engine(EngineConfig(target=target, dtype="bfloat16", max_batch_size=batch, num_draft_tokens=0,
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


def transformers_run(checkpoint: Path, prompts: list[list[int]], new_tokens: int, batch: int, threads: int) -> dict:
    """transformers' generate on the fp16 conversion of the same GGUF (the same weights), bfloat16, `batch` prompts
    at a time left-padded, greedy, EOS ignored (min_new_tokens); timed as ours: T(N), and T(N) - T(1) for decode."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="default: the target's Q4_K_M (scripts/get_models.py)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8", help="ours: batch sizes")
    ap.add_argument("--llamacpp-batches", default="1,8", help="llama.cpp: sequences per batch (1: its high-level API)")
    ap.add_argument("--transformers-batches", default="8",
                    help="transformers (bfloat16, the fp16 conversion); '' for none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 prompts, 8 new tokens, 1 rep (scratch/)")
    ap.add_argument("--out", default="peers")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.reps = 2, 8, 1
    meta = run_meta("bfloat16")
    python = subprocess.run([str(ROOT / "scripts" / "setup_llamacpp.sh")], capture_output=True, text=True,
                            check=True).stdout.strip().splitlines()[-1]
    from scripts.get_models import SPECS, default_cache, fetch_gguf
    from specoffload.runtime.models.gguf import resolve_model
    from specoffload.runtime.prompts import humaneval_prompts
    from specoffload.runtime.tokenizer import load_tokenizer

    gguf = args.gguf or fetch_gguf(SPECS["target"], default_cache())
    target = resolve_model(gguf)
    tok = load_tokenizer(target)
    prompts = [tok.encode(p) for p in humaneval_prompts(args.prompts)]
    n_ctx = max(map(len, prompts)) + args.new_tokens + 8
    systems = {f"llama.cpp b{b}": lambda b=b: llamacpp(python, gguf, prompts, args.new_tokens, args.threads, n_ctx, b)
               for b in map(int, args.llamacpp_batches.split(","))}
    if args.transformers_batches:
        converted = default_cache() / SPECS["target"].name  # the same GGUF converted to fp16 (scripts/get_models.py)
        for b in map(int, args.transformers_batches.split(",")):
            systems[f"transformers b{b}"] = lambda b=b: transformers_run(converted, prompts, args.new_tokens, b,
                                                                         args.threads)
    for b in map(int, args.batches.split(",")):
        for packed in ("on", "off"):
            systems[f"ours b{b} packed-{packed}"] = lambda b=b, packed=packed: ours(target, prompts, args.new_tokens,
                                                                                   b, packed)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for rep in range(args.reps):
        for name, run in systems.items():
            r = run()
            runs[name].append(r)
            print(f"rep {rep} {name}: {r['tok_s']:.2f} tok/s (decode {r['decode_tok_s']:.2f})", file=sys.stderr)
    first = next(n for n in runs if n.startswith("llama.cpp"))
    reference = runs[first][0]["tokens"]
    results, summary = {}, {"gguf": gguf.name, "prompts": len(prompts), "new_tokens": args.new_tokens,
                            "threads": args.threads, "llama_cpp_python": runs[first][0]["version"]}
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
