"""Batched verification of drafted tokens against the target model.

Index convention: a window drafts ``k`` tokens ``x_1..x_k`` (tensor index ``i - 1``). The target scores
``k + 1`` positions: ``q_i`` (``i = 1..k``) is the target distribution for ``x_i`` and ``q_{k+1}`` is the
distribution after all ``k`` drafts, used for the *bonus* token. ``p_i`` is the draft distribution that
``x_i`` was sampled from. Per row, ``n`` drafts are *accepted*; then exactly one more token is emitted:
the *recovered* token (target argmax / residual sample) at the first rejection, or the *bonus* token when
``n == k``. So every call emits ``n + 1`` tokens per row. ``k == 0`` is plain decoding.

Ragged drafts: row ``b`` may carry only ``num_drafts[b] <= k`` real drafts (a row with no match, a row near its
length limit, a row still in prefill). Its drafts past ``num_drafts[b]`` are never accepted, and position
``num_drafts[b] + 1`` is its bonus position (``p := 0`` there), exactly as if the row had been verified alone with
its own ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import greedy_tokens, sample

PAD = -1


@dataclass(frozen=True)
class VerifyResult:
    """``tokens[b, :num_accepted[b] + 1]`` are the emitted tokens of row ``b``; the rest is ``-1``."""

    num_accepted: torch.Tensor  # [batch] long, in 0..k
    tokens: torch.Tensor  # [batch, k + 1] long


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if draft_tokens.dim() != 2 or target.dim() != 3:
        raise ValueError(
            f"expected draft_tokens [batch, k] and target [batch, k + 1, vocab], "
            f"got {tuple(draft_tokens.shape)} and {tuple(target.shape)}"
        )
    batch, k = draft_tokens.shape
    if target.shape[:2] != (batch, k + 1):
        raise ValueError(f"target shape {tuple(target.shape)} does not match draft_tokens [{batch}, {k}]")
    return batch, k


def _emit(num_accepted: torch.Tensor, tokens: torch.Tensor) -> VerifyResult:
    """Pad ``tokens`` [batch, k + 1] with -1 after position ``num_accepted`` [batch]."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)  # [k + 1]
    tokens = tokens.masked_fill(positions > num_accepted.unsqueeze(-1), PAD)
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


