"""`OffloadEngine`: the target streams its weights; a resident draft fills the idle time on the other batch.

The life of a generate call:
  1. Prompts fill two batches (one without a draft). Placement (`placement.place`) has decided, at
     construction, which target parts are resident and which stream through the ring of slot buffers.
  2. `PipelineSchedule` emits the ops of step i (see schedule.py for the i, j, k convention): the target pass
     over batch A = i % 2 (load, embed, attention, ffn, head, verify) and k draft steps for batch B.
     `OpExecutor` runs them on the io / cpu / device workers with real overlap.
  3. A target pass feeds each row its committed tokens not yet in the target's KV cache (the whole prompt for a
     new row: prefill is the same layer-streamed pass, each layer's weights loaded once for the whole batch)
     plus the row's draft tokens; verification (greedy match or rejection sampling) commits tokens exactly as
     the resident `Engine` does, so greedy outputs are identical token for token.
  4. A batch whose rows have all finished is refilled from the waiting prompts at its verify op.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from specoffload.planner import (
    AcceptanceTracker,
    HardwareProfile,
    ModelCosts,
    Policy,
    Workload,
    replan_k,
    search,
)

from ..config import ConfigError, EngineConfig
from ..engine import Engine, GenerateStats
from ..models.errors import SpecOffloadError
from ..models.model import Transformer
from ..request import GenerationResult, Request
from ..sampling import SamplingParams
from ..speculative import pad_right
from ..tokenizer import load_tokenizer
from ..trace import Tracer
from .executor import OpExecutor
from .memory import machine_memory_bytes
from .placement import ModelShape, Placement, PlacementPolicy, minimum_device_memory, place
from .profiler import load_or_measure
from .schedule import Op, PipelineSchedule
from .workers import AttentionWorker, DraftWorker, PrefetchWorker, VerifierWorker, WeightPlan

#: default KV length per row when neither max_seq_len nor a shorter model context says otherwise
DEFAULT_MAX_SEQ_LEN = 4096
#: largest k the planner considers (and online re-planning may move to)
MAX_AUTO_K = 8
#: batch sizes the planner considers, and the job size it plans for (prompts of max_seq_len / 2 tokens)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
PLAN_PROMPTS = 256

logger = logging.getLogger("specoffload.offload")


@dataclass(frozen=True)
class OffloadStats(GenerateStats):
    """GenerateStats plus what moved: bytes read from the weights tier, and the pipeline's passes."""

    bytes_read: int = 0
    passes: int = 0


@dataclass
class _Batch:
    """Coordinator-side state of one of the two interleaved batches (its KV caches live in the workers)."""

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


