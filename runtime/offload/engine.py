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

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..config import ConfigError, EngineConfig
from ..engine import Engine, GenerateStats
from ..kv_cache import KVCache
from ..models.model import Transformer
from ..models.weights import PartKey, Weights
from ..request import GenerationResult, Request
from ..sampling import SamplingParams, warp_logits
from ..speculative import pad_right
from ..tokenizer import load_tokenizer
from ..trace import Tracer
from ..verify import verify_greedy, verify_sampling
from .embedding import EmbeddingRows
from .executor import OpExecutor
from .memory import machine_memory_bytes
from .placement import ModelShape, Placement, PlacementPolicy, minimum_device_memory, place
from .schedule import Op, PipelineSchedule
from .streamer import TENSOR_ALIGN, WeightStreamer

#: default KV length per row when neither max_seq_len nor a shorter model context says otherwise
DEFAULT_MAX_SEQ_LEN = 4096


@dataclass(frozen=True)
class OffloadStats(GenerateStats):
    """GenerateStats plus what moved: bytes read from the weights tier, and the pipeline's passes."""

    bytes_read: int = 0
    passes: int = 0


@dataclass
class _Batch:
    """One of the two interleaved batches: its rows, caches, drafts and the activations of its current pass."""

    index: int
    rows: list[Request] = field(default_factory=list)
    t_cache: KVCache | None = None
    d_cache: KVCache | None = None
    drafts: torch.Tensor | None = None  # [rows, k] proposed for the next target pass
    p: torch.Tensor | None = None  # [rows, k, vocab] draft probabilities (sampling only)
    draft_tokens: list[torch.Tensor] = field(default_factory=list)  # k x [rows] during a draft round
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # k x [rows, vocab]
    hidden: torch.Tensor | None = None  # [rows, T, H] during a target pass
    num_new: torch.Tensor | None = None  # [rows] tokens fed per row this pass
    token_mask: torch.Tensor | None = None  # [rows, T]
    pass_k: int = 0  # draft tokens verified by the current pass
    committed: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [rows, pass_k + 1, vocab]
    verify_gen: torch.Generator | None = None
    draft_gen: torch.Generator | None = None


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
        self.k = config.num_draft_tokens if self.draft is not None else 0
        cfg = self.target.config
        self.max_seq_len = min(cfg.max_position_embeddings, config.max_seq_len or DEFAULT_MAX_SEQ_LEN)
        self.placement = self._place()  # PlacementError (with the minimum) if the budget is too small
        self._setup_weights()
        if self.draft is not None:
            self.draft.preload()
        self.tracer = Tracer(enabled=config.trace)
        self.last_stats: OffloadStats | None = None

    # ---- construction -----------------------------------------------------------------------------------------
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

    def _setup_weights(self) -> None:
        """Preload resident parts; group streamed parts into per-layer slot loads; open the streamer."""
        tcfg = self.target.config
        embedding = PartKey("embedding")
        resident = [key for key, tier in self.placement.tiers.items() if tier == "device"]
        streamed = [key for key, tier in self.placement.tiers.items() if tier != "device" and key != embedding]
        self.embedding_rows: EmbeddingRows | None = None
        if self.placement.tier(embedding) == "disk":
            self.embedding_rows = EmbeddingRows(
                self.target.loader.checkpoint, self.target.loader.refs(embedding)["embed"].name, self.target.dtype
            )
        elif self.placement.tier(embedding) == "host":
            resident.append(embedding)  # the host tier is where this engine computes: a plain resident table
        self.target.preload(resident)
        self.target.fetch = self._fetch
        groups: dict[int, list[PartKey]] = {}
        for key in streamed:
            groups.setdefault(tcfg.num_layers if key.kind == "head" else key.layer, []).append(key)
        self.selected_experts = self._select_experts_mode(groups)
        if self.selected_experts:  # experts load after routing, in the ffn op; the load op reserves the slot
            groups = {j: [k for k in keys if k.kind != "expert"] for j, keys in groups.items()}
        self.load_groups = groups
        self.attention_streamed = sorted(j for j, keys in groups.items() if any(k.kind == "attention" for k in keys))
        self._staged: dict[PartKey, Weights] = {}
        self._ffn_slot = -1
        self.streamer: WeightStreamer | None = None
        if streamed:
            fields = 8 * (tcfg.num_experts + 4 if tcfg.num_experts else 4)  # per-tensor alignment margin
            self.streamer = WeightStreamer(
                self.target.loader,
                self.placement.slot_bytes + TENSOR_ALIGN * fields,
                self.placement.num_buffers,
                self.config.weights_tier,
                self.target.device,
                parts=streamed,
            )

    def _select_experts_mode(self, groups: dict[int, list[PartKey]]) -> bool:
        """Load only routed experts? Needs the layer's attention and router resident (they run before routing)."""
        cfg, policy = self.target.config, self.config.expert_loading
        if not cfg.num_experts or policy == "all":
            return False
        before_routing = any(k.kind in ("attention", "router") for keys in groups.values() for k in keys)
        if before_routing:
            return False
        if policy == "selected":
            return True
        # auto: expected distinct experts among the routing picks of one pass (tokens x top_k, uniform routing)
        tokens = self.config.max_batch_size * (self.k + 1)
        expected = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** tokens)
        return expected < 0.75 * cfg.num_experts

    def describe_placement(self) -> str:
        return self.placement.table()

    # ---- weights ------------------------------------------------------------------------------------------------
    def _fetch(self, keys: list[PartKey]) -> dict[PartKey, Weights]:
        """Transformer hook for non-resident parts: staged by a load op, or (routed experts) loaded right now."""
        out = {key: self._staged[key] for key in keys if key in self._staged}
        missing = [key for key in keys if key not in out]
        if missing:
            if not (self.selected_experts and all(k.kind == "expert" for k in missing) and self._ffn_slot >= 0):
                raise RuntimeError(f"parts {missing} are neither resident nor staged: schedule bug")
            assert self.streamer is not None
            with self.tracer.span("load_experts", "io", layer=missing[0].layer, experts=len(missing)):
                out |= self.streamer.load(self._ffn_slot, missing)
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embedding_rows is not None:
            return self.embedding_rows(ids)
        return self.target.embed(ids)

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
        num_batches = 2 if self.k > 0 else 1
        self._batches = [_Batch(n) for n in range(num_batches)]
        for n, b in enumerate(self._batches):
            if params.seed is not None:
                b.verify_gen = torch.Generator().manual_seed(params.seed * 4 + 2 * n)
                b.draft_gen = torch.Generator().manual_seed(params.seed * 4 + 2 * n + 1)
            self._admit(b)
        bytes_before = self._bytes_read()
        schedule = PipelineSchedule(
            cfg.num_layers, sorted(self.load_groups), self.placement.num_buffers, self.k, self.attention_streamed
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
        passes = 0
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
                nonlocal passes
                target = bool(self._batches[schedule.target_batch(len(step_ops))].rows)
                ops = schedule.next_step(target=target)
                passes += target
                step_ops.append([op.id for op in ops])
                executor.submit(ops)

            for _ in range(2):
                submit()
            while True:
                # Step s's target batch was last verified at step s - 2: wait for that, then decide step s.
                executor.wait(step_ops[len(step_ops) - 2])
                if not self._waiting and not any(b.rows for b in self._batches):
                    passes -= executor.cancel_from(len(step_ops) - 1) and 0
                    executor.wait_all()
                    break
                submit()
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
            steps=len(step_ops),
            wall_s=time.perf_counter() - start,
            prefill_s=0.0,
            draft_s=busy["draft"],
            target_s=target_s,
            verify_s=busy["verify"],
            bytes_read=self._bytes_read() - bytes_before,
            passes=passes,
        )
        return results

    def _bytes_read(self) -> int:
        total = self.streamer.bytes_read if self.streamer is not None else 0
        return total + (self.embedding_rows.bytes_read if self.embedding_rows is not None else 0)

    def _admit(self, b: _Batch) -> None:
        """Fill an empty batch from the waiting prompts, with fresh caches sized for its rows."""
        n = min(self.config.max_batch_size, len(self._waiting))
        b.rows = [self._waiting.popleft() for _ in range(n)]
        b.drafts = b.p = None
        if not b.rows:
            b.t_cache = b.d_cache = None
            return
        capacity = max(len(r.prompt) + r.max_new_tokens for r in b.rows) + self.k + 1
        b.t_cache = self.target.new_cache(n, capacity)
        b.d_cache = self.draft.new_cache(n, capacity) if self.draft is not None else None

    # ---- op handlers (each runs on its resource's worker thread) ---------------------------------------------------
    def _op_load(self, op: Op) -> None:
        if self.streamer is None:
            return
        keys = self.load_groups.get(op.layer, [])
        if keys:
            self._staged.update(self.streamer.load(op.slot, keys))

    def _op_embed(self, op: Op) -> None:
        b = self._batches[op.batch]
        if not b.rows:
            return
        assert b.t_cache is not None
        t_len = b.t_cache.lengths.tolist()
        k = 0 if b.drafts is None else b.drafts.shape[1]
        drafts = b.drafts.tolist() if b.drafts is not None else [[] for _ in b.rows]
        ids, num_new = pad_right([r.tokens[t_len[n]:] + drafts[n] for n, r in enumerate(b.rows)])  # [rows, T]
        b.committed = [r.num_tokens for r in b.rows]
        b.pass_k, b.num_new = k, num_new
        b.token_mask = torch.arange(ids.shape[1])[None, :] < num_new[:, None]  # [rows, T]
        b.hidden = self._embed(ids)  # [rows, T, H]

    def _op_attention(self, op: Op) -> None:
        b = self._batches[op.batch]
        if b.hidden is not None:
            b.hidden = self.target.attention(op.layer, b.hidden, b.t_cache)

    def _op_ffn(self, op: Op) -> None:
        b = self._batches[op.batch]
        if b.hidden is not None:
            self._ffn_slot = op.slot
            b.hidden = self.target.ffn(op.layer, b.hidden, b.token_mask)
            self._ffn_slot = -1

    def _op_head(self, op: Op) -> None:
        b = self._batches[op.batch]
        if b.hidden is None:
            return
        assert b.t_cache is not None and b.num_new is not None
        b.t_cache.advance(b.num_new)
        k = b.pass_k
        positions = (b.num_new - k - 1)[:, None] + torch.arange(k + 1)[None, :]  # [rows, k + 1]
        index = positions.to(b.hidden.device)[:, :, None].expand(-1, -1, b.hidden.shape[-1])
        b.logits = self.target.logits(torch.gather(b.hidden, 1, index))  # [rows, k + 1, vocab]
        b.hidden = None

    def _op_verify(self, op: Op) -> None:
        b = self._batches[op.batch]
        if b.logits is None:
            return
        assert b.t_cache is not None
        k = b.pass_k
        drafts = b.drafts if b.drafts is not None else torch.zeros((len(b.rows), 0), dtype=torch.long)  # [rows, k]
        if self._params.greedy:
            result = verify_greedy(drafts, b.logits)
        else:
            p = self._params
            q = warp_logits(b.logits, p.temperature, p.top_p, p.top_k)  # [rows, k + 1, vocab]
            dp = b.p if b.p is not None else q.new_zeros((q.shape[0], 0, q.shape[2]))
            result = verify_sampling(drafts, dp, q, b.verify_gen)
        accepted, emitted = result.num_accepted.tolist(), result.tokens.tolist()
        for n, r in enumerate(b.rows):
            r.num_drafted += k
            r.num_accepted += accepted[n]
            r.commit(emitted[n][: accepted[n] + 1])
        committed = b.committed
        b.t_cache.truncate(torch.tensor([c + a for c, a in zip(committed, accepted)], dtype=torch.long))
        if b.d_cache is not None and k >= 1:  # the draft cache saw committed + d_1..d_{k-1}
            b.d_cache.truncate(torch.tensor([c + min(a, k - 1) for c, a in zip(committed, accepted)], dtype=torch.long))
        b.drafts = b.p = b.logits = None
        keep = [n for n, r in enumerate(b.rows) if not r.finished]
        self._bar.update(len(b.rows) - len(keep))
        if len(keep) < len(b.rows):
            b.rows = [b.rows[n] for n in keep]
            if keep:
                b.t_cache.select_rows(keep)
                if b.d_cache is not None:
                    b.d_cache.select_rows(keep)
            else:
                self._admit(b)

    def _op_draft(self, op: Op) -> None:
        b = self._batches[op.batch]
        if not b.rows or self.draft is None:
            return
        assert b.d_cache is not None
        if op.token == 0:
            d_len = b.d_cache.lengths.tolist()
            ids, num_new = pad_right([r.tokens[d_len[n]:] for n, r in enumerate(b.rows)])  # [rows, T]
            last = num_new - 1  # [rows]
            b.draft_tokens, b.draft_probs = [], []
        else:
            ids = b.draft_tokens[-1][:, None]  # [rows, 1]
            num_new = torch.ones(len(b.rows), dtype=torch.long)
            last = torch.zeros(len(b.rows), dtype=torch.long)
        logits = self.draft.forward(ids, b.d_cache, num_new=num_new, output_positions=last[:, None])[:, 0]  # [rows, V]
        if self._params.greedy:
            token = logits.argmax(dim=-1)  # [rows]
        else:
            p = self._params
            probs = warp_logits(logits, p.temperature, p.top_p, p.top_k)  # [rows, vocab]
            token = torch.multinomial(probs, 1, generator=b.draft_gen).squeeze(1)
            b.draft_probs.append(probs)
        b.draft_tokens.append(token)
        if op.token == self.k - 1:
            b.drafts = torch.stack(b.draft_tokens, dim=1)  # [rows, k]
            b.p = torch.stack(b.draft_probs, dim=1) if b.draft_probs else None  # [rows, k, vocab]
            b.draft_tokens, b.draft_probs = [], []

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        if self.embedding_rows is not None:
            self.embedding_rows.close()


def _inference(handler):  # noqa: ANN001, ANN202 - wraps an op handler
    """inference_mode is per thread: enter it around every op on the worker threads."""

    def run(op: Op) -> None:
        with torch.inference_mode():
            handler(op)

    return run


def expected_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts hit by `tokens` uniform top-k routings."""
    return num_experts * (1 - math.pow(1 - top_k / num_experts, tokens))
