"""`ResidentRunner`: every weight resident where compute runs (no `device_memory`): continuous batching around the
speculative core (speculative.py), in one process (CPU or CUDA).

Rows are decoded together up to `plan.batch`; a finished row's slot is refilled from the waiting requests and its
prompt prefilled on its own (all but its last token), while the other rows keep their caches. Each step the
drafter (offload/drafters.py: the same `Drafter` objects as the offloaded pipeline, batch 0) proposes a round of
draft tokens, row r keeping min(k, its remaining - 1); the target verifies them in one pass (k = 0: plain batched
decoding).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sized

import torch
from tqdm import tqdm

from specoffload.planner.plan import Plan

from .kv_cache import KVCache
from .logits_process import process_rows, record_logprobs
from .models.model import Transformer
from .offload.drafters import Drafter, ModelDrafter, NoDrafter
from .request import Feed, MappedFeed, Request, Waiting
from .sampling import SamplingParams
from .speculative import (
    DRAFT,
    VERIFY,
    StepTimes,
    commit,
    cut_drafts,
    draft_lengths,
    draw_seeds,
    kept_lengths,
    pad_right,
    row_warps,
    verify_rows,
)
from .stats import GenerateStats, request_totals

IDLE_WAIT_S = 0.05  # seconds an idle runner (no row, its feed open) waits for requests before looking again
BATCH = 0  # the resident runner's one batch, in the drafter's per-batch state
GREEDY = SamplingParams()  # the params beside per-row warps (a batch of greedy rows passes no warps)


class ResidentRunner:
    """See the module docstring. `draft` is loaded only when the plan speculates; drafter: a drafter without a model
    of its own (a model-free one) to use instead."""

    def __init__(self, target: Transformer, draft: Transformer | None, plan: Plan,
                 drafter: Drafter | None = None) -> None:
        self.target, self.plan = target, plan
        # Everything is resident: load now, not inside the first timed step.
        self.target.preload()
        if not plan.drafting:
            drafter = NoDrafter()
        elif drafter is None:
            drafter = ModelDrafter(None, model=draft) if draft is not None else NoDrafter()
        self.drafter: Drafter = drafter
        self.last_stats: GenerateStats | None = None

    def run(self, requests: list[Request], params: SamplingParams | None = None,
            progress: bool = False) -> GenerateStats:
        """Run every request to the end (each row at its own warping: `Request.warp`); returns the totals."""
        for _ in self.stream(requests, progress):
            pass
        assert self.last_stats is not None
        return self.last_stats

    def stream(self, requests: Iterable[Request] | Feed[Request] | MappedFeed[Request],
               progress: bool = False) -> Iterator[Request]:
        """Yield each request as its row finishes, pulling new ones from `requests` (a list, a lazy iterator, or a
        `Feed` filled while it runs: idle while it is open and empty) as slots free up; `last_stats` holds the
        totals once the stream is exhausted."""
        start = time.perf_counter()
        self.last_stats = None
        k = self.plan.k if self.plan.drafting else 0
        rows = self.plan.batch
        capacity = 16  # grows with the rows admitted (their prompt + output + the k + 1 positions of a step)
        t_cache = self.target.new_cache(rows, capacity)
        self.drafter.reset(BATCH, rows, capacity)
        times = StepTimes()
        waiting = Waiting(requests)
        slots: list[Request | None] = [None] * rows
        bar = tqdm(total=len(requests) if isinstance(requests, Sized) else None, desc="generate", unit="prompt",
                   disable=not progress)
        prefill_s = 0.0
        steps = 0
        done: list[Request] = []
        try:
            while True:
                t0 = time.perf_counter()
                if waiting.streaming and len(slots) < rows and waiting:  # a feed's rows after the batch shrank
                    slots, t_cache = self._grow(slots, t_cache, rows)
                self._admit(waiting, slots, t_cache, k)
                prefill_s += time.perf_counter() - t0
                if not waiting and any(s is None for s in slots):
                    keep = [i for i, s in enumerate(slots) if s is not None]
                    if not keep and waiting.ended:
                        break
                    t_cache.select_rows(keep)
                    self.drafter.select_rows(BATCH, keep)
                    slots = [slots[i] for i in keep]
                if not slots:  # an open feed, empty for now: idle until requests arrive (or it closes)
                    if waiting.ended:
                        break
                    waiting.wait(IDLE_WAIT_S)
                    continue
                active: list[Request] = [s for s in slots if s is not None]
                if not active:  # a feed's requests arrived since this round's admission: admit them
                    continue
                self._step(active, t_cache, k, times)
                steps += 1
                for i, r in enumerate(slots):
                    if r is not None and r.finished:
                        slots[i] = None
                        bar.update(1)
                        done.append(r)
                        yield r
        finally:
            self.drafter.drop(BATCH)
            bar.close()
        self.last_stats = GenerateStats(
            **request_totals(done),
            steps=steps,
            wall_s=time.perf_counter() - start,
            prefill_s=prefill_s,
            draft_s=times.draft,
            target_s=times.target,
            verify_s=times.verify,
        )

    def _grow(self, slots: list[Request | None], t_cache: KVCache, rows: int) -> tuple[list[Request | None], KVCache]:
        """Back to `rows` slots (a feed's requests arrived after finished rows shrank the batch): the live rows keep
        their target KV (copied into a cache of `rows` rows); the drafter starts over and re-reads their tokens at
        its next round (its lengths are 0)."""
        grown = self.target.new_cache(rows, t_cache.capacity)
        if slots:
            grown.assign_rows(list(range(len(slots))), t_cache)
        self.drafter.reset(BATCH, rows, t_cache.capacity)
        return slots + [None] * (rows - len(slots)), grown

    def _admit(self, waiting: Waiting, slots: list[Request | None], t_cache: KVCache, k: int) -> None:
        """Fill free slots from the queue and prefill the new rows in the target (all but their last prompt token;
        the drafter takes their prompts at its next round)."""
        free = [i for i, s in enumerate(slots) if s is None]
        new = [(i, waiting.popleft()) for i in free[: waiting.available(len(free))]]
        if not new:
            return
        for i, r in new:
            slots[i] = r
        rows = [i for i, _ in new]
        capacity = max(len(r.prompt) + r.max_new_tokens for _, r in new) + k + 1
        self.drafter.reset_rows(BATCH, rows, capacity)
        t_cache.ensure_capacity(capacity)
        t_cache.reset_rows(rows)
        prefixes = [r.prompt[:-1] for _, r in new]
        if max(len(p) for p in prefixes) == 0:
            return
        ids, num_new = pad_right(prefixes)  # rows with a one-token prompt have num_new 0
        tmp = self.target.new_cache(len(rows), ids.shape[1])
        self.target.forward(ids, tmp, num_new=num_new, output_positions=None, compute_logits=False)
        t_cache.assign_rows(rows, tmp)

    def _step(self, active: list[Request], t_cache: KVCache, k: int, times: StepTimes) -> None:
        t0 = time.perf_counter()
        num_drafts = draft_lengths(active, k, [len(r.output) > 0 for r in active])  # a row's first verify: no drafts
        warps = row_warps(active)  # None: every row greedy
        calls = 0  # draft calls made (a drafter may end the round early: `cut_drafts`)
        p = None
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        if max(num_drafts) >= 1:
            d_len = self.drafter.lengths(BATCH)
            ids, num_new = pad_right([r.tokens[d_len[n]:] for n, r in enumerate(active)])  # [rows, T]
            while calls < max(num_drafts):
                seeds = None if warps is None else draw_seeds(active, DRAFT, calls)
                token, prob = self.drafter.propose(BATCH, ids, num_new, GREEDY, seeds, warps)  # [rows], [rows, V]
                num_drafts = cut_drafts(num_drafts, token, calls)
                tokens.append(token.clamp_min(0))
                if prob is not None:
                    probs.append(prob)
                ids, num_new = token[:, None], torch.ones(len(active), dtype=torch.long)
                calls += 1
        width = max(num_drafts)  # <= calls (draft ids live on the host)
        drafts = (torch.stack(tokens, dim=1)[:, :width].cpu() if tokens  # [rows, L]
                  else torch.zeros((len(active), 0), dtype=torch.long))
        if probs:
            p = torch.stack(probs, dim=1)[:, :width]  # [rows, L, vocab]
        t1 = time.perf_counter()
        pending = torch.tensor([r.tokens[-1] for r in active], dtype=torch.long)  # [rows]
        ids = torch.cat([pending[:, None], drafts], dim=1)  # [rows, L + 1]
        # ragged: row r feeds its pending token and its n_r drafts (a row with none costs one token)
        fed = torch.tensor([1 + n for n in num_drafts], dtype=torch.long)  # [rows]
        logits = self.target.forward(ids, t_cache, num_new=fed)  # [rows, L + 1, vocab]
        t2 = time.perf_counter()
        seeds = None if warps is None else draw_seeds(active, VERIFY)
        logits = process_rows(active, logits, drafts)  # penalties, min_tokens: q is the processed target
        accepted, emitted = verify_rows(logits, drafts, num_drafts, p, GREEDY, seeds, warps)
        before = [len(r.output) for r in active]
        committed = commit(active, accepted, emitted, num_drafts)
        record_logprobs(active, logits, before)
        target, drafter = kept_lengths(committed, accepted, calls)
        t_cache.truncate(torch.tensor(target, dtype=torch.long))
        if calls >= 1:
            self.drafter.truncate(BATCH, drafter)
        t3 = time.perf_counter()
        times.draft += t1 - t0
        times.target += t2 - t1
        times.verify += t3 - t2
