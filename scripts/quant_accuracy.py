"""How close a compressed checkpoint (`specoffload quantize`) is to its uncompressed source, on held-out text.

    python -m scripts.quant_accuracy --reference DIR --candidate DIR [--quick] [-o report.json]

Metrics (the reference runs first and is freed before the candidate loads; both in float32, resident):
  top1_agreement  teacher-forced on the text windows: the share of positions where the candidate's argmax next
                  token equals the reference's;
  mean_kl         mean over the same positions of KL(p_ref || p_cand) in nats, from full-vocabulary softmaxes;
  greedy          each prompt's reference greedy continuation of `greedy_tokens` tokens (incremental decoding);
                  the candidate, fed prompt + continuation in one pass, must predict every continuation token, so
                  by induction its own greedy output equals the reference's: `greedy_identical` rows of `prompts`,
                  and the first mismatching step of the others.
Held-out text: windows of the standard-library source files the MoE builders calibrate on (scripts/moe/
calibration.py), and HumanEval prompts 100-131 (the MoE builders' held-out prompts).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from scripts.moe.calibration import load_calibration, stdlib_files, tokenizer_encoder
from scripts.moe.measure import Batch, dense_greedy, predict
from specoffload.runtime.models.model import Transformer

HUMANEVAL_SPAN = (100, 132)


def held_out(reference: Path, windows: int, seq_len: int, prompts: int) -> tuple[list[list[int]], list[list[int]]]:
    """(text windows, greedy prompts): `windows` windows of `seq_len` tokens of stdlib source, and the first
    `prompts` HumanEval prompts of 100-131, tokenized with the reference's tokenizer."""
    from specoffload.runtime.prompts import humaneval_prompts

    encode = tokenizer_encoder(reference)
    calib = load_calibration(stdlib_files()[:windows], encode, seq_len)
    start, end = HUMANEVAL_SPAN
    return calib.token_ids.tolist(), [encode(p) for p in humaneval_prompts()[start:end][:prompts]]


@torch.inference_mode()
def _side(model: Transformer, rows: Sequence[Sequence[int]], greedy_prompts: Sequence[Sequence[int]],
          greedy_tokens: int, continuations: list[list[int]] | None) -> dict:
    """One model's predictions: log-probs at every window position, and on prompt + continuation the argmax at
    the positions predicting continuation tokens (continuations: the reference's; None: this is the reference)."""
    batch = Batch.of([list(r) for r in rows])
    out = predict(model, batch, batch.valid)
    logprobs = torch.log_softmax(out.logits, dim=-1)  # [M, V]
    if continuations is None:
        continuations = [dense_greedy(model, list(p), greedy_tokens) for p in greedy_prompts]
    picks = []
    for p, c in zip(greedy_prompts, continuations):
        g = Batch.of([list(p) + c[:-1]])
        picks.append(predict(model, g).top1[len(p) - 1 :].tolist())  # [greedy_tokens]
    return {"top1": out.top1, "logprobs": logprobs, "continuations": continuations, "greedy_picks": picks}


def compare(reference: Path, candidate: Path, rows: Sequence[Sequence[int]], greedy_prompts: Sequence[Sequence[int]],
            greedy_tokens: int = 32) -> dict[str, object]:
    """The metrics of the module docstring, candidate against reference."""
    ref = _side(Transformer(reference, torch.float32), rows, greedy_prompts, greedy_tokens, None)
    gc.collect()
    got = _side(Transformer(candidate, torch.float32), rows, greedy_prompts, greedy_tokens, ref["continuations"])
    same = ref["top1"] == got["top1"]  # [M]
    p = ref["logprobs"].exp()
    kl = (p * (ref["logprobs"] - got["logprobs"])).sum(dim=-1)  # [M]
    greedy = []
    for cont, picks in zip(ref["continuations"], got["greedy_picks"]):
        miss = [i for i, (a, b) in enumerate(zip(cont, picks)) if a != b]
        greedy.append(miss[0] if miss else None)
    return {
        "reference": str(reference),
        "candidate": str(candidate),
        "positions": int(same.numel()),
        "top1_agreement": round(float(same.float().mean()), 4),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "greedy_tokens": greedy_tokens,
        "greedy_prompts": len(greedy),
        "greedy_identical": sum(m is None for m in greedy),
        "greedy_first_mismatch": greedy,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, required=True, help="the uncompressed checkpoint")
    ap.add_argument("--candidate", type=Path, required=True, help="its compressed copy")
    ap.add_argument("--quick", action="store_true", help="4 windows of 128 tokens, 4 prompts")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args(argv)
    windows, seq_len, prompts = (4, 128, 4) if args.quick else (12, 256, 32)
    rows, greedy_prompts = held_out(args.reference, windows, seq_len, prompts)
    report = compare(args.reference, args.candidate, rows, greedy_prompts, args.greedy_tokens)
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
