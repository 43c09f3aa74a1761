"""One speculative decoding step for a batch of rows, in one process.

Cache invariants (per row b, with C_b committed tokens = prompt + output so far):
  - the target's KV cache holds the first C_b - 1 committed tokens; the last committed token is
    "pending": it is fed at the start of the next verification pass;
  - the draft's KV cache holds a prefix of the committed tokens (C_b - 1 or fewer); the rest are
    fed to the draft at the start of its next proposal round (one or two tokens in steady state).

A step with k draft tokens: the draft proposes d_1..d_k autoregressively; the target scores
[pending, d_1, ..., d_k] in one pass (k + 1 positions); verification accepts n <= k of them and
emits one more token (correction or bonus); both caches are truncated back to what was accepted.
With k = 0 (no draft) the same step is plain batched decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .models.model import Transformer
from .sampling import SamplingParams, warp_logits
from .verify import VerifyResult, verify_greedy, verify_sampling


def pad_right(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token rows: returns (ids [batch, max_len], num_new [batch])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [batch, width]
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)


@dataclass
class StepTimes:
    """Wall seconds spent per phase, summed over steps (phases run one after another here)."""

    draft: float = 0.0
    target: float = 0.0
    verify: float = 0.0


class SpeculativeStep:
    """Draft → verify → commit for the rows currently in the caches."""

    def __init__(
        self,
        target: Transformer,
        draft: Transformer | None,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> None:
        self.target = target
        self.draft = draft
        self.params = params
        self.generator = generator

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        return warp_logits(logits, p.temperature, p.top_p, p.top_k)

    def propose(
        self, cache: KVCache, unfed: list[list[int]], k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft k tokens per row. Returns (draft_tokens [batch, k], p [batch, k, vocab] or None if greedy)."""
        assert self.draft is not None and k >= 1
        ids, num_new = pad_right(unfed)  # [batch, width], [batch]
        last = (num_new - 1).unsqueeze(1)  # [batch, 1]
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            logits = self.draft.forward(ids, cache, num_new=num_new, output_positions=last)  # [batch, 1, vocab]
            logits = logits[:, 0]  # [batch, vocab]
            if self.params.greedy:
                token = logits.argmax(dim=-1)  # [batch]
            else:
                p_i = self._probs(logits)  # [batch, vocab]
                token = torch.multinomial(p_i, 1, generator=self.generator).squeeze(1)
                probs.append(p_i)
            tokens.append(token)
            if i + 1 < k:
                ids = token.unsqueeze(1)  # [batch, 1]
                num_new = torch.ones_like(num_new)
                last = torch.zeros_like(last)
        draft_tokens = torch.stack(tokens, dim=1)  # [batch, k]
        p = torch.stack(probs, dim=1) if probs else None  # [batch, k, vocab]
        return draft_tokens, p

    def verify(self, cache: KVCache, pending: torch.Tensor, draft_tokens: torch.Tensor,
               p: torch.Tensor | None) -> VerifyResult:
        """Score [pending, d_1..d_k] with the target in one pass and run rejection sampling / greedy match."""
        ids = torch.cat([pending.unsqueeze(1), draft_tokens], dim=1)  # [batch, k + 1]
        logits = self.target.forward(ids, cache)  # [batch, k + 1, vocab]
        if self.params.greedy:
            return verify_greedy(draft_tokens, logits)
        q = self._probs(logits)  # [batch, k + 1, vocab]
        if p is None:  # k == 0
            p = q.new_zeros((q.shape[0], 0, q.shape[2]))
        return verify_sampling(draft_tokens, p, q, self.generator)