class OffloadEngine(Engine):
    """Engine whose target model streams its weights under `config.device_memory` (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        if not config.offloaded:
            raise ConfigError("OffloadEngine needs device_memory (the budget that makes the target stream)")
        if torch.device(config.device).type != "cpu":
            raise ConfigError(
                "the offloaded pipeline runs on device 'cpu' only so far (CUDA attention/FFN placement is not "
                "implemented); use the resident Engine on CUDA"
            )
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype, device = config.torch_dtype, torch.device(config.device)
        self.target = Transformer(config.target, dtype=dtype, device=device)
        self.draft = Transformer(config.draft, dtype=dtype, device=device) if config.draft else None
        self.tokenizer = load_tokenizer(config.target)
        if self.draft is not None:
            self._check_vocabularies()
        cfg = self.target.config
        self.max_seq_len = min(cfg.max_position_embeddings, config.max_seq_len or DEFAULT_MAX_SEQ_LEN)
        self.policy: Policy | None = None
        self.profile: HardwareProfile | None = None
        if config.planned:
            self._plan()  # sets self.policy and a config with concrete batch size and k; may drop the draft
        self.k = self.config.num_draft_tokens if self.draft is not None else 0
        # The schedule emits k_max draft ops per step; online re-planning may move k anywhere in 1..k_max.
        self.k_max = max(self.k, MAX_AUTO_K) if self.policy is not None and self.k else self.k
        self.tracker = AcceptanceTracker(half_life=64)
        self.replans: list[dict[str, float]] = []
        self.placement = self._place()  # PlacementError (with the minimum) if the budget is too small
        self.selected_experts = self._select_experts_mode()
        self.plan = WeightPlan.from_placement(self.placement, cfg.num_layers, cfg.num_experts, self.selected_experts)
        self.load_groups = self.plan.load_groups
        self._make_workers()
        self.tracer = Tracer(enabled=config.trace)
        self.last_stats: OffloadStats | None = None

    # ---- construction -----------------------------------------------------------------------------------------
    def _plan(self) -> None:
        """Pick (batch, k) with the planner from the measured profile; see planner/search.py."""
        cfg, tcfg = self.config, self.target.config
        self.profile = load_or_measure(cfg, log=lambda msg: logger.info(msg))
        target = ModelShape.from_loader("target", self.target.loader)
        draft = ModelShape.from_loader("draft", self.draft.loader) if self.draft is not None else None
        ctx = self.max_seq_len
        workload = Workload(num_prompts=PLAN_PROMPTS, prompt_len=ctx / 2, new_tokens=ctx - ctx // 2)
        batches = DEFAULT_BATCHES if cfg.max_batch_size == "auto" else (cfg.max_batch_size,)
        if draft is None:
            ks: tuple[int, ...] = (0,)
        else:
            ks = tuple(range(0, MAX_AUTO_K + 1)) if cfg.num_draft_tokens == "auto" else (cfg.num_draft_tokens,)
        host = cfg.host_memory if cfg.host_memory is not None else machine_memory_bytes()
        result = search(
            self.profile, target, draft, workload, cfg.acceptance_prior, int(cfg.device_memory), int(host),
            batches=batches, ks=ks, num_buffers=cfg.num_buffers, weights_tier=cfg.weights_tier,
            unified_memory=torch.device(cfg.device).type == "cpu" and cfg.host_memory is None, context=ctx,
            dtype_bytes=self.target.dtype.itemsize, top_k=tcfg.num_experts_per_tok if tcfg.num_experts else 0,
        )
        self.policy = result.best
        self.plan_alternatives = result.alternatives[:5]
        logger.info("planner: batch %d, k %d, predicted %.2f tok/s", self.policy.decode_batch, self.policy.k,
                    self.policy.predicted_tokens_per_s)
        if self.policy.k == 0:
            self.draft = None  # the planner chose no speculation: the draft is not loaded
        self.config = replace(cfg, max_batch_size=self.policy.decode_batch, num_draft_tokens=max(self.policy.k, 1))

    def _maybe_replan(self) -> None:
        """Online: every replan_interval verify rounds, re-estimate alpha and re-plan k (logged)."""
        self._rounds += 1
        interval = self.config.replan_interval
        if self.policy is None or self.k_max == 0 or not interval or self._rounds % interval:
            return
        estimate = self.tracker.estimate()
        if estimate is None:
            return
        costs = ModelCosts.from_shapes(*self._shapes()[:2], dtype_bytes=self.target.dtype.itemsize,
                                       top_k=self.target.config.num_experts_per_tok)
        new_k = replan_k(self.profile, costs, self.placement, self.config.max_batch_size, estimate.alpha,
                         self.max_seq_len, ks=range(1, self.k_max + 1))
        if new_k != self.k:
            self.replans.append({"round": self._rounds, "alpha": estimate.alpha, "k_from": self.k, "k_to": new_k})
            logger.info("re-plan after %d rounds: alpha %.3f -> k %d (was %d)", self._rounds, estimate.alpha,
                        new_k, self.k)
            self.k = new_k  # takes effect at each batch's next draft round

    def _place(self) -> Placement:
        target, draft, policy = self._shapes()
        cfg = self.config
        host = cfg.host_memory if cfg.host_memory is not None else machine_memory_bytes()
        return place(target, draft, policy, int(cfg.device_memory), int(host))

    def minimum_device_memory(self) -> int:
        """The smallest device_memory that places this model pair under the current policy."""
        return minimum_device_memory(*self._shapes())

    def _shapes(self) -> tuple[ModelShape, ModelShape | None, PlacementPolicy]:
        cfg = self.config
        policy = PlacementPolicy(
            batch_size=cfg.max_batch_size,
            num_batches=2 if self.draft is not None else 1,
            context=self.max_seq_len + self.k + 1,
            num_buffers=cfg.num_buffers,
            weights_tier=cfg.weights_tier,
            # On CPU the device is host memory: one budget for everything, unless the user splits it by giving
            # host_memory explicitly (then device_memory covers device items and host_memory the host tier).
            unified_memory=torch.device(cfg.device).type == "cpu" and cfg.host_memory is None,
        )
        target = ModelShape.from_loader("target", self.target.loader)
        draft = ModelShape.from_loader("draft", self.draft.loader) if self.draft is not None else None
        return target, draft, policy

    def _make_workers(self) -> None:
        """The four roles, in this process (the local backend); they share the ring slots of the prefetcher."""
        self.prefetch = PrefetchWorker(self.config, self.plan)
        slots = self.prefetch.slots
        self.attn = AttentionWorker(self.config, self.plan, slots)
        self.verifier = VerifierWorker(self.config, self.plan, slots)
        self.drafter = DraftWorker(self.config) if self.draft is not None else None

    def _select_experts_mode(self) -> bool:
        """Load only routed experts? Needs attention and routers resident (they run before routing) and the
        disk tier (the ffn op reads the routed experts itself)."""
        cfg, policy = self.target.config, self.config.expert_loading
        if not cfg.num_experts or policy == "all" or self.config.weights_tier != "disk":
            return False
        if any(self.placement.is_streamed(k) for k in self.placement.tiers if k.kind in ("attention", "router")):
            return False
        if policy == "selected":
            return True
        # auto: expected distinct experts among the routing picks of one pass (tokens x top_k, uniform routing)
        tokens = self.config.max_batch_size * (self.k + 1)
        expected = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** tokens)
        return expected < 0.75 * cfg.num_experts

    def describe_placement(self) -> str:
        return self.placement.table()

    # ---- generation -------------------------------------------------------------------------------------------------
    def _generate(self, encoded: list[list[int]], params: SamplingParams, progress: bool) -> list[GenerationResult]:
        start = time.perf_counter()
        self.tracer.clear()
        cfg = self.target.config
        for i, ids in enumerate(encoded):
            if len(ids) >= self.max_seq_len:
                from ..engine import PromptError

                raise PromptError(
                    f"prompt {i} has {len(ids)} tokens; this engine's KV caches hold {self.max_seq_len} tokens per "
                    "row (max_seq_len): raise max_seq_len or shorten the prompt"
                )
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(cfg.eos_token_ids)
        )
        requests = [
            Request(i, ids, min(params.max_new_tokens, self.max_seq_len - len(ids)), stop_ids)
            for i, ids in enumerate(encoded)
        ]
        self._params = params
        self._waiting = deque(requests)
        self._bar = tqdm(total=len(requests), desc="generate", unit="prompt", disable=not progress)
        num_batches = 2 if self.k_max > 0 else 1
        self._batches = [_Batch(n) for n in range(num_batches)]
        self._waves = 0
        self._rounds = 0
        try:
            for n, b in enumerate(self._batches):
                self._admit(b, share=len(self._batches) - n)
        except SpecOffloadError as exc:
            if not self._recover(exc):
                raise
        bytes_before = self._bytes_read()
        totals = {"steps": 0, "passes": 0}
        while True:
            try:
                self._run_pipeline(totals)
                break
            except SpecOffloadError as exc:  # PipelineError: an op failed
                if not self._recover(exc):
                    raise
        self._bar.close()
        results = [self._result(r) for r in requests]
        spans = self.tracer.spans
        busy = {kind: sum(s.end - s.start for s in spans if s.name == kind) for kind in ("draft", "verify")}
        target_s = sum(s.end - s.start for s in spans if s.name in ("embed", "attention", "ffn", "head"))
        self.last_stats = OffloadStats(
            num_prompts=len(requests),
            prompt_tokens=sum(len(r.prompt) for r in requests),
            generated_tokens=sum(len(r.output) for r in requests),
            num_drafted=sum(r.num_drafted for r in requests),
            num_accepted=sum(r.num_accepted for r in requests),
            steps=totals["steps"],
            wall_s=time.perf_counter() - start,
            prefill_s=0.0,
            draft_s=busy["draft"],
            target_s=target_s,
            verify_s=busy["verify"],
            bytes_read=self._bytes_read() - bytes_before,
            passes=totals["passes"],
        )
        return results

    def _run_pipeline(self, totals: dict[str, int]) -> None:
        """Run the interleaved schedule until no request is left; adds the steps and target passes to `totals`."""
        schedule = PipelineSchedule(
            self.target.config.num_layers, self.plan.streamed_layers(), self.plan.num_buffers, self.k_max,
            self.plan.attention_streamed,
        )
        handlers = {
            "load": self._op_load,
            "embed": self._op_embed,
            "attention": self._op_attention,
            "ffn": self._op_ffn,
            "head": self._op_head,
            "verify": self._op_verify,
            "draft": self._op_draft,
        }
        step_ops: list[list[int]] = []
        # Each worker sets its own torch thread count (per thread in torch's OpenMP pool): the loader converts
        # with one thread so it does not fight the compute workers for the cores.
        compute_threads = self.config.num_threads or torch.get_num_threads()
        threads = {"io": 1, "cpu": compute_threads, "device": compute_threads}
        with OpExecutor(
            {k: _inference(f) for k, f in handlers.items()},
            self.tracer,
            on_thread_start=lambda resource: torch.set_num_threads(threads[resource]),
        ) as executor:

            def submit() -> None:
                target = bool(self._batches[schedule.target_batch(len(step_ops))].rows)
                ops = schedule.next_step(target=target)
                totals["steps"] += 1
                totals["passes"] += target
                step_ops.append([op.id for op in ops])
                executor.submit(ops)

            for _ in range(2):
                submit()
            while True:
                # Step s's target batch was last verified at step s - 2: wait for that, then decide step s.
                executor.wait(step_ops[len(step_ops) - 2])
                if not self._waiting and not any(b.rows for b in self._batches):
                    executor.cancel_from(len(step_ops) - 1)
                    executor.wait_all()
                    break
                submit()

    def _recover(self, error: SpecOffloadError) -> bool:
        """After a failed op or admission: may generation go on from the requests' committed tokens? The local
        backend never does; the Ray backend (actors/coordinator.py) restarts a lost worker actor and says yes."""
        return False

    def _bytes_read(self) -> int:
        return self.prefetch.bytes_read + self.attn.bytes_read + self.verifier.bytes_read

    def _admit(self, b: _Batch, share: int = 1) -> None:
        """Fill an empty batch from the waiting prompts, with fresh worker caches sized for its rows.

        share: how many empty batches the waiting prompts are split across (at the start both batches take
        half, so a short job still interleaves two batches instead of leaving the second one empty).
        """
        n = min(self.config.max_batch_size, math.ceil(len(self._waiting) / share))
        b.rows = [self._waiting.popleft() for _ in range(n)]
        b.drafts = b.p = None
        if not b.rows:
            self.attn.drop(b.index)
            if self.drafter is not None:
                self.drafter.drop(b.index)
            return
        capacity = max(len(r.prompt) + r.max_new_tokens for r in b.rows) + self.k + 1
        seed = self._params.seed
        self.attn.reset(b.index, n, capacity)
        self.verifier.seed(b.index, None if seed is None else seed * 4 + 2 * b.index + self._waves)
        if self.drafter is not None:
            self.drafter.reset(b.index, n, capacity, None if seed is None else seed * 4 + 2 * b.index + 1 + self._waves)
        self._waves += 1

    # ---- op handlers (each runs on its resource's worker thread) ---------------------------------------------------
    def _op_load(self, op: Op) -> None:
        self.prefetch.load(op.layer, op.slot)

    def _op_embed(self, op: Op) -> None:
        b = self._batches[op.batch]
        if not b.rows:
            return
        t_len = self.attn.lengths(b.index)
        k = 0 if b.drafts is None else b.drafts.shape[1]
        drafts = b.drafts.tolist() if b.drafts is not None else [[] for _ in b.rows]
        ids, num_new = pad_right([r.tokens[t_len[n]:] + drafts[n] for n, r in enumerate(b.rows)])  # [rows, T]
        b.committed = [r.num_tokens for r in b.rows]
        b.pass_k, b.num_new = k, num_new
        b.token_mask = torch.arange(ids.shape[1])[None, :] < num_new[:, None]  # [rows, T]
        b.hidden = self.attn.embed(ids)  # [rows, T, H]

    def _op_attention(self, op: Op) -> None:
        b = self._batches[op.batch]
        if b.hidden is not None:
            b.hidden = self.attn.attention(b.index, op.layer, op.slot, b.hidden)

    def _op_ffn(self, op: Op) -> None:
        b = self._batches[op.batch]
        if b.hidden is not None:
            b.hidden = self.verifier.ffn(op.layer, op.slot, b.hidden, b.token_mask)

    def _op_head(self, op: Op) -> None:
        b = self._batches[op.batch]
        if b.hidden is None:
            return
        assert b.num_new is not None
        self.attn.advance(b.index, b.num_new.tolist())
        k = b.pass_k
        positions = (b.num_new - k - 1)[:, None] + torch.arange(k + 1)[None, :]  # [rows, k + 1]
        b.logits = self.verifier.head(op.slot, b.hidden, positions)  # [rows, k + 1, vocab]
        b.hidden = None

    def _op_verify(self, op: Op) -> None:
        b = self._batches[op.batch]
        if b.logits is None:
            return
        k = b.pass_k
        drafts = b.drafts if b.drafts is not None else torch.zeros((len(b.rows), 0), dtype=torch.long)  # [rows, k]
        accepted, emitted = self.verifier.verify(b.index, b.logits, drafts, b.p, self._params)
        for n, r in enumerate(b.rows):
            r.num_drafted += k
            r.num_accepted += accepted[n]
            r.commit(emitted[n][: accepted[n] + 1])
        if k >= 1:
            self.tracker.record_many(accepted, [k] * len(accepted))
            self._maybe_replan()
        committed = b.committed
        self.attn.truncate(b.index, [c + a for c, a in zip(committed, accepted)])
        if self.drafter is not None and k >= 1:  # the draft cache saw committed + d_1..d_{k-1}
            self.drafter.truncate(b.index, [c + min(a, k - 1) for c, a in zip(committed, accepted)])
        b.drafts = b.p = b.logits = None
        keep = [n for n, r in enumerate(b.rows) if not r.finished]
        self._bar.update(len(b.rows) - len(keep))
        if len(keep) < len(b.rows):
            b.rows = [b.rows[n] for n in keep]
            if keep:
                self.attn.select_rows(b.index, keep)
                if self.drafter is not None:
                    self.drafter.select_rows(b.index, keep)
            else:
                self._admit(b)

    def _op_draft(self, op: Op) -> None:
        b = self._batches[op.batch]
        if not b.rows or self.drafter is None:
            return
        # k is fixed for a whole round (online re-planning changes it between rounds); never draft past the
        # longest remaining budget of the batch (those tokens could not be accepted).
        if op.token == 0:
            b.round_k = self.k
        limit = min(b.round_k, max(r.remaining for r in b.rows) - 1)
        if op.token >= limit:
            return
        if op.token == 0:
            d_len = self.drafter.lengths(b.index)
            ids, num_new = pad_right([r.tokens[d_len[n]:] for n, r in enumerate(b.rows)])  # [rows, T]
            b.draft_tokens, b.draft_probs = [], []
        else:
            ids = b.draft_tokens[-1][:, None]  # [rows, 1]
            num_new = torch.ones(len(b.rows), dtype=torch.long)
        token, probs = self.drafter.propose(b.index, ids, num_new, self._params)  # [rows], [rows, vocab] | None
        b.draft_tokens.append(token)
        if probs is not None:
            b.draft_probs.append(probs)
        if op.token == limit - 1:
            b.drafts = torch.stack(b.draft_tokens, dim=1)  # [rows, k]
            b.p = torch.stack(b.draft_probs, dim=1) if b.draft_probs else None  # [rows, k, vocab]
            b.draft_tokens, b.draft_probs = [], []

    def close(self) -> None:
        self.prefetch.close()
        self.attn.close()


def _inference(handler):  # noqa: ANN001, ANN202 - wraps an op handler
    """inference_mode is per thread: enter it around every op on the worker threads."""

    def run(op: Op) -> None:
        with torch.inference_mode():
            handler(op)

    return run


def expected_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts hit by `tokens` uniform top-k routings."""
    return num_experts * (1 - math.pow(1 - top_k / num_experts, tokens))
