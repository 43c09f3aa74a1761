"""The coordinator's state of the interleaved batches: admission, row refill, a fresh wave of worker state, restart.

Batch b in {0, 1} (one batch, b = 0, without a drafter) holds up to `plan.batch` requests. With `refill` (the
default), a row that finishes frees its slot at its batch's verify op and a waiting request takes that slot at
once: its KV rows are emptied in place (`reset_rows`: no other row moves or is copied), and the batch's next
target pass feeds its prompt beside the other rows' decode tokens (pipeline.py; the weights stream once either
way). Without refill (kept as a switch, for benchmarks) a batch is refilled only when every row has finished: a
new *wave*, the batch waiting for its slowest row.

Online re-planning may change the rows a wave admits (`rows`, replan.py): with speculation off, one batch takes the
rows of both once the other has drained (the other then stays empty: its steps run no pass); with speculation back
on, an empty batch is refilled beside the next wave. Each wave gets empty KV caches in the attention worker and the
drafter, sized for its rows (`capacity`). Random draws are per request (runtime/rng.py): nothing here seeds.
After a lost worker, `restart` re-creates a batch's caches for its unfinished rows; its next pass then feeds every
committed token again (pipeline.py).

With a paged target KV (runtime/kv_blocks.py) admission counts blocks: a waiting request is admitted (in queue
order) only while the pool's free blocks, less one per running row for its next pass, hold its first feed (its
tokens up to the pass's `PromptBudget`, plus k_max + 1 positions); with no row running the head of the queue is
admitted anyway. When a pass's blocks do not fit, the pipeline preempts the batch's youngest row (`preempt`): it
leaves its batch, its blocks go back to the pool and it returns to the head of the queue, to be fed again whole
(prompt and output so far, in passes as the `PromptBudget` allows) when admitted: recompute preemption, never an
error and never a lost row. A batch that lost rows to preemption regrows at its next retirement, new rows appended
at its end as blocks admit them (`_regrow`); an empty one takes rows again once blocks are free (`can_admit`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from specoffload.planner.plan import Plan

from ..request import Request, Waiting
from .workers import Workers


@dataclass(frozen=True)
class PromptBudget:
    """Prompt tokens one target pass may feed, over its rows that are not decoding (a new row's prompt, or a row
    fed again whole after a preemption, a restart or a re-placement), shared in row order (pipeline.py `_plan_feed`).

    pace: the planner's budget (`Plan.prefill_chunk`: what the compute headroom under the pass's io holds,
        planner/cost.py `prefill_budget`). It paces those tokens beside the rows a pass decodes; a pass that decodes
        no row (a batch's first fill, every row requeued) has no row to keep waiting and feeds every row whole.
    cap: the user's (`EngineConfig.prefill_chunk`): every pass, decoding rows or not (it bounds the pass's
        activations); it replaces `pace`.
    """

    pace: int | None = None
    cap: int | None = None

    def __post_init__(self) -> None:
        for name in ("pace", "cap"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"PromptBudget.{name} must be >= 1 or None, got {value}")

    def tokens(self, decoding: bool) -> int | None:
        """The budget of a pass that decodes rows (`decoding`) or none; None: no limit."""
        return self.cap if self.cap is not None else self.pace if decoding else None


@dataclass
class Batch:
    """One interleaved batch: its requests, and the tensors of its pass and draft round in flight."""

    index: int
    rows: list[Request] = field(default_factory=list)
    drafts: torch.Tensor | None = None  # [rows, L] proposed for the next target pass (row r: num_drafts[r] real)
    p: torch.Tensor | None = None  # [rows, L, vocab] draft probabilities (sampling only)
    num_drafts: list[int] = field(default_factory=list)  # real drafts per row of `drafts`
    draft_tokens: list[torch.Tensor] = field(default_factory=list)  # L x [rows] during a draft round
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # L x [rows, vocab]
    feed: list[int] | None = None  # committed tokens the next pass feeds per row (a prefill may be cut: chunks)
    ready: list[bool] = field(default_factory=list)  # the next pass reaches the row's pending token: it verifies
    hidden: torch.Tensor | None = None  # [rows, T, H] during a target pass
    num_new: torch.Tensor | None = None  # [rows] tokens fed per row this pass (committed + drafts)
    token_mask: torch.Tensor | None = None  # [rows, T]
    pass_k: int = 0  # width L of the drafts the current pass verifies
    round_k: int = 0  # k of the current draft round
    draft_calls: int = 0  # draft calls the round the next pass verifies made (what the drafter's cache saw)
    committed: list[int] = field(default_factory=list)
    fed_before: list[int] = field(default_factory=list)  # the target cache's length per row before the pass
    logits: torch.Tensor | None = None  # [rows, pass_k + 1, vocab]
    adapt_counts: list[list[int]] | None = None  # routing counts the drafter adapts to at the next round's start

    def clear_pass(self) -> None:
        """Forget the pass and draft round in flight (nothing of them was committed)."""
        self.drafts = self.p = self.hidden = self.logits = self.num_new = self.token_mask = None
        self.feed, self.draft_calls = None, 0
        self.draft_tokens, self.draft_probs, self.num_drafts, self.ready = [], [], [], []


class Batches:
    """The batches of one generate call over `workers`; see the module docstring. `on_finished(n)` reports rows
    that finished (progress)."""

    def __init__(self, workers: Workers, plan: Plan, waiting: Waiting | Iterable[Request],
                 on_finished: Callable[[int], object] = lambda n: None, rows: Callable[[], int] | None = None,
                 refill: bool = True, on_retired: Callable[[Request], object] = lambda r: None,
                 prompts: PromptBudget = PromptBudget()) -> None:
        """rows: the rows a wave may admit now (online re-planning; default plan.batch); refill: a finished row's
        slot takes a waiting request at once (False: only when the whole batch has finished). on_finished(n): n
        rows finished (progress); on_retired(r): request r finished and left its batch. prompts: the prompt tokens
        a pass feeds (a paged KV admits by the blocks of a request's first feed)."""
        self.workers, self.plan = workers, plan
        self.waiting = waiting if isinstance(waiting, Waiting) else Waiting(waiting)
        self.on_finished, self.on_retired = on_finished, on_retired
        self.rows = rows or (lambda: plan.batch)
        self.refill = refill
        self.items = [Batch(n) for n in range(plan.num_batches)]
        self.waves = 0
        self.refilled = 0  # rows admitted into a running batch's freed slots
        self.prompts = prompts
        self.block_size = workers.attention.block_size()  # paged target KV: positions per block (0: contiguous)
        self.preempted = 0  # rows preempted to free KV blocks (each fed again whole later)
        self._order: dict[int, int] = {}  # id(request) -> admission order (the youngest row is preempted first)
        self._admissions = 0

    def __getitem__(self, index: int) -> Batch:
        return self.items[index]

    @property
    def done(self) -> bool:
        """No row in any batch, none waiting, none to come (a feed: closed and drained)."""
        return not any(b.rows for b in self.items) and self.waiting.ended

    @property
    def idle(self) -> bool:
        """No row in any batch but more may come (an open feed): the schedule waits for them."""
        return not any(b.rows for b in self.items) and not self.waiting.ended

    def can_admit(self, b: Batch) -> bool:
        """Over a feed: whether batch b has free slots (below rows(), not merging) and requests have arrived. With
        a paged KV: also whether b, left empty by preemption, can take a waiting request now."""
        if self.waiting.streaming:
            return self.rows() <= self.plan.batch and len(b.rows) < self._limit(b) and bool(self.waiting)
        return bool(self.block_size) and not b.rows and self._limit(b) > 0 and self._fit(1, whole=True) > 0

    def grow(self, b: Batch) -> None:
        """Over a feed, rows arrive after a batch was admitted: fill b's free slots with them as a new wave (the
        KV caches are sized by rows at a wave's start). b's unfinished rows keep their committed tokens, and its next
        pass feeds them again, as after a lost worker (`restart`). Call only where no op of b is in flight (its own
        verify, or with the executor idle)."""
        if not self.can_admit(b):
            return
        live = [r for r in b.rows if not r.finished]
        b.clear_pass()
        b.rows = live + self._take(self._limit(b) - len(live), whole=True)
        self._new_wave(b)

    def admit_all(self) -> None:
        """Fill every batch from the queue, splitting it evenly (a short job still interleaves two batches)."""
        shares = len(self.items) if self.rows() <= self.plan.batch else 1  # merged: one batch takes them all
        for n, b in enumerate(self.items):
            self.admit(b, share=max(1, shares - n))

    def admit(self, b: Batch, share: int = 1) -> None:
        """Fill an empty batch with up to `rows()` waiting requests (a `share` of what is waiting). More rows than
        plan.batch (speculation off, merging) only once every other batch has drained: until then it stays empty."""
        limit = self._limit(b)
        n = min(limit, math.ceil(self.waiting.available(limit * share) / share))
        b.rows = self._take(n, whole=True)
        b.clear_pass()
        if b.rows:
            self._new_wave(b)
        else:
            self.workers.attention.drop(b.index)
            self.workers.drafter.drop(b.index)

    def retire_finished(self, b: Batch) -> None:
        """After verification: drop the batch's finished rows; refill their slots from the queue (with `refill`),
        or the whole batch once it is empty."""
        finished = [n for n, r in enumerate(b.rows) if r.finished]
        if not finished:
            return
        self.on_finished(len(finished))
        for n in finished:
            self.on_retired(b.rows[n])
            self._order.pop(id(b.rows[n]), None)
        if self.block_size:  # the finished rows' blocks go back to the pool first: admission counts them free
            self.workers.attention.reset_rows(b.index, finished, self._capacity(b.rows))
        take = 0
        # (merging the rows of both batches into one, speculation off, goes through a new wave of the larger size:
        # slots are refilled only while a batch keeps its size)
        if self.refill and self.waiting and self.rows() <= self.plan.batch:
            live = len(b.rows) - len(finished)
            take = min(len(finished), max(0, self._limit(b) - live))
        new = self._take(take, retiring=len(finished), whole=len(finished) == len(b.rows)) if take else []
        take = len(new)
        if take:
            slots = finished[:take]
            for n, r in zip(slots, new):
                b.rows[n] = r
            capacity = self._capacity(b.rows)
            self.workers.attention.reset_rows(b.index, slots, capacity)
            self.workers.drafter.reset_rows(b.index, slots, capacity)
            self.refilled += take
        gone = set(finished[take:])
        if not gone:
            self._regrow(b)
            return
        keep = [n for n in range(len(b.rows)) if n not in gone]
        b.rows = [b.rows[n] for n in keep]
        if keep:
            self.workers.attention.select_rows(b.index, keep)
            self.workers.drafter.select_rows(b.index, keep)
            self._regrow(b)
            return
        self.admit(b)
        if self.rows() <= self.plan.batch:  # speculating: a batch left empty by merging takes rows again
            for other in self.items:
                if not other.rows and self.waiting:
                    self.admit(other)

    def preempt(self, b: Batch) -> int:
        """Take b's youngest row out of the batch (its KV blocks back to the pool) and put its request back at the
        head of the queue, to be fed again whole when admitted (module docstring). Returns the row's old index.
        Call only where no op of b is in flight (its pass's first op, before any write)."""
        n = max(range(len(b.rows)), key=lambda i: self._order.get(id(b.rows[i]), 0))
        request = b.rows[n]
        keep = [i for i in range(len(b.rows)) if i != n]
        b.rows = [b.rows[i] for i in keep]
        self.workers.attention.select_rows(b.index, keep)
        self.workers.drafter.select_rows(b.index, keep)
        self._order.pop(id(request), None)
        self.waiting.push_front(request)
        self.preempted += 1
        return n

    def requeue_all(self) -> Waiting:
        """Re-placement (pipeline.py, step 6): every batch's unfinished rows back at the head of the queue, oldest
        admission first, each to be fed again whole when admitted (as a preempted row is); finished rows retired.
        Their caches stay with the workers being replaced. Returns the queue, for the next `Batches`. Call only
        where no op is in flight."""
        rows = []
        for b in self.items:
            b.clear_pass()
            done = [r for r in b.rows if r.finished]
            if done:
                self.on_finished(len(done))
            for r in done:
                self.on_retired(r)
            rows += [r for r in b.rows if not r.finished]
            b.rows = []
        rows.sort(key=lambda r: self._order.get(id(r), 0))
        for r in reversed(rows):
            self.waiting.push_front(r)
        self._order.clear()
        return self.waiting

    def restart(self, b: Batch) -> None:
        """After a lost worker: forget the pass in flight, retire finished rows, fresh caches for the rest."""
        b.clear_pass()
        keep = [r for r in b.rows if not r.finished]
        self.on_finished(len(b.rows) - len(keep))
        for r in b.rows:
            if r.finished:
                self.on_retired(r)
        b.rows = keep
        if keep:
            self._new_wave(b)
        else:
            self.admit(b)

    def _limit(self, b: Batch) -> int:
        """Rows batch b may hold now: rows(), or none while merging rows of both batches into another one."""
        limit = self.rows()
        if limit > self.plan.batch and any(o.rows for o in self.items if o is not b):
            limit = 0
        return limit

    def _regrow(self, b: Batch) -> None:
        """Paged KV, refilling: a running batch below its size (it lost rows to preemption) takes waiting requests
        into new rows at its end, as blocks admit them (no other row moves)."""
        if not (self.block_size and self.refill and b.rows and self.rows() <= self.plan.batch and self.waiting):
            return
        new = self._take(self._limit(b) - len(b.rows))
        if new:
            b.rows += new
            capacity = self._capacity(b.rows)
            self.workers.attention.add_rows(b.index, len(new), capacity)
            self.workers.drafter.add_rows(b.index, len(new), capacity)
            self.refilled += len(new)

    def _take(self, n: int, retiring: int = 0, whole: bool = False) -> list[Request]:
        """Pop up to n waiting requests, as many as the KV pool's free blocks admit now (module docstring);
        retiring: rows of the caller's batch that are leaving (not counted as running); whole: the rows taken make
        up the batch's every row (its first pass decodes none, and feeds each row whole: pipeline.py `_plan_feed`)."""
        n = self._fit(n, retiring, whole)
        taken = [self.waiting.popleft() for _ in range(n)]
        for r in taken:
            self._admissions += 1
            self._order[id(r)] = self._admissions
        return taken

    def _fit(self, n: int, retiring: int = 0, whole: bool = False) -> int:
        """How many of the first n waiting requests may be admitted now: all that are there with contiguous caches;
        with a paged KV, those (in queue order) whose first feed (their tokens up to the prompt budget of a pass that
        decodes rows, or of one that decodes none when `whole`) fits the free blocks less one per running row."""
        if n <= 0:
            return 0
        if not self.block_size:
            return min(n, self.waiting.available(n))
        running = sum(len(b.rows) for b in self.items) - retiring
        free = self.workers.attention.free_blocks() - running
        fit, budget = 0, self.prompts.tokens(decoding=not whole)
        for r in self.waiting.peek(n):
            first = r.num_tokens if budget is None else min(r.num_tokens, budget)
            need = -(-(first + self.plan.k_max + 1) // self.block_size)
            if need > free and (fit or running > 0):
                break
            free -= need
            fit += 1
        return fit

    def _capacity(self, rows: list[Request]) -> int:
        """KV positions per row: the longest prompt + output of the rows, plus the k_max + 1 speculative positions
        of a pass."""
        return max(len(r.prompt) + r.max_new_tokens for r in rows) + self.plan.k_max + 1

    def _new_wave(self, b: Batch) -> None:
        rows, capacity = len(b.rows), self._capacity(b.rows)
        self.workers.attention.reset(b.index, rows, capacity)
        self.workers.drafter.reset(b.index, rows, capacity)
        self.waves += 1
