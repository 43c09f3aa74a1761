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
from collections import deque

import torch
from tqdm import tqdm

from specoffload.planner.plan import Plan

from .kv_cache import KVCache
from .models.model import Transformer
from .offload.drafters import Drafter, ModelDrafter, NoDrafter
from .request import Request
from .sampling import SamplingParams
from .speculative import (
    DRAFT,
    VERIFY,
    StepTimes,
    commit,
    draft_lengths,
    draw_seeds,
    kept_lengths,
    pad_right,
    verify_rows,
)
from .stats import GenerateStats, request_totals

BATCH = 0  # the resident runner's one batch, in the drafter's per-batch state


class ResidentRunner:
    """See the module docstring. `draft` is loaded only when the plan speculates."""

    def __init__(self, target: Transformer, draft: Transformer | None, plan: Plan) -> None:
        self.target, self.plan = target, plan
        # Everything is resident: load now, not inside the first timed step.
        self.target.preload()
        self.drafter: Drafter = ModelDrafter(None, model=draft) if draft is not None and plan.drafting else NoDrafter()

    def run(self, requests: list[Request], params: SamplingParams, progress: bool = False) -> GenerateStats:
        start = time.perf_counter()
        k = self.plan.k if self.plan.drafting else 0
        # Room for the longest prompt, its output, and the k + 1 speculative positions of a step.
        capacity = max(len(r.prompt) + r.max_new_tokens for r in requests) + k + 1
        rows = min(self.plan.batch, len(requests))
        t_cache = self.target.new_cache(rows, capacity)
        self.drafter.reset(BATCH, rows, capacity)
        times = StepTimes()
        waiting = deque(requests)
        slots: list[Request | None] = [None] * rows
        bar = tqdm(total=len(requests), desc="generate", unit="prompt", disable=not progress)
        prefill_s = 0.0
        steps = 0
        while True:
            t0 = time.perf_counter()
            self._admit(waiting, slots, t_cache, capacity)
            prefill_s += time.perf_counter() - t0
            if not waiting and any(s is None for s in slots):
                keep = [i for i, s in enumerate(slots) if s is not None]
                if not keep:
                    break
                t_cache.select_rows(keep)
                self.drafter.select_rows(BATCH, keep)
                slots = [slots[i] for i in keep]
            active: list[Request] = [s for s in slots if s is not None]
            self._step(active, t_cache, k, params, times)
            steps += 1
            for i, r in enumerate(slots):
                if r is not None and r.finished:
                    slots[i] = None
                    bar.update(1)
        self.drafter.drop(BATCH)
        bar.close()
        return GenerateStats(
            **request_totals(requests),
            steps=steps,
            wall_s=time.perf_counter() - start,
            prefill_s=prefill_s,
            draft_s=times.draft,
            target_s=times.target,
            verify_s=times.verify,
        )

    def _admit(self, waiting: deque[Request], slots: list[Request | None], t_cache: KVCache, capacity: int) -> None:
        """Fill free slots from the queue and prefill the new rows in the target (all but their last prompt token;
        the drafter takes their prompts at its next round)."""
        free = [i for i, s in enumerate(slots) if s is None]
        new = [(i, waiting.popleft()) for i in free[: len(waiting)]]
        if not new:
            return
        for i, r in new:
            slots[i] = r
        rows = [i for i, _ in new]
        self.drafter.reset_rows(BATCH, rows, capacity)
        t_cache.reset_rows(rows)
        prefixes = [r.prompt[:-1] for _, r in new]
        if max(len(p) for p in prefixes) == 0:
            return
        ids, num_new = pad_right(prefixes)  # rows with a one-token prompt have num_new 0
        tmp = self.target.new_cache(len(rows), ids.shape[1])
        self.target.forward(ids, tmp, num_new=num_new, output_positions=None, compute_logits=False)
        t_cache.assign_rows(rows, tmp)

    def _step(self, active: list[Request], t_cache: KVCache, k: int, params: SamplingParams,
              times: StepTimes) -> None:
        t0 = time.perf_counter()
        num_drafts = draft_lengths(active, k, [len(r.output) > 0 for r in active])  # a row's first verify: no drafts
        calls = max(num_drafts)
        drafts = torch.zeros((len(active), 0), dtype=torch.long)  # [rows, L]
        p = None
        if calls >= 1:
            d_len = self.drafter.lengths(BATCH)
            ids, num_new = pad_right([r.tokens[d_len[n]:] for n, r in enumerate(active)])  # [rows, T]
            tokens, probs = [], []
            for t in range(calls):
                seeds = None if params.greedy else draw_seeds(active, DRAFT, t)
                token, prob = self.drafter.propose(BATCH, ids, num_new, params, seeds)  # [rows], [rows, vocab]
                tokens.append(token)
                if prob is not None:
                    probs.append(prob)
                ids, num_new = token[:, None], torch.ones(len(active), dtype=torch.long)
            drafts = torch.stack(tokens, dim=1)  # [rows, L]
            p = torch.stack(probs, dim=1) if probs else None  # [rows, L, vocab]
        t1 = time.perf_counter()
        pending = torch.tensor([r.tokens[-1] for r in active], dtype=torch.long)  # [rows]
        ids = torch.cat([pending[:, None], drafts], dim=1)  # [rows, L + 1]
        logits = self.target.forward(ids, t_cache)  # [rows, L + 1, vocab]
        t2 = time.perf_counter()
        seeds = None if params.greedy else draw_seeds(active, VERIFY)
        accepted, emitted = verify_rows(logits, drafts, num_drafts, p, params, seeds)
        committed = commit(active, accepted, emitted, num_drafts)
        target, drafter = kept_lengths(committed, accepted, calls)
        t_cache.truncate(torch.tensor(target, dtype=torch.long))
        if calls >= 1:
            self.drafter.truncate(BATCH, drafter)
        t3 = time.perf_counter()
        times.draft += t1 - t0
        times.target += t2 - t1
        times.verify += t3 - t2
