"""Model-free drafters' acceptance, simulated on reference outputs, and their proposal cost: the measurement behind
the defaults of prompt_lookup_min / prompt_lookup_max and suffix_min_prob (runtime/offload/modelfree.py).

No model runs. Each row's "output" is a reference continuation: aclsum's human summaries (its three aspects,
joined) after the summarization prompt, HumanEval's canonical solution after its prompt. Decoding is simulated
with greedy acceptance: at each step the drafter proposes up to k tokens from the row's context (prompt + output so
far), the step accepts the longest prefix equal to the reference's next tokens and commits one more token. E[n] =
tokens committed per step (1.0: no gain). The suffix drafter sees the earlier rows' references as the job's
finished outputs. Proposal cost: wall microseconds per row of the drafter's round-start call (index the new
tokens, propose), median over every step, on this machine as it is (shared cores: an upper bound).

Reference summaries are written by people, not by the model: a model's own summary copies the paper more, so E[n]
here is a lower bound on summaries (issue 22 measured 2.39 at k = 4, n-grams 1-3, on Qwen2.5-Coder-1.5B's own
outputs). The defaults are chosen on the ranking, not the level.

    python scripts/drafter_acceptance.py [--quick] [--out docs/perf/drafter_acceptance.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

from specoffload.runtime.corpora import ACLSUM_TEST, aclsum_prompts
from specoffload.runtime.drafter_replay import replay_rounds
from specoffload.runtime.offload.drafters.modelfree import NgramDrafter, SuffixDrafter
from specoffload.runtime.prompts import _humaneval_path

MODEL = Path.home() / ".cache" / "specoffload" / "models" / "qwen2.5-coder-1.5b-instruct"
NGRAMS = [(1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (3, 5)]
THRESHOLDS = [0.05, 0.1, 0.3, 0.5]
KS = [2, 4, 8]


def workloads(tok, quick: bool) -> dict[str, list[tuple[list[int], list[int]]]]:  # noqa: ANN001
    """name -> [(prompt ids, reference output ids)]."""
    papers = [json.loads(line) for line in ACLSUM_TEST.read().decode().splitlines() if line.strip()]
    prompts = aclsum_prompts()
    summaries = [" ".join(p["summary"][a] for a in ("challenge", "approach", "outcome")) for p in papers]
    with gzip.open(_humaneval_path(), "rt") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    n = 24 if quick else None
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    return {
        "aclsum": [(enc(p), enc(" " + s)) for p, s in zip(prompts[:n], summaries[:n])],
        "humaneval": [(enc(t["prompt"]), enc(t["canonical_solution"])) for t in tasks[:n]],
    }


def simulate(make, rows: list[tuple[list[int], list[int]]], k: int) -> dict[str, float]:  # noqa: ANN001
    """Greedy-acceptance decoding of every row with one drafter (runtime/drafter_replay.py `replay_rounds`: rows one
    after another, so the suffix drafter's global index sees the earlier rows' outputs)."""
    rounds, seconds = replay_rounds(make(k), rows, k)
    micros = sorted(s * 1e6 for s in seconds)
    return {"tokens_per_step": sum(a + 1 for _, a in rounds) / len(rounds),
            "proposal_rate": sum(1 for n, _ in rounds if n) / len(rounds),
            "proposal_us_median": statistics.median(micros), "proposal_us_p90": micros[int(0.9 * len(micros))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="24 rows per workload")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    results: dict[str, dict] = {}
    for name, rows in workloads(tok, args.quick).items():
        res: dict[str, dict] = {}
        for lo, hi in NGRAMS:
            for k in KS:
                res[f"ngram {lo}-{hi} k={k}"] = simulate(
                    lambda kk, lo=lo, hi=hi: NgramDrafter(max_tokens=kk, min_n=lo, max_n=hi), rows, k)
        for p in THRESHOLDS:
            for k in KS:
                res[f"suffix p>={p} k={k}"] = simulate(
                    lambda kk, p=p: SuffixDrafter(max_tokens=kk, min_prob=p), rows, k)
        results[name] = res
        print(f"\n{name}: {len(rows)} rows, {sum(len(o) for _, o in rows)} reference tokens")
        print(f"{'drafter':28s} {'E[n]':>6s} {'proposes':>9s} {'us/row':>7s} {'p90':>6s}")
        for key, r in res.items():
            print(f"{key:28s} {r['tokens_per_step']:6.3f} {r['proposal_rate']:9.2f} {r['proposal_us_median']:7.1f} "
                  f"{r['proposal_us_p90']:6.1f}")
    best = {name: max(res, key=lambda key: res[key]["tokens_per_step"] if "k=4" in key else 0)
            for name, res in results.items()}
    summary = {
        "ngram_1_3_k4_aclsum": results["aclsum"]["ngram 1-3 k=4"]["tokens_per_step"],
        "ngram_1_3_k4_humaneval": results["humaneval"]["ngram 1-3 k=4"]["tokens_per_step"],
        "suffix_0.1_k4_aclsum": results["aclsum"]["suffix p>=0.1 k=4"]["tokens_per_step"],
        "suffix_0.1_k4_humaneval": results["humaneval"]["suffix p>=0.1 k=4"]["tokens_per_step"],
        "best_at_k4": best,
        "proposal_us_median_ngram_1_3_k4": {n: r["ngram 1-3 k=4"]["proposal_us_median"] for n, r in results.items()},
        "proposal_us_median_suffix_0.1_k4": {n: r["suffix p>=0.1 k=4"]["proposal_us_median"]
                                             for n, r in results.items()},
    }
    print("\nsummary:", json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "quick": args.quick, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
