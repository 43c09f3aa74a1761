"""Per-row processing of the target's logits before verification: penalties, min_tokens, and logprobs recorded.

Lossless speculation needs the verifier's ``q_i`` to be the distribution the target alone would sample position
``i`` from. A penalty depends on the tokens before the position, so row r's position j (j = 0: after the pending
token; j >= 1: after drafts x_1..x_j) is processed with the history ``output + drafts[:j]``: exactly what
decoding without a draft would have seen had it emitted those tokens. Verification (verify.py) then runs on the
processed logits, and a rejected draft's later positions are never used (Leviathan et al. 2023, Algorithm 1 with
``q_i`` the processed target distribution). The drafter's own distribution need not be processed: ``p`` only has
to be what the drafts were sampled from (an unpenalised draft costs acceptance, never exactness).

Processing, in vLLM's order (its `apply_penalties`, then min_tokens):
  repetition_penalty rp (CTRL, Keskar et al. 2019): a token in the prompt or the history has its logit l replaced
      by l / rp if l > 0 else l * rp;
  frequency_penalty f, presence_penalty pr (OpenAI): l -= f * count(token in history) + pr * [count > 0]
      (history = generated tokens only);
  min_tokens m: while the row has fewer than m tokens, every id that would end it gets logit -inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import Request


def process_rows(rows: Sequence[Request], logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The target's logits [rows, L + 1, vocab] processed per row (a new tensor; the same one when no row asks for
    processing). drafts [rows, <= L]: each row's drafted tokens (past a row's real drafts: anything)."""
    todo = [n for n, r in enumerate(rows) if r.processed]
    if not todo:
        return logits
    out = logits.float().clone()  # [rows, L + 1, vocab]
    positions, vocab = out.shape[1], out.shape[2]
    for n in todo:
        r = rows[n]
        row_drafts = drafts[n, : positions - 1].long().cpu()  # [<= L]
        out[n] = process_row(out[n], r, row_drafts, vocab)
    return out


def history_counts(output: Sequence[int], drafts: torch.Tensor, positions: int, vocab: int) -> torch.Tensor:
    """counts [positions, vocab]: occurrences of each token in output + drafts[:j] at position j."""
    base = torch.bincount(torch.as_tensor(list(output), dtype=torch.long), minlength=vocab)[:vocab].float()  # [vocab]
    added = torch.zeros(positions, vocab)  # [positions, vocab]
    d = drafts[: positions - 1]
    if d.numel():
        steps = torch.zeros(d.numel(), vocab).scatter_(1, d[:, None].clamp(0, vocab - 1), 1.0)  # [len(d), vocab]
        added[1 : d.numel() + 1] = steps.cumsum(dim=0)
        added[d.numel() + 1 :] = added[d.numel()]
    return base[None, :] + added


def process_row(logits: torch.Tensor, r: Request, drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """One row's logits [positions, vocab] (float32) processed at each position (see the module docstring)."""
    positions = logits.shape[0]
    presence, frequency, repetition = r.penalties
    counts = None
    if presence or frequency or repetition != 1:
        counts = history_counts(r.output, drafts, positions, vocab)  # [positions, vocab]
    if repetition != 1:
        assert counts is not None
        seen = counts > 0  # [positions, vocab]
        prompt = torch.as_tensor(r.prompt, dtype=torch.long).clamp(0, vocab - 1)
        seen[:, prompt] = True
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    if presence or frequency:
        assert counts is not None
        logits = logits - frequency * counts - presence * (counts > 0).float()
    short = r.min_tokens - len(r.output)  # positions j < short are still under min_tokens
    if short > 0 and r.min_stop_ids:
        ids = torch.tensor(sorted(t for t in r.min_stop_ids if 0 <= t < vocab), dtype=torch.long)
        logits = logits.clone()
        rows = torch.arange(min(short, positions))
        logits[rows[:, None], ids[None, :]] = float("-inf")
    return logits


def record_logprobs(rows: Sequence[Request], logits: torch.Tensor, before: Sequence[int]) -> None:
    """After a commit: each row that asks for logprobs gets (token, logprob, rank) of each token it committed, then
    the top-N, from the processed logits [rows, L + 1, vocab] (committed token t of a row was position t of its
    verify). before: each row's output length before the commit."""
    for n, r in enumerate(rows):
        new = len(r.output) - before[n]
        if r.logprobs is None or new <= 0:
            continue
        lp = torch.log_softmax(logits[n, :new].float(), dim=-1)  # [new, vocab]
        top = torch.topk(lp, min(r.logprobs, lp.shape[-1]), dim=-1) if r.logprobs else None
        for j, token in enumerate(r.output[before[n] :]):
            chosen = float(lp[j, token])
            rank = int((lp[j] > lp[j, token]).sum()) + 1
            entry = [(token, chosen, rank)]
            if top is not None:
                entry += [(int(t), float(v), i + 1) for i, (v, t) in enumerate(zip(top.values[j], top.indices[j]))]
            r.token_logprobs.append(entry)


__all__ = ["history_counts", "process_row", "process_rows", "record_logprobs"]
