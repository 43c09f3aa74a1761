"""Side by side with llama.cpp on the same GGUF file, the same prompts and the same new tokens (issue 36, first cut).

    scripts/setup_llamacpp.sh      # once: llama-cpp-python built from source into its own venv (outside the repo)
    python -m scripts.bench_peers [--gguf FILE] [--prompts 8] [--new-tokens 32] [--reps 3] [--batches 1,8]

Systems, all resident in host memory on this CPU, greedy, EOS ignored, the prompts tokenized once (the GGUF's own
tokenizer) and given to each as token ids:
- llama.cpp (llama-cpp-python's high-level API: one sequence at a time, `--threads` threads, its own kernels on the
  GGUF's blocks; run in the peer venv by scripts/peers/llamacpp_runner.py);
- ours on the same GGUF run as stored (runtime/models/gguf.py), bfloat16, at each `--batches` batch, with its
  q4 weights packed for torch's int4 kernel (`packed_weights` "on") and dequantized at load ("off").
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


def llamacpp(python: str, gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int, n_ctx: int) -> dict:
    req = {"model": str(gguf), "prompts": prompts, "new_tokens": new_tokens, "threads": threads, "n_ctx": n_ctx}
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="default: the target's Q4_K_M (scripts/get_models.py)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
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
    systems = {"llama.cpp": lambda: llamacpp(python, gguf, prompts, args.new_tokens, args.threads, n_ctx)}
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
    reference = runs["llama.cpp"][0]["tokens"]
    results, summary = {}, {"gguf": gguf.name, "prompts": len(prompts), "new_tokens": args.new_tokens,
                            "threads": args.threads, "llama_cpp_python": runs["llama.cpp"][0]["version"]}
    for name, rs in runs.items():
        med, lo, hi = median_spread(r["tok_s"] for r in rs)
        dmed, dlo, dhi = median_spread(r["decode_tok_s"] for r in rs)
        same = sum(a == b for x, y in zip(rs[0]["tokens"], reference) for a, b in zip(x, y))
        results[name] = {"tok_s_median": med, "tok_s_min": lo, "tok_s_max": hi, "decode_tok_s_median": dmed,
                         "decode_tok_s_min": dlo, "decode_tok_s_max": dhi,
                         "greedy_agreement_with_llamacpp": same / sum(map(len, reference)),
                         "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]}
    base = results["llama.cpp"]
    best = max((n for n in results if n.startswith("ours")), key=lambda n: results[n]["tok_s_median"])
    summary |= {"best_ours": best,
                "ours_over_llamacpp_resident": round(results[best]["tok_s_median"] / base["tok_s_median"], 3),
                "ours_over_llamacpp_resident_decode": round(
                    max(r["decode_tok_s_median"] for n, r in results.items() if n.startswith("ours"))
                    / base["decode_tok_s_median"], 3)}
    for name in results:
        if name.startswith("ours"):
            key = name.replace("ours ", "").replace(" ", "_").replace("-", "_")
            summary[f"{key}_over_llamacpp"] = round(results[name]["tok_s_median"] / base["tok_s_median"], 3)
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
