"""The coordinator's state of the interleaved batches: admission, a fresh wave of worker state, restart.

Batch b in {0, 1} (one batch, b = 0, without a drafter) holds up to `plan.batch` requests. A batch whose rows
have all finished is refilled from the waiting queue at its verify op: a new *wave*. Online re-planning may change
the rows a wave admits (`rows`, replan.py): with speculation off, one batch takes the rows of both once the other
has drained (the other then stays empty: its steps run no pass); with speculation back on, an empty batch is
refilled beside the next wave. Each wave gets empty KV
caches in the attention worker and the drafter, sized for its rows (`capacity`), and freshly seeded
generators: `batch_seed` is the only place the seeds are derived, so the local and Ray backends draw the same
samples. After a lost worker, `restart` re-creates a batch's caches for its unfinished rows; its next pass then
feeds every committed token again (pipeline.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specoffload.planner.plan import Plan

from ..request import Request
from .workers import Workers


@dataclass
class Batch:
    """One interleaved batch: its requests, and the tensors of its pass and draft round in flight."""

    index: int
    rows: list[Request] = field(default_factory=list)
    drafts: torch.Tensor | None = None  # [rows, k] proposed for the next target pass
    p: torch.Tensor | None = None  # [rows, k, vocab] draft probabilities (sampling only)
    draft_tokens: list[torch.Tensor] = field(default_factory=list)  # k x [rows] during a draft round
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # k x [rows, vocab]
    hidden: torch.Tensor | None = None  # [rows, T, H] during a target pass
    num_new: torch.Tensor | None = None  # [rows] tokens fed per row this pass
    token_mask: torch.Tensor | None = None  # [rows, T]
    pass_k: int = 0  # draft tokens verified by the current pass
    round_k: int = 0  # draft tokens of the current draft round
    committed: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [rows, pass_k + 1, vocab]

    def clear_pass(self) -> None:
        """Forget the pass and draft round in flight (nothing of them was committed)."""
        self.drafts = self.p = self.hidden = self.logits = self.num_new = self.token_mask = None
        self.draft_tokens, self.draft_probs = [], []


def batch_seed(seed: int | None, batch: int, wave: int, stream: int) -> int | None:
    """The seed of a wave's generator: stream 0 verifies (rejection sampling), stream 1 drafts."""
    return None if seed is None else seed * 4 + 2 * batch + stream + wave


class Batches:
    """The batches of one generate call over `workers`; see the module docstring. `on_finished(n)` reports rows
    that finished (progress)."""

    def __init__(self, workers: Workers, plan: Plan, seed: int | None, waiting: deque[Request],
                 on_finished=lambda n: None, rows: Callable[[], int] | None = None) -> None:  # noqa: ANN001
        """rows: the rows a wave may admit now (online re-planning; default plan.batch)."""
        self.workers, self.plan, self.seed, self.waiting = workers, plan, seed, waiting
        self.on_finished = on_finished
        self.rows = rows or (lambda: plan.batch)
        self.items = [Batch(n) for n in range(plan.num_batches)]
        self.waves = 0

    def __getitem__(self, index: int) -> Batch:
        return self.items[index]

    @property
    def done(self) -> bool:
        return not self.waiting and not any(b.rows for b in self.items)

    def admit_all(self) -> None:
        """Fill every batch from the queue, splitting it evenly (a short job still interleaves two batches)."""
        shares = len(self.items) if self.rows() <= self.plan.batch else 1  # merged: one batch takes them all
        for n, b in enumerate(self.items):
            self.admit(b, share=max(1, shares - n))

    def admit(self, b: Batch, share: int = 1) -> None:
        """Fill an empty batch with up to `rows()` waiting requests (a `share` of what is waiting). More rows than
        plan.batch (speculation off, merging) only once every other batch has drained: until then it stays empty."""
        limit = self.rows()
        if limit > self.plan.batch and any(o.rows for o in self.items if o is not b):
            limit = 0
        n = min(limit, math.ceil(len(self.waiting) / share))
        b.rows = [self.waiting.popleft() for _ in range(n)]
        b.clear_pass()
        if b.rows:
            self._new_wave(b)
        else:
            self.workers.attention.drop(b.index)
            self.workers.drafter.drop(b.index)

    def retire_finished(self, b: Batch) -> None:
        """After verification: drop the batch's finished rows from it and its caches; refill it when empty."""
        keep = [n for n, r in enumerate(b.rows) if not r.finished]
        if len(keep) == len(b.rows):
            return
        self.on_finished(len(b.rows) - len(keep))
        b.rows = [b.rows[n] for n in keep]
        if keep:
            self.workers.attention.select_rows(b.index, keep)
            self.workers.drafter.select_rows(b.index, keep)
        else:
            self.admit(b)
            if self.rows() <= self.plan.batch:  # speculating: a batch left empty by merging takes rows again
                for other in self.items:
                    if not other.rows and self.waiting:
                        self.admit(other)

    def restart(self, b: Batch) -> None:
        """After a lost worker: forget the pass in flight, retire finished rows, fresh caches for the rest."""
        b.clear_pass()
        keep = [r for r in b.rows if not r.finished]
        self.on_finished(len(b.rows) - len(keep))
        b.rows = keep
        if keep:
            self._new_wave(b)
        else:
            self.admit(b)

    def _new_wave(self, b: Batch) -> None:
        rows = len(b.rows)
        # the longest prompt + output of the batch, plus the k_max + 1 speculative positions of a pass
        capacity = max(len(r.prompt) + r.max_new_tokens for r in b.rows) + self.plan.k_max + 1
        self.workers.attention.reset(b.index, rows, capacity)
        self.workers.verifier.seed(b.index, batch_seed(self.seed, b.index, self.waves, 0))
        self.workers.drafter.reset(b.index, rows, capacity)
        self.workers.drafter.seed(b.index, batch_seed(self.seed, b.index, self.waves, 1))
        self.waves += 1
