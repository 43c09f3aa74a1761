"""`Pipeline`: the interleaved two-batch schedule over a `Workers` bundle, for one engine.

The life of a `run` (the engine has encoded the prompts into requests):
  1. `Batches.admit_all` fills the batches from the queue (two with a drafter, one without).
  2. `PipelineSchedule` emits the ops of step i (schedule.py): the target pass over batch A = i % 2 (load,
     embed, attention, ffn, head, verify) and k draft ops for batch B. `OpExecutor` runs them on the io / cpu /
     device threads with real overlap; each op handler below is a few calls on the workers.
  3. A target pass feeds each row its committed tokens not yet in the target's KV cache (the whole prompt for a
     new row: prefill is the same layer-streamed pass, beside the other rows' decode tokens) plus the row's draft
     tokens; prompt tokens are paced by a per-pass budget (`PromptBudget`: a longer prefill continues in the batch's
     next passes, the row verifying once its prompt is in; beside no decoding row, as at a batch's first fill, the
     planner's budget lets every prompt in whole). Drafts are ragged: row r verifies n_r = min(k, its
     remaining - 1) of them, or fewer when the drafter proposes fewer (a model-free drafter without a match).
     Propose, verify, commit and truncate are runtime/speculative.py's, as in the resident
     runner, so greedy outputs are identical token for token.
  4. A finished row's slot is refilled from the queue at its batch's verify op (`Batches.retire_finished`). Over
     a `Feed` (runtime/request.py: requests put while the stream runs, e.g. a replica's leased chunks) nothing
     blocks on the queue: rows that arrive fill an empty batch before its next step, or a running batch below its
     size at its verify (`Batches.grow`: a new wave, its rows fed again), and with every batch empty and the feed
     open the schedule waits on the feed instead of running empty steps.
  5. If an op fails, the `Recovery` policy may restore the workers (the Ray backend restarts a lost actor); the
     batches then restart from their committed tokens and the schedule runs again. The local backend's policy
     never recovers: the error propagates.
  6. Re-placement (a `Replacer`: the engine, local backend, batch "auto"): when the replanner finds the profile the
     plan was made on off (offload/replan.py `replace_due`: compute or stream rate beyond its margin), the engine is
     asked once per run for a better plan for the rows the job has left (runtime/planning.py `replacement`). If one
     pays, the ops in flight finish, every unfinished row goes back to the head of the queue (as a preempted row:
     its committed tokens are fed again; those filling the new batches, in one pass), the workers are rebuilt
     under the new plan's placement (batch, k, KV and resident weights), and the schedule runs on with them.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import NamedTuple, Protocol

import torch
from tqdm import tqdm

from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.plan import Plan

from ..logits_process import process_rows, record_logprobs
from ..request import Feed, MappedFeed, Request, Waiting
from ..sampling import SamplingParams
from ..speculative import (
    DRAFT,
    VERIFY,
    commit,
    cut_drafts,
    draft_lengths,
    draw_seeds,
    kept_lengths,
    pad_right,
    row_warps,
)
from ..stats import OffloadStats, RequestTotals
from ..trace import Tracer
from .batches import Batch, Batches, PromptBudget
from .executor import OpExecutor
from .replan import Replanner
from .schedule import Op, PipelineSchedule
from .workers import WeightPlan, Workers

#: seconds an idle schedule (every batch empty, its feed open) waits for requests before looking again
IDLE_WAIT_S = 0.05
VERIFY_LOG_PASSES = 1 << 16  # verify passes `verify_log` keeps (the last ones)
#: the params the workers get beside per-row warps (a batch of greedy rows passes no warps and verifies greedily)
GREEDY = SamplingParams(temperature=0.0)


class Recovery(Protocol):
    """What to do when an op (or an admission) fails mid-generation."""

    def recover(self, error: BaseException) -> bool:
        """Restore the workers after `error`; True if generation may go on from the committed tokens."""
        ...


class Replacer(Protocol):
    """Re-placement of a running job (module docstring, step 6): the engine."""

    def propose(self, rows_left: int, tokens_left: float, refeed_tokens: int) -> Plan | None:
        """A better plan for what the job has left, or None (nothing better, or not worth the switch)."""

    def adopt(self, plan: Plan) -> Adopted:
        """Release the current workers, build the new plan's; what the pipeline runs with from now on."""


