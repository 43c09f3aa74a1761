"""`ResidentRunner`: every weight resident where compute runs (no `device_memory`): continuous batching around a
lossless speculative step, in one process (CPU or CUDA).

Rows are decoded together up to `plan.batch`; a finished row's slot is refilled from the waiting requests and
prefilled on its own (all but its last prompt token), while the other rows keep their caches. Each step drafts
k tokens per row with the draft model (k = 0: plain batched decoding) and verifies them in one target pass
(speculative.py).
"""

from __future__ import annotations

import time
from collections import deque

import torch
from tqdm import tqdm

from specoffload.planner.plan import Plan

from .kv_cache import KVCache
from .models.model import Transformer
from .request import Request
from .sampling import SamplingParams
from .speculative import SpeculativeStep, StepTimes, pad_right
from .stats import GenerateStats, request_totals


class ResidentRunner:
    """See the module docstring. `draft` is loaded only when the plan speculates."""

    def __init__(self, target: Transformer, draft: Transformer | None, plan: Plan) -> None:
        self.target, self.draft, self.plan = target, draft if plan.drafting else None, plan
        # Everything is resident: load now, not inside the first timed step.
        for model in (self.target, self.draft):
            if model is not None:
                model.preload()

    def run(self, requests: list[Request], params: SamplingParams, progress: bool = False) -> GenerateStats:
        start = time.perf_counter()
        k = self.plan.k
        # Room for the longest prompt, its output, and the k + 1 speculative positions of a step.
        capacity = max(len(r.prompt) + r.max_new_tokens for r in requests) + k + 1
        rows = min(self.plan.batch, len(requests))
        t_cache = self.target.new_cache(rows, capacity)
        d_cache = self.draft.new_cache(rows, capacity) if self.draft is not None else None
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        step = SpeculativeStep(self.target, self.draft, params, generator)
        times = StepTimes()
        waiting = deque(requests)
        slots: list[Request | None] = [None] * rows
        bar = tqdm(total=len(requests), desc="generate", unit="prompt", disable=not progress)
        prefill_s = 0.0
        steps = 0
        while True:
            t0 = time.perf_counter()
            self._admit(waiting, slots, t_cache, d_cache)
            prefill_s += time.perf_counter() - t0
            if not waiting and any(s is None for s in slots):
                keep = [i for i, s in enumerate(slots) if s is not None]
                if not keep:
                    break
                t_cache.select_rows(keep)
                if d_cache is not None:
                    d_cache.select_rows(keep)
                slots = [slots[i] for i in keep]
            active: list[Request] = [s for s in slots if s is not None]
            # Never draft past the longest remaining budget.
            k_step = min(k, max(r.remaining for r in active) - 1)
            self._step(step, active, t_cache, d_cache, k_step, times)
            steps += 1
            for i, r in enumerate(slots):
                if r is not None and r.finished:
                    slots[i] = None
                    bar.update(1)
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

    def _admit(self, waiting: deque[Request], slots: list[Request | None], t_cache: KVCache,
               d_cache: KVCache | None) -> None:
        """Fill free slots from the queue and prefill the new rows (all but their last prompt token)."""
        free = [i for i, s in enumerate(slots) if s is None]
        new = [(i, waiting.popleft()) for i in free[: len(waiting)]]
        if not new:
            return
        for i, r in new:
            slots[i] = r
        rows = [i for i, _ in new]
        prefixes = [r.prompt[:-1] for _, r in new]
        for model, cache in ((self.target, t_cache), (self.draft, d_cache)):
            if model is None or cache is None:
                continue
            cache.reset_rows(rows)
            if max(len(p) for p in prefixes) == 0:
                continue
            ids, num_new = pad_right(prefixes)  # rows with a one-token prompt have num_new 0
            tmp = model.new_cache(len(rows), ids.shape[1])
            model.forward(ids, tmp, num_new=num_new, output_positions=None, compute_logits=False)
            cache.assign_rows(rows, tmp)

    def _step(self, step: SpeculativeStep, active: list[Request], t_cache: KVCache, d_cache: KVCache | None,
              k: int, times: StepTimes) -> None:
        committed = [r.num_tokens for r in active]
        t0 = time.perf_counter()
        draft_tokens = torch.zeros((len(active), 0), dtype=torch.long)  # [batch, k]
        p = None
        if k >= 1 and d_cache is not None:
            d_len = d_cache.lengths.tolist()
            unfed = [r.tokens[d_len[b]:] for b, r in enumerate(active)]
            draft_tokens, p = step.propose(d_cache, unfed, k)
        t1 = time.perf_counter()
        pending = torch.tensor([r.tokens[-1] for r in active], dtype=torch.long)  # [batch]
        result = step.verify(t_cache, pending, draft_tokens, p)
        t2 = time.perf_counter()
        accepted = result.num_accepted.tolist()
        emitted = result.tokens.tolist()
        for b, r in enumerate(active):
            n = accepted[b]
            r.num_drafted += k
            r.num_accepted += n
            r.commit(emitted[b][: n + 1])
        # Target cache: keep pending + the n accepted drafts (the new last token is pending).
        t_cache.truncate(torch.tensor([c + n for c, n in zip(committed, accepted)], dtype=torch.long))
        if d_cache is not None and k >= 1:
            # Draft cache saw committed + d_1..d_{k-1}; keep what the target accepted.
            d_cache.truncate(torch.tensor([c + min(n, k - 1) for c, n in zip(committed, accepted)],
                                          dtype=torch.long))
        t3 = time.perf_counter()
        times.draft += t1 - t0
        times.target += t2 - t1
        times.verify += t3 - t2