def _num_accepted(accepted: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``accepted`` [batch, k] -> [batch] long."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def _draft_mask(num_drafts: torch.Tensor | Sequence[int] | None, batch: int, k: int,
                device: torch.device) -> torch.Tensor | None:
    """[batch, k] True where position i < num_drafts[b] (None: every draft is real)."""
    if num_drafts is None:
        return None
    n = torch.as_tensor(num_drafts, dtype=torch.long, device=device).reshape(batch)  # [batch]
    if bool(((n < 0) | (n > k)).any()):
        raise ValueError(f"num_drafts {n.tolist()} outside 0..{k}")
    return torch.arange(k, device=device)[None, :] < n[:, None]


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  num_drafts: torch.Tensor | Sequence[int] | None = None) -> VerifyResult:
    """Greedy verification: accept the longest prefix where ``x_i == argmax q_i`` (and ``i <= num_drafts[b]``).

    The emitted token after the prefix is the target argmax at the first disagreement, or the bonus
    argmax of ``q_{n+1}``. Accepted drafts equal the target argmax, so the emitted row is simply the
    target argmax ``[:n + 1]``.
    """
    batch, k = _check_shapes(draft_tokens, target_logits)
    target_tokens = greedy_tokens(target_logits)  # [batch, k + 1]
    match = draft_tokens == target_tokens[:, :k]  # [batch, k]
    mask = _draft_mask(num_drafts, batch, k, match.device)
    num_accepted = _num_accepted(match if mask is None else match & mask)  # [batch]
    return _emit(num_accepted, target_tokens)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, q - p))`` per row of ``[rows, vocab]``; falls back to ``q`` where it is all zero."""
    residual = (q - p).clamp_min(0)  # [rows, vocab]
    mass = residual.sum(dim=-1, keepdim=True)  # [rows, 1]
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), q)


def verify_sampling(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    num_drafts: torch.Tensor | Sequence[int] | None = None,
) -> VerifyResult:
    """Speculative sampling, vectorised over the batch.

    Leviathan, Kalman, Matias (2023), "Fast Inference from Transformers via Speculative Decoding",
    Algorithm 1; Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative
    Sampling". With ``p`` the draft and ``q`` the target distributions (the papers' names):

        r_i ~ U(0, 1),  accept x_i  iff  r_i < min(1, q_i(x_i) / p_i(x_i))     (i = 1..k)
        n = number of leading accepted drafts
        n < k:  emit x_1..x_n, then y ~ norm(max(0, q_{n+1} - p_{n+1}))         (recovered token)
        n = k:  emit x_1..x_k, then y ~ q_{k+1}                                  (bonus token)

    The emitted tokens are distributed exactly as if sampled from ``q`` one at a time. The test is
    evaluated as ``r_i * p_i(x_i) < q_i(x_i)``, which is the same event and never divides: a draft with
    ``p_i(x_i) = 0`` (impossible if ``x_i ~ p_i``) is accepted iff ``q_i(x_i) > 0``, and a token with
    ``q_i(x_i) = 0`` is never accepted. If the residual is all zero (``q_{n+1} == p_{n+1}``, so rejection
    had probability 0 in exact arithmetic) we sample from ``q_{n+1}`` instead. The bonus case is the same
    formula with ``p_{k+1} = 0``.

    Args:
        draft_tokens: ``[batch, k]`` drafted tokens ``x_i`` (``k >= 0``).
        p: ``[batch, k, vocab]`` draft probabilities.
        q: ``[batch, k + 1, vocab]`` target probabilities.
        generator: source of randomness for the uniforms and the categorical samples: one for the batch, or one
            per row (per-request streams, runtime/rng.py: row b then draws exactly num_drafts[b] uniforms and one
            sample from its own generator, whatever the batch).
        num_drafts: ``[batch]`` real drafts per row (default ``k``; see the module docstring).
    """
    batch, k = _check_shapes(draft_tokens, q)
    if p.shape != (batch, k, q.shape[-1]):
        raise ValueError(f"p shape {tuple(p.shape)} does not match q {tuple(q.shape)} minus one position")
    per_row = generator is not None and not isinstance(generator, torch.Generator)
    if per_row and len(generator) != batch:  # type: ignore[arg-type]
        raise ValueError(f"{len(generator)} generators for {batch} rows")  # type: ignore[arg-type]
    p, q = p.float(), q.float()
    rows = torch.arange(batch, device=q.device)  # [batch]
    mask = _draft_mask(num_drafts, batch, k, q.device)  # [batch, k] or None
    if mask is not None:
        p = p * mask[:, :, None]  # p_i := 0 past a row's drafts: its bonus position is num_drafts[b] + 1

    x = draft_tokens.unsqueeze(-1)  # [batch, k, 1]
    p_x = p.gather(-1, x).squeeze(-1)  # [batch, k]
    q_x = q[:, :k].gather(-1, x).squeeze(-1)  # [batch, k]
    if per_row:
        counts = [k] * batch if mask is None else mask.sum(dim=1).tolist()
        r = torch.ones(batch, k, device=q.device)  # [batch, k]
        for b, g in enumerate(generator):  # type: ignore[arg-type]
            r[b, : counts[b]] = torch.rand(counts[b], generator=g).to(q.device)
    else:
        r = torch.rand(batch, k, generator=generator, device=q.device)  # [batch, k]
    accept = r * p_x < q_x  # [batch, k]
    num_accepted = _num_accepted(accept if mask is None else accept & mask)  # [batch]

    # Position n + 1 of each row: the residual there, or q_{n+1} itself (p_{n+1} := 0) for the bonus.
    p_padded = torch.cat([p, p.new_zeros(batch, 1, p.shape[-1])], dim=1)  # [batch, k + 1, vocab]
    residual = _residual(p_padded[rows, num_accepted], q[rows, num_accepted])  # [batch, vocab]
    if per_row:
        next_token = torch.stack([sample(residual[b : b + 1].cpu(), g)[0] for b, g in enumerate(generator)])
        next_token = next_token.to(q.device)  # [batch]
    else:
        next_token = sample(residual, generator)  # [batch]

    tokens = torch.cat([draft_tokens.long(), next_token.new_zeros(batch, 1)], dim=1)  # [batch, k + 1]
    tokens[rows, num_accepted] = next_token
    return _emit(num_accepted, tokens)