class Adopted(NamedTuple):
    """What a pipeline runs with after a re-placement."""

    plan: Plan
    weights: WeightPlan
    workers: Workers
    replanner: Replanner
    prompts: PromptBudget


class NoRecovery:
    """The local backend: a failure is final."""

    def recover(self, error: BaseException) -> bool:
        return False


class Pipeline:
    """Runs requests through the interleaved schedule; see the module docstring."""

    def __init__(self, plan: Plan, weights: WeightPlan, num_layers: int, workers: Workers, replanner: Replanner,
                 tracer: Tracer, recovery: Recovery | None = None, compute_threads: int | None = None,
                 adapt_interval: int = 0, refill: bool = True, prompts: PromptBudget | None = None,
                 replacer: Replacer | None = None) -> None:
        """adapt_interval: every this many verify rounds (and after the first), the drafter gets the target's
        routing counts (`Drafter.adapt`, e.g. to migrate its resident experts; traced as "migrate"); 0: never.
        refill: a finished row's slot takes a waiting request at once (Batches); prompts: the prompt tokens a pass
        feeds (`PromptBudget`). replacer: re-places the job when its passes say the plan is wrong (module
        docstring, step 6); None: never."""
        self.refill, self.prompts = refill, prompts or PromptBudget()
        self.plan, self.weights, self.num_layers = plan, weights, num_layers
        self.workers, self.replanner, self.tracer = workers, replanner, tracer
        self.recovery = recovery or NoRecovery()
        self.compute_threads = compute_threads or torch.get_num_threads()
        self._adapt_every = adapt_interval
        self.adapt_interval = adapt_interval if plan.drafting else 0
        self.replacer = replacer
        #: the re-placements of the current run: {"pass", "from", "to"} (plans described), at most one a run
        self.replacements: list[dict[str, object]] = []
        self._switch_to: Plan | None = None  # a plan the schedule stopped for (`_run_schedule`)
        self._pulled = 0  # requests taken from the run's source so far
        self._total: int | None = None  # the run's requests, when its source has a length
        self.verified = 0  # verify ops run in the current run (progress reports)
        #: per verify op of the current run: (perf_counter at its end, batch, tokens it committed, rows), the last
        #: VERIFY_LOG_PASSES of them (a long job's memory stays flat); the steady-state decode rate of a window of
        #: passes is read off it (scripts/bench_moe.py)
        self.verify_log: deque[tuple[float, int, int, int]] = deque(maxlen=VERIFY_LOG_PASSES)
        #: tokens committed by the verify passes of the current run so far (live progress: the CLI's rate)
        self.committed_tokens = 0
        #: seconds the io thread spent in load ops (reading and converting weights into slots), and its value at
        #: the last verify: the loads between two verifies are attributed to the later pass (replan.py)
        self.load_seconds = self.load_mark = 0.0
        self.running = False
        self.last_stats: OffloadStats | None = None

    def run(self, requests: list[Request], progress: bool = False) -> OffloadStats:
        """Run every request to the end (each row at its own warping: `Request.warp`); returns the totals."""
        for _ in self.stream(requests, progress):
            pass
        assert self.last_stats is not None
        return self.last_stats

    def stream(self, requests: Iterable[Request] | Feed[Request] | MappedFeed[Request],
               progress: bool = False) -> Iterator[Request]:
        """Yield each request as its row finishes, pulling new ones from `requests` (a list, a lazy iterator: a
        job's rows, or a `Feed` that producers fill while it runs) as slots free up: one long-lived pipeline, never
        drained between them. Over a feed the schedule idles while every batch is empty and the feed open, and ends
        once it is closed and drained. `last_stats` holds the totals once the stream is exhausted."""
        start = time.perf_counter()
        self.tracer.clear()
        self.verified = 0
        self.verify_log = deque(maxlen=VERIFY_LOG_PASSES)
        self.committed_tokens = 0
        self.running = True
        self.last_stats = None
        total = len(requests) if isinstance(requests, Sized) else None
        bar = tqdm(total=total, desc="generate", unit="prompt", disable=not progress)
        finished: queue.SimpleQueue[Request] = queue.SimpleQueue()
        done = RequestTotals()  # counters only: a finished request is the caller's once yielded

        self.replacements, self._switch_to, self._pulled, self._total = [], None, 0, total

        def admit(r: Request) -> Request:
            self._pulled += 1
            if self.replanner.tokens_per_row is None:  # the first row's budget prices the slowest row
                self.replanner.tokens_per_row = r.max_new_tokens
            return r

        self.replanner.tokens_per_row = None
        source = requests.map(admit) if isinstance(requests, (Feed, MappedFeed)) else map(admit, requests)

        def batches(waiting: Waiting) -> Batches:  # (this run's, and again with a re-placement's workers)
            return Batches(self.workers, self.plan, waiting, on_finished=bar.update, rows=lambda: self.replanner.rows,
                           refill=self.refill, on_retired=finished.put, prompts=self.prompts)

        self.batches = batches(Waiting(source))
        self.rounds_since_adapt, self.adapted, self.adapt_due = 0, 0, 0
        self.routing: list[list[int]] = []  # the target's routing since the last adapt, from verified passes
        self.adaptation = [0, 0, 0, 0]  # hits, picks, bytes moved, experts moved (Drafter.adapt)
        self.hotness: list[list[int]] = []
        bytes_before = self.workers.bytes_read
        bytes_done = preempted_done = 0  # of the workers and batches a re-placement retired
        totals = {"steps": 0, "passes": 0}

        def drain() -> Iterator[Request]:
            while not finished.empty():
                r = finished.get()
                done.add(r)
                if progress:  # the rate of the finished rows' tokens since the start (the bar counts rows)
                    bar.set_postfix_str(f"{done.generated_tokens / (time.perf_counter() - start):.1f} tok/s",
                                        refresh=False)
                yield r

        try:
            try:
                self.batches.admit_all()
            except SpecOffloadError as exc:  # a lost worker while creating the caches
                self._recover(exc)
            while True:
                try:
                    for _ in self._run_schedule(totals):
                        yield from drain()
                    if self._switch_to is None:
                        break
                    plan, self._switch_to = self._switch_to, None  # re-placement (module docstring, step 6)
                    bytes_done += self.workers.bytes_read - bytes_before
                    preempted_done += self.batches.preempted
                    waiting = self.batches.requeue_all()
                    assert self.replacer is not None
                    self.adopt(self.replacer.adopt(plan))
                    bytes_before = self.workers.bytes_read
                    self.batches = batches(waiting)
                    self.batches.admit_all()
                except SpecOffloadError as exc:  # PipelineError: an op failed
                    self._recover(exc)
            yield from drain()
        finally:
            self.running = False
            bar.close()
        spans = self.tracer.spans
        busy = {kind: sum(s.end - s.start for s in spans if s.name == kind) for kind in ("draft", "verify")}
        target_s = sum(s.end - s.start for s in spans if s.name in ("embed", "attention", "ffn", "head"))
        self.last_stats = OffloadStats(
            **done.as_dict(),
            steps=totals["steps"],
            wall_s=time.perf_counter() - start,
            prefill_s=0.0,
            draft_s=busy["draft"],
            target_s=target_s,
            verify_s=busy["verify"],
            bytes_read=bytes_done + self.workers.bytes_read - bytes_before,
            passes=totals["passes"],
            expert_hits=self.adaptation[0],
            expert_picks=self.adaptation[1],
            migrated_bytes=self.adaptation[2],
            migrated_experts=self.adaptation[3],
            migrations=self.adapted,
            expert_hotness=tuple(tuple(layer) for layer in self.hotness),
            preempted=preempted_done + self.batches.preempted,
        )

    def drop_workers(self) -> None:
        """The workers are being replaced (`Replacer.adopt`): forget them here and in the batches, so that their
        memory is freed before the new ones are built; `adopt` follows."""
        self.workers = None  # type: ignore[assignment]
        if getattr(self, "batches", None) is not None:
            self.batches.workers = None  # type: ignore[assignment]

    def adopt(self, adopted: Adopted) -> None:
        """Run with a re-placement's plan and workers from now on (between runs, or at a run's switch point)."""
        self.plan, self.weights, self.workers, self.replanner = adopted[:4]
        self.prompts = adopted.prompts
        self.adapt_interval = self._adapt_every if self.plan.drafting else 0

    def _left(self) -> tuple[int, float, int]:
        """(rows, new tokens, committed tokens in flight) the run has left: its rows in the batches, those waiting
        and, when the source has a length, those not pulled yet (each at the first row's max_new_tokens)."""
        running = [r for b in self.batches.items for r in b.rows if not r.finished]
        waiting = self.batches.waiting.buffered + (max(0, self._total - self._pulled) if self._total else 0)
        per_row = self.replanner.tokens_per_row or 0
        tokens = sum(r.max_new_tokens - len(r.output) for r in running) + waiting * per_row
        return len(running) + waiting, float(tokens), sum(r.num_tokens for r in running)

    def _should_switch(self, passes: int) -> bool:
        """Once a run, when the replanner says the plan's profile was off: ask the replacer for a better plan.
        Call with no op in flight."""
        if self.replacer is None or not self.replanner.replace_due:
            return False
        self.replanner.replace_due = False
        if self.replacements:
            return False
        plan = self.replacer.propose(*self._left())
        if plan is None:
            return False
        self.replacements.append({"pass": passes, "from": self.plan.describe(), "to": plan.describe()})
        self._switch_to = plan
        return True

    def _recover(self, error: SpecOffloadError) -> None:
        """Re-raise `error` unless the recovery policy restored the workers; then restart every batch from its
        committed tokens (the caller runs the schedule again)."""
        if not self.recovery.recover(error):
            raise error
        for b in self.batches.items:
            self.batches.restart(b)

    def _run_schedule(self, totals: dict[str, int]) -> Iterator[None]:
        """Run the schedule until no request is left, yielding after each step's wait (the caller hands out the rows
        that finished meanwhile); adds the steps and target passes to `totals`."""
        schedule = PipelineSchedule(self.num_layers, self.weights.units(), self.weights.num_buffers,
                                    draft_ops=self.plan.k_max, attention_streamed=self.weights.attention_streamed,
                                    interleave=self.plan.interleave, keep_ops=False)
        handlers = {
            "load": self._load,
            "embed": self._embed,
            "attention": self._attention,
            "ffn": self._ffn,
            "head": self._head,
            "verify": self._verify,
            "draft": self._draft,
        }
        step_ops: deque[list[int]] = deque(maxlen=3)  # the op ids of the last steps (a step waits on step - 2)
        steps = 0
        # Each worker thread sets its own torch thread count (per thread in torch's OpenMP pool): the loader
        # converts with one thread so it does not fight the compute threads for the cores.
        threads = {"io": 1, "cpu": self.compute_threads, "device": self.compute_threads}
        with OpExecutor(
            {kind: _inference(f) for kind, f in handlers.items()},
            self.tracer,
            on_thread_start=lambda resource: torch.set_num_threads(threads[resource]),
        ) as executor:

            def submit() -> None:
                nonlocal steps
                target = bool(self.batches[schedule.target_batch(steps)].rows)
                ops = schedule.next_step(target=target)
                totals["steps"] += 1
                totals["passes"] += target
                step_ops.append([op.id for op in ops])
                steps += 1
                executor.submit(ops)

            for _ in range(2):
                submit()
            while True:
                # Step s's target batch was last verified at step s - 2: wait for that, then decide step s.
                executor.wait(step_ops[-2])
                yield
                if self.replacer is not None and self.replanner.replace_due and not self.batches.done:
                    executor.wait_all()  # (every op submitted is done: the batches hold committed tokens only)
                    if self._should_switch(totals["passes"]):
                        return
                if self.batches.done:
                    executor.cancel_from(steps - 1)
                    executor.wait_all()
                    break
                if self.batches.idle:  # an open feed, empty for now: wait for requests (no empty steps meanwhile)
                    executor.wait_all()
                    self.batches.waiting.wait(IDLE_WAIT_S)
                    if self.batches.waiting:
                        self.batches.admit_all()
                    continue
                target = self.batches[schedule.target_batch(steps)]
                if not target.rows and self.batches.can_admit(target):  # a feed's rows for an empty batch: admit
                    executor.wait_all()  # them once the ops in flight (its draft ops among them) are done
                    self.batches.grow(target)
                submit()

    # ---- op handlers (each runs on its resource's thread) ----------------------------------------------------------
    def _load(self, op: Op) -> None:
        start = time.perf_counter()
        self.workers.prefetch.load(op.layer, max(op.group, 0), op.slot)
        self.load_seconds += time.perf_counter() - start  # (the io thread's own work: read and convert)

    def _plan_feed(self, b: Batch) -> None:
        """Decide what b's next pass feeds of each row's committed tokens (`b.feed`) and which rows it verifies
        (`b.ready`: the pass reaches their pending token). A decoding row (one token unfed: its pending one) feeds
        it; the other rows' tokens (a new row's prompt, or a whole row fed again after a preemption, a restart or a
        re-placement) share the pass's prompt budget in row order (`PromptBudget`: the planner's paces them beside
        the rows the pass decodes and lets a pass that decodes none feed every row whole; the user's caps every
        pass)."""
        if b.feed is not None:
            return
        t_len = self.workers.attention.lengths(b.index)
        b.fed_before = t_len
        unfed = [r.num_tokens - t_len[n] for n, r in enumerate(b.rows)]
        budget = self.prompts.tokens(decoding=any(u <= 1 for u in unfed))
        b.feed, b.ready = [], []
        for u in unfed:
            take = u
            if u > 1 and budget is not None:
                take = min(u, budget)
                budget -= take
            b.feed.append(take)
            b.ready.append(take == u)

    def _embed(self, op: Op) -> None:
        b = self.batches[op.batch]
        if not b.rows:
            return
        self._plan_feed(b)
        assert b.feed is not None
        t_len, k = b.fed_before, 0 if b.drafts is None else b.drafts.shape[1]
        drafts = b.drafts.tolist() if b.drafts is not None else [[] for _ in b.rows]
        if len(b.num_drafts) != len(b.rows):
            b.num_drafts = [0] * len(b.rows)
        b.num_drafts = [d if ready else 0 for d, ready in zip(b.num_drafts, b.ready)]
        if self.batches.block_size and not self._fit_blocks(b):
            return
        t_len = b.fed_before
        drafts = b.drafts.tolist() if b.drafts is not None else [[] for _ in b.rows]
        ids, num_new = pad_right([r.tokens[t_len[n]: t_len[n] + b.feed[n]] + drafts[n][: b.num_drafts[n]]
                                  for n, r in enumerate(b.rows)])  # [rows, T]
        b.committed = [r.num_tokens for r in b.rows]
        b.pass_k, b.num_new = k, num_new
        b.token_mask = torch.arange(ids.shape[1])[None, :] < num_new[:, None]  # [rows, T]
        b.hidden = self.workers.attention.embed(ids)  # [rows, T, H]

    def _fit_blocks(self, b: Batch) -> bool:
        """Paged KV: reserve the blocks of b's pass (each row's fed and draft positions), preempting b's youngest
        row until they fit (`Batches.preempt`); False when no row is left (the pass is skipped)."""
        assert b.feed is not None
        while b.rows:
            num_new = [f + d for f, d in zip(b.feed, b.num_drafts)]
            if self.workers.attention.reserve(b.index, num_new) == 0:
                return True
            n = self.batches.preempt(b)
            for per_row in (b.feed, b.ready, b.num_drafts, b.fed_before):
                del per_row[n]
            keep = [i for i in range(len(b.rows) + 1) if i != n]
            if b.drafts is not None:
                b.drafts = b.drafts[keep]  # [rows, L]
            if b.p is not None:
                b.p = b.p[keep]  # [rows, L, vocab]
        b.clear_pass()
        return False

    def _attention(self, op: Op) -> None:
        b = self.batches[op.batch]
        if b.hidden is not None:
            b.hidden = self.workers.attention.attention(b.index, op.layer, op.slot, b.hidden, b.token_mask)

    def _ffn(self, op: Op) -> None:
        b = self.batches[op.batch]
        if b.hidden is not None:
            b.hidden = self.workers.verifier.ffn(op.batch, op.layer, op.group, op.slot, b.hidden, b.token_mask)

    def _head(self, op: Op) -> None:
        b = self.batches[op.batch]
        if b.hidden is None:
            return
        assert b.num_new is not None
        self.workers.attention.advance(b.index, b.num_new.tolist())
        k, width = b.pass_k, b.hidden.shape[1]
        # row r's pending token and its n_r drafts are its last n_r + 1 fed positions (rows with fewer drafts, or
        # none verified, read clamped positions whose logits verification ignores)
        first = b.num_new - torch.tensor(b.num_drafts, dtype=torch.long) - 1  # [rows]
        positions = (first[:, None] + torch.arange(k + 1)[None, :]).clamp(0, width - 1)  # [rows, k + 1]
        b.logits = self.workers.verifier.head(op.slot, b.hidden, positions)  # [rows, k + 1, vocab]
        b.hidden = None

    def _verify(self, op: Op) -> None:
        b = self.batches[op.batch]
        if b.logits is None:
            return
        k = b.pass_k
        drafts = b.drafts if b.drafts is not None else torch.zeros((len(b.rows), 0), dtype=torch.long)  # [rows, k]
        warps = row_warps(b.rows)
        seeds = None if warps is None else draw_seeds(b.rows, VERIFY)
        logits = b.logits  # [rows, k + 1, vocab]
        if any(r.processed or r.logprobs is not None for r in b.rows):  # read here: over the wire, copied out once
            logits = self.workers.verifier.logits(logits)
        logits = process_rows(b.rows, logits, drafts)  # penalties, min_tokens: q is the processed target
        accepted, emitted = self.workers.verifier.verify(logits, drafts, b.num_drafts, b.p, GREEDY, seeds, warps)
        ready = [n for n, ok in enumerate(b.ready) if ok]
        accepted = [a if ok else 0 for a, ok in zip(accepted, b.ready)]
        outputs = [len(r.output) for r in b.rows]
        before = sum(outputs)
        commit([b.rows[n] for n in ready], [accepted[n] for n in ready], [emitted[n] for n in ready],
               [b.num_drafts[n] for n in ready])
        record_logprobs(b.rows, logits, outputs)
        now = time.perf_counter()
        assert b.num_new is not None and b.feed is not None
        decoding = all(ok for ok in b.ready) and all(f <= 1 for f in b.feed)  # (a prefill is not the steady state)
        load_s, self.load_mark = self.load_seconds - self.load_mark, self.load_seconds
        if self.verify_log and decoding:  # the pass's period, and the loads done, since the end of the previous one
            self.replanner.observe_pass(now - self.verify_log[-1][0], k, len(b.rows), load_s)
        committed = sum(len(r.output) for r in b.rows) - before
        self.committed_tokens += committed
        self.verify_log.append((now, b.index, committed, len(b.rows)))
        drafted = [n for n in ready if b.num_drafts[n] >= 1]
        if drafted:
            self.replanner.record([accepted[n] for n in drafted], [b.num_drafts[n] for n in drafted],
                                  [b.rows[n].index for n in drafted])
        # Ready rows: the target keeps pending + accepted drafts, the drafter what it saw of them; a row still in
        # prefill keeps what the pass fed, and its drafter one token less than committed (it re-feeds the last).
        target, drafter = kept_lengths(b.committed, accepted, b.draft_calls)
        fed = [t + f for t, f in zip(b.fed_before, b.feed)]
        self.workers.attention.truncate(b.index, [t if ok else f for t, f, ok in zip(target, fed, b.ready)])
        if b.draft_calls >= 1:  # (no draft call this round: the drafter saw nothing new)
            self.workers.drafter.truncate(b.index, [d if ok else c - 1 for d, c, ok
                                                    in zip(drafter, b.committed, b.ready)])
        b.drafts = b.p = b.logits = None
        b.feed, b.num_drafts, b.ready, b.draft_calls = None, [], [], 0
        self.verified += 1
        if self.adapt_interval:  # decided here, in verify order, from whole passes: the same in every run
            counts = self.workers.verifier.routing_counts(b.index)
            self.routing = [[x + y for x, y in zip(a, c)] for a, c in zip(self.routing, counts)] or counts
            self.rounds_since_adapt += 1
            if self.rounds_since_adapt >= (self.adapt_interval if self.adapt_due else 1):
                b.adapt_counts, self.routing, self.rounds_since_adapt = self.routing, [], 0
                self.adapt_due += 1
        self.batches.retire_finished(b)
        if b.rows and self.batches.can_admit(b):  # a feed's rows arrived while b runs below its size
            self.batches.grow(b)

    def _adapt(self, counts: list[list[int]]) -> None:
        """Hand the target's routing since the last call to the drafter (on its own "migrate" trace track: moving
        resident experts is a cost of its own)."""
        with self.tracer.span("migrate", "migrate"):
            result = self.workers.drafter.adapt(counts)
        self.adaptation = [a + r for a, r in zip(self.adaptation, result)]
        self.hotness = [[a + c for a, c in zip(acc, layer)] for acc, layer in zip(self.hotness, counts)] or counts
        self.adapted += 1

    def _draft(self, op: Op) -> None:
        b = self.batches[op.batch]
        if not b.rows:
            return
        # k is fixed for a whole round (online re-planning changes it between rounds); row r drafts n_r of its
        # calls' tokens (speculative.draft_lengths): none while its prompt is still being fed in chunks
        if op.token == 0:
            b.round_k = self.replanner.k
            if b.adapt_counts is not None:
                self._adapt(b.adapt_counts)
                b.adapt_counts = None
            self._plan_feed(b)
            assert b.feed is not None
            # a row's first verify (the pass that feeds its prompt) carries no drafts, in every runner: so a row's
            # rounds, and with them its random draws, never depend on the batch it joined. A row fed again whole
            # (after a restart, or a feed's rows growing its batch) drafts as it would have: same rounds, same draws
            decoding = [ok and len(r.output) > 0 for ok, r in zip(b.ready, b.rows)]
            b.num_drafts = draft_lengths(b.rows, b.round_k, decoding)
        limit = max(b.num_drafts, default=0)
        if op.token >= limit or len(b.draft_tokens) < op.token:  # (rows admitted after this round began: skip it)
            return
        if op.token == 0:
            d_len = self.workers.drafter.lengths(b.index)
            ids, num_new = pad_right([r.tokens[d_len[n]:] for n, r in enumerate(b.rows)])  # [rows, T]
            b.draft_tokens, b.draft_probs = [], []
        else:
            ids = b.draft_tokens[-1][:, None]  # [rows, 1]
            num_new = torch.ones(len(b.rows), dtype=torch.long)
        warps = row_warps(b.rows)
        seeds = None if warps is None else draw_seeds(b.rows, DRAFT, op.token)
        token, probs = self.workers.drafter.propose(b.index, ids, num_new, GREEDY, seeds, warps)  # [rows], [rows, V]
        b.draft_tokens.append(token.clamp_min(0))
        if probs is not None:
            b.draft_probs.append(probs)
        b.num_drafts = cut_drafts(b.num_drafts, token, op.token)  # a row may propose fewer (a model-free drafter)
        width = max(b.num_drafts, default=0)
        if op.token >= width - 1:  # the round is complete (its later draft ops find nothing to do)
            b.drafts = torch.stack(b.draft_tokens, dim=1)[:, :width]  # [rows, L]
            b.p = torch.stack(b.draft_probs, dim=1)[:, :width] if b.draft_probs else None  # [rows, L, vocab]
            b.draft_calls = len(b.draft_tokens)
            b.draft_tokens, b.draft_probs = [], []


def _inference(handler: Callable[[Op], None]) -> Callable[[Op], None]:
    """inference_mode is per thread: enter it around every op on the executor's threads."""

    def run(op: Op) -> None:
        with torch.inference_mode():
            handler(op)

    return run
