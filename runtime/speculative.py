"""The speculative core of the one runner (offload/pipeline.py, resident or offloaded): propose -> verify ->
commit -> truncate.

Cache invariants (per row, with C committed tokens = prompt + output so far):
  - once a row is prefilled, the target's KV cache holds its first C - 1 committed tokens; the last committed
    token is "pending": it is fed at the start of the next verify pass, followed by the row's drafts;
  - the drafter's KV cache holds a prefix of the committed tokens; the rest are fed at its round's first call.

A round of L draft calls proposes d_1..d_L for every row of a batch; row r keeps n_r = min(k, remaining_r - 1) of
them (`draft_lengths`: never a draft past the row's length limit), so each row verifies exactly what it would
verify alone. A drafter may propose fewer for a row (a negative token: nothing more, `cut_drafts`; a model-free
drafter with no match proposes none): n_r shrinks to what it proposed, and the round ends once no row has more. The
target scores [pending, d_1..d_{n_r}]; verification (verify.py, Leviathan et al. 2023,
Algorithm 1) accepts a_r <= n_r drafts and emits one more token; `commit` appends them. Then (`kept_lengths`) the
target cache keeps C + a_r positions (pending + accepted drafts; the new last token is pending) and the drafter's
C + min(a_r, L - 1) (it saw committed + d_1..d_{L-1}). With k = 0 the same step is plain batched decoding.

Randomness is per request (rng.py): a draw is keyed by the row's seed, its committed count and the stream, so a
sampled row's output does not depend on the rows beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import Request
from .rng import DRAFT, VERIFY, draw_seed, generators
from .sampling import SamplingParams, warp_logits, warp_rows
from .verify import verify_greedy, verify_sampling

__all__ = ["DRAFT", "VERIFY", "commit", "cut_drafts", "draft_lengths", "draw_seeds", "kept_lengths",
           "one_hot_drafts", "pad_right", "row_warps", "verify_rows"]


def pad_right(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token rows: returns (ids [batch, max_len], num_new [batch])."""
    width = max(max(len(r) for r in rows), 1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [batch, width]
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)


def draft_lengths(rows: Sequence[Request], k: int, ready: Sequence[bool] | None = None) -> list[int]:
    """Drafts row r verifies in a round of k: min(k, remaining - 1); 0 for a row not `ready`: the pass that feeds
    a row's prompt (its first verify) carries no drafts, in both runners, so a row's rounds do not depend on the
    batch it joined."""
    return [0 if ready is not None and not ready[n] else max(0, min(k, r.remaining - 1)) for n, r in enumerate(rows)]


def cut_drafts(num_drafts: Sequence[int], token: torch.Tensor, t: int) -> list[int]:
    """After draft call t (0-based) of a round returned token [rows]: a row whose token is negative proposed
    nothing more, so it keeps at most t drafts. The round is over once max(result) <= t + 1."""
    stopped = (token < 0).tolist()
    return [min(n, t) if stop else n for n, stop in zip(num_drafts, stopped)]


def row_warps(rows: Sequence[Request]) -> list[list[float]] | None:
    """Each row's (temperature, top_p, top_k), or None when every row is greedy (the greedy fast path)."""
    if all(r.greedy for r in rows):
        return None
    return [[float(x) for x in r.warp] for r in rows]


def draw_seeds(rows: Sequence[Request], stream: int, token: int = 0) -> list[int] | None:
    """Per-row seeds of one draw (rng.py); None when no row has a seed (greedy runs draw nothing). A greedy row in
    a sampled batch draws from a fixed stream: its one-hot distributions make every draw's outcome the argmax."""
    if all(r.seed is None for r in rows):
        return None
    return [draw_seed(r.seed if r.seed is not None else 0, r.num_tokens, stream, token) for r in rows]


def verify_rows(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: Sequence[int], p: torch.Tensor | None,
                params: SamplingParams, seeds: Sequence[int] | None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[list[int], list[list[int]]]:
    """Greedy match or rejection sampling of drafts [rows, L] (row r: its first num_drafts[r] real) against the
    target's logits [rows, L + 1, vocab], p [rows, L, vocab] the draft's warped distributions (None: greedy, or
    deterministic drafts: a point mass on each drafted token, as a model-free drafter proposes). warps: each row's
    own (temperature, top_p, top_k) instead of params' (a greedy row's one-hot
    distributions make rejection sampling exact greedy matching). Returns (accepted per row, emitted tokens per
    row: the first accepted + 1 are real)."""
    with torch.inference_mode():
        drafts = drafts.to(logits.device)  # (a drafter on a GPU, the target's head on the host, or the reverse)
        p = None if p is None else p.to(logits.device)
        if warps is None and params.greedy:
            result = verify_greedy(drafts, logits, num_drafts)
        else:
            q = (warp_rows(logits, warps) if warps is not None  # [rows, L + 1, vocab]
                 else warp_logits(logits, params.temperature, params.top_p, params.top_k))
            dp = p if p is not None else one_hot_drafts(drafts.to(q.device), q.shape[2], q.dtype)  # [rows, L, vocab]
            result = verify_sampling(drafts, dp, q, generators(seeds) if seeds is not None else None, num_drafts)
        return result.num_accepted.tolist(), result.tokens.tolist()


def one_hot_drafts(drafts: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """The draft distribution of deterministic drafts [rows, L]: all mass on each drafted token -> [rows, L, vocab].
    Rejection sampling then accepts x_i with probability q_i(x_i) and resamples from norm(max(0, q_i - p_i)), q_i
    without x_i (Leviathan et al. 2023, Algorithm 1): exact for any proposal."""
    p = torch.zeros((*drafts.shape, vocab), dtype=dtype, device=drafts.device)  # [rows, L, vocab]
    return p.scatter_(-1, drafts.clamp_min(0).unsqueeze(-1), 1.0)


def commit(rows: Sequence[Request], accepted: Sequence[int], emitted: Sequence[Sequence[int]],
           num_drafts: Sequence[int]) -> list[int]:
    """Append each row's accepted drafts and the one token after them; returns the committed counts before."""
    before = [r.num_tokens for r in rows]
    for r, a, tokens, n in zip(rows, accepted, emitted, num_drafts):
        r.num_drafted += n
        r.num_accepted += a
        r.commit(list(tokens[: a + 1]))
    return before


def kept_lengths(committed: Sequence[int], accepted: Sequence[int], calls: int) -> tuple[list[int], list[int]]:
    """(target, drafter) cache lengths to keep after a verify of rows that had `committed` tokens, after a round of
    `calls` draft calls (see the module docstring)."""
    target = [c + a for c, a in zip(committed, accepted)]
    drafter = [c + min(a, max(calls - 1, 0)) for c, a in zip(committed, accepted)]
    return target, drafter
