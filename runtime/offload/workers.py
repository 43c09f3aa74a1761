"""The workers of the offloaded pipeline, as plain classes (one per resource / actor role), and their bundle.

  PrefetchWorker   io      streams a layer's non-resident target weights into a ring slot
  AttentionWorker  cpu     target embedding + attention against the host KV caches (one per batch; paged: one
                           pool of KV blocks for both, runtime/kv_blocks.py)
  VerifierWorker   device  target FFN / experts / head with resident or slot weights; verification
  drafter          device  a `Drafter` (drafters.py): proposes draft tokens for the other batch

`Workers` bundles one of each; a `WorkerFactory` builds the bundle for a weight plan: `local_workers` in this
process (the engine's executor threads call them), or role actors behind proxies (actors/). Workers hold no
request state: the coordinator sends token ids and row indices, and gets tensors or small results back. The
methods marked `@wire` are the whole interface a remote caller sees (wire.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specoffload.planner.placement import Placement, slot_unit
from specoffload.planner.plan import Plan
from specoffload.planner.shapes import ModelShape, PartKey

from ..config import EngineConfig
from ..kv_blocks import BlockPool, OutOfBlocksError, PagedKVCache
from ..kv_cache import KVCache
from ..models.model import MoEPartial, Transformer
from ..models.weights import Weights
from ..sampling import SamplingParams
from ..speculative import verify_rows
from .batch_kv import BatchKV
from .direct_io import ALIGN
from .drafters import Drafter, TargetShare, drafter_class, make_drafter
from .embedding import EmbeddingRows
from .slot_sync import SlotSync
from .streamer import TENSOR_ALIGN, WeightStreamer
from .wire import wire

Tensor = torch.Tensor


@dataclass(frozen=True)
class WeightPlan:
    """The placement as the workers need it: what is resident, what streams, and how slot loads are grouped.

    load_groups: load unit (layer, group) -> parts loaded together into one slot by a load op; the head is unit
        (num_layers, 0); a streamed layer is one unit (j, 0), or with expert_group g its experts come in units of
        g experts (j, 0), (j, 1), ... (unit (j, 0) also holds the layer's other streamed parts).
    selected_experts: MoE experts are not in load_groups; the ffn op loads the routed ones into its slot.
    """

    resident: tuple[PartKey, ...]
    streamed: tuple[PartKey, ...]
    load_groups: Mapping[tuple[int, int], tuple[PartKey, ...]]
    slot_bytes: int
    num_buffers: int
    embedding_tier: str
    selected_experts: bool
    attention_streamed: tuple[int, ...] = field(default=())
    draft_experts: int = 0  # a resident-expert drafter's experts per layer (the plan's; 0: another drafter)
    expert_group: int = 0  # experts per load unit of a streamed MoE layer (0: the whole layer)
    num_experts: int = 0
    kv_block_size: int = 0  # positions per block of the target's paged KV pool (0: contiguous caches)
    kv_blocks: int = 0  # blocks of that pool: the placement's target KV bytes / bytes per block

    @classmethod
    def from_placement(cls, placement: Placement, num_layers: int, num_experts: int, selected: bool,
                       draft_experts: int = 0) -> WeightPlan:
        embedding = PartKey("embedding")
        on_host = placement.policy.host_kinds  # CPU attention beside a GPU: attention resident in host RAM
        resident = [key for key, tier in placement.tiers.items()
                    if tier == "device" or (key.kind in on_host and key != embedding)]
        if placement.tier(embedding) == "host":
            resident.append(embedding)  # on the host tier it is a plain resident table of the host-side worker
        streamed = [key for key, tier in placement.tiers.items()
                    if tier != "device" and key != embedding and key.kind not in on_host]
        expert_group = placement.policy.expert_group
        groups: dict[tuple[int, int], list[PartKey]] = {}
        for key in streamed:
            groups.setdefault(slot_unit(key, num_layers, expert_group), []).append(key)
        if selected:
            groups = {j: [k for k in keys if k.kind != "expert"] for j, keys in groups.items()}
        fields = 8 * (num_experts + 4 if num_experts else 4)  # per-tensor alignment margin inside a slot
        return cls(
            resident=tuple(resident),
            streamed=tuple(streamed),
            load_groups={j: tuple(keys) for j, keys in groups.items()},
            slot_bytes=placement.slot_bytes + TENSOR_ALIGN * fields if streamed else 0,
            num_buffers=placement.num_buffers,
            embedding_tier=placement.tier(embedding),
            selected_experts=selected,
            attention_streamed=tuple(sorted(unit[0] for unit, ks in groups.items()
                                            if any(k.kind == "attention" for k in ks))),
            draft_experts=draft_experts,
            expert_group=expert_group,
            num_experts=num_experts,
            kv_block_size=placement.policy.kv_block_size,
            kv_blocks=placement.policy.kv_blocks,
        )

    @classmethod
    def all_resident(cls, target: ModelShape, num_buffers: int) -> WeightPlan:
        """Nothing streams (no device_memory): every part of `target` resident where compute runs."""
        return cls(resident=tuple(key for key, _ in target.parts), streamed=(), load_groups={}, slot_bytes=0,
                   num_buffers=num_buffers, embedding_tier="device", selected_experts=False)

    def units(self) -> list[tuple[int, int]]:
        """The load units, in schedule order."""
        return sorted(self.load_groups)

    def groups_of(self, layer: int) -> int:
        """How many load units layer `layer`'s ffn comes in (0: resident)."""
        return sum(1 for j, _ in self.load_groups if j == layer)

    def experts_of(self, group: int) -> range:
        """The expert ids of expert group `group` of a layer that streams in expert groups."""
        if not self.expert_group:
            return range(self.num_experts)
        return range(group * self.expert_group, min((group + 1) * self.expert_group, self.num_experts))


#: each of the disk reader's two staging buffers holds a slot's bytes, at most this (a larger unit is read in
#: parts); a RAM tier reads none
STAGING_MAX = 64 << 20


def _slot_streamer(model: Transformer, plan: WeightPlan, config: EngineConfig, slots: Sequence[Tensor] | None,
                   loads: bool, sync: SlotSync | None = None) -> WeightStreamer | None:
    """A streamer over the shared slot buffers: loads (PrefetchWorker, routed experts) or only views them; every
    streamer over the same slots shares one `SlotSync` (the copy / compute ordering on CUDA)."""
    if not plan.streamed:
        return None
    source = config.weights_tier if loads else "disk"  # a view-only streamer never reads, so never preloads
    return WeightStreamer(
        model.loader, plan.slot_bytes, plan.num_buffers, source, compute_device(config),
        staging_bytes=min(STAGING_MAX, plan.slot_bytes + 2 * ALIGN) if loads and source == "disk" else 4 * ALIGN,
        parts=list(plan.streamed) if loads else None, slots=slots,
        sync=sync, packed=config.packed_slots,
    )


def compute_device(config: EngineConfig) -> torch.device:
    """Where the target's FFN / experts / head, the ring slots and the draft live: the config's device."""
    return torch.device(config.device)


#: where verification runs, and the target's embedding, attention and KV cache offloaded beside a GPU: host RAM
HOST = torch.device("cpu")


def attention_device(config: EngineConfig) -> torch.device:
    """Where the target's embedding, attention and KV cache live: host RAM when offloaded beside a GPU (the CPU
    computes attention, `EngineConfig.host_attention`), else the compute device."""
    return HOST if config.host_attention else compute_device(config)


class _SlotReader:
    """Transformer fetch hook of a worker that computes with streamed weights: views of the op's slot."""

    def __init__(self, streamer: WeightStreamer | None, plan: WeightPlan, expert_loader: WeightStreamer | None = None):
        self.streamer, self.plan, self.expert_loader = streamer, plan, expert_loader
        self.slot = -1
        self.unit: tuple[int, int] = (-1, -1)

    def __call__(self, keys: list[PartKey]) -> dict[PartKey, Weights]:
        if self.streamer is None or self.slot < 0:
            raise RuntimeError(f"parts {keys} are not resident and no slot is bound: schedule bug")
        group = list(self.plan.load_groups.get(self.unit, ()))
        out = {}
        staged = [key for key in keys if key in group]
        if staged:
            views = self.streamer.views(self.slot, group)
            out = {key: views[key] for key in staged}
        routed = [key for key in keys if key not in out]
        if routed:
            if not (self.plan.selected_experts and self.expert_loader is not None
                    and all(k.kind == "expert" for k in routed)):
                raise RuntimeError(f"parts {routed} are neither resident nor in slot {self.slot}: schedule bug")
            sync = self.streamer.sync
            sync.after_use(self.slot)  # the routed experts' load into this slot waits for what was queued so far
            out |= self.expert_loader.load(self.slot, routed)  # routed experts only, into this layer's slot
            sync.before_use(self.slot)
        return out

    def bind(self, layer: int, slot: int, group: int = 0) -> _SlotReader:
        self.unit, self.slot = (layer, group), slot
        return self

    def __enter__(self) -> _SlotReader:
        if self.slot >= 0 and self.streamer is not None:
            self.streamer.sync.before_use(self.slot)  # the compute stream waits for the slot's load
        return self

    def __exit__(self, *exc: object) -> None:
        if self.slot >= 0 and self.streamer is not None:
            self.streamer.sync.after_use(self.slot)  # the next load into the slot waits for the reads queued here
        self.unit, self.slot = (-1, -1), -1


class PrefetchWorker:
    """io: fills ring slots with a layer's streamed weights (disk with O_DIRECT, or the host-RAM tier)."""

    def __init__(self, config: EngineConfig, plan: WeightPlan, slots: Sequence[Tensor] | None = None,
                 sync: SlotSync | None = None) -> None:
        self.plan = plan
        self.model = Transformer(config.target, dtype=config.torch_dtype, device=compute_device(config),
                                 packed=config.packed_resident)
        self.streamer = _slot_streamer(self.model, plan, config, slots, loads=True, sync=sync)

    @property
    def slots(self) -> list[Tensor]:
        return list(self.streamer._slots) if self.streamer is not None else []

    @property
    def sync(self) -> SlotSync | None:
        """The slots' copy / compute protocol, for the workers that read them (None: nothing streams)."""
        return self.streamer.sync if self.streamer is not None else None

    @property
    def bytes_read(self) -> int:
        return self.streamer.bytes_read if self.streamer is not None else 0

    @wire
    def load(self, layer: int, group: int, slot: int) -> None:
        """Stream load unit (layer, group) (the head: (L, 0)) into ring slot `slot`."""
        keys = self.plan.load_groups.get((layer, group), ())
        if self.streamer is not None:  # (no parts: the slot is still claimed, e.g. for routed experts loaded later)
            self.streamer.load(slot, list(keys))

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()


class AttentionWorker(BatchKV):
    """cpu: the target's embedding and attention blocks over one host KV cache per batch."""

    def __init__(self, config: EngineConfig, plan: WeightPlan, slots: Sequence[Tensor] | None = None,
                 sync: SlotSync | None = None) -> None:
        self.plan = plan
        self.model = Transformer(config.target, dtype=config.torch_dtype, device=attention_device(config),
                                 packed=config.packed_resident, exact=config.exact)
        mine = [k for k in plan.resident if k.kind in ("attention", "embedding")]
        self.model.preload(mine)
        self.reader = _SlotReader(_slot_streamer(self.model, plan, config, slots, loads=False, sync=sync), plan)
        self.model.fetch = self.reader
        self.rows: EmbeddingRows | None = None
        if plan.embedding_tier == "disk":
            name = self.model.loader.refs(PartKey("embedding"))["embed"].name
            self.rows = EmbeddingRows(self.model.loader.checkpoint, name, self.model.dtype)
        self.caches: dict[int, KVCache | PagedKVCache] = {}
        self.pool = kv_pool(self.model, plan)

    def new_cache(self, rows: int, capacity: int) -> KVCache | PagedKVCache:
        if self.pool is not None:
            return PagedKVCache(self.pool, rows, capacity)
        return self.model.new_cache(rows, capacity)

    @wire
    def free_blocks(self) -> int:
        """Free blocks of the paged KV pool (0 with contiguous caches)."""
        return self.pool.free_blocks if self.pool is not None else 0

    @wire
    def reserve(self, batch: int, num_new: Sequence[int]) -> int:
        """Before batch `batch`'s pass: give each row the blocks of its num_new[r] real positions (kv_blocks.py
        `reserve`). Returns the blocks still missing (0: reserved; else nothing changed, and that many more must
        be freed, e.g. by preempting rows). Contiguous caches need nothing: 0."""
        cache = self.caches.get(batch)
        if not isinstance(cache, PagedKVCache):
            return 0
        try:
            cache.reserve(list(num_new))
        except OutOfBlocksError as exc:
            return exc.needed - exc.free
        return 0

    @wire
    def block_size(self) -> int:
        """Positions per block of the paged KV pool (0: contiguous caches)."""
        return self.pool.block_size if self.pool is not None else 0

    @property
    def bytes_read(self) -> int:
        return self.rows.bytes_read if self.rows is not None else 0

    @wire(keep_outputs=True)
    def embed(self, ids: Tensor) -> Tensor:
        """ids [rows, T] -> hidden [rows, T, H]."""
        with torch.inference_mode():
            return self.rows(ids) if self.rows is not None else self.model.embed(ids)

    @wire(keep_outputs=True)
    def attention(self, batch: int, layer: int, slot: int, hidden: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """hidden [rows, T, H] -> [rows, T, H]; writes K/V of the T new positions (advance comes later);
        token_mask [rows, T]: the valid ones (a ragged pass computes those only)."""
        with self.reader.bind(layer, slot):
            return self.model.attention(layer, hidden.to(self.model.device), self.caches[batch], token_mask)

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()


def kv_pool(model: Transformer, plan: WeightPlan) -> BlockPool | None:
    """The attention worker's pool of target KV blocks, shared by its per-batch caches: `plan.kv_blocks` blocks
    of `plan.kv_block_size` positions (the placement's target KV); None for contiguous caches."""
    if not plan.kv_block_size or not plan.kv_blocks:
        return None
    cfg = model.config
    return BlockPool(cfg.num_layers, plan.kv_blocks, plan.kv_block_size, *cfg.cache_geometry, model.dtype, model.device)


class VerifierWorker:
    """device: the target's FFN / experts and head (resident or from the op's slot), and verification."""

    def __init__(self, config: EngineConfig, plan: WeightPlan, slots: Sequence[Tensor] | None = None,
                 sync: SlotSync | None = None) -> None:
        self.plan = plan
        self.model = Transformer(config.target, dtype=config.torch_dtype, device=compute_device(config),
                                 packed=config.packed_resident, exact=config.exact)
        mine = [k for k in plan.resident if k.kind in ("dense_mlp", "router", "expert", "head")]
        self.model.preload(mine)
        views = _slot_streamer(self.model, plan, config, slots, loads=False, sync=sync)
        experts = (_slot_streamer(self.model, plan, config, slots, loads=True, sync=views.sync if views else None)
                   if plan.selected_experts else None)
        self.reader = _SlotReader(views, plan, experts)
        self.model.fetch = self.reader
        self.model.on_route = self._count_routing
        self.routing: dict[int, Tensor] = {}  # batch -> [L, E] tokens routed since last read
        self._batch = -1  # the batch whose ffn runs now (its routing is counted for it)
        self.partial: dict[int, MoEPartial] = {}  # batch -> its MoE block in progress (expert groups)

    @property
    def bytes_read(self) -> int:
        return self.reader.expert_loader.bytes_read if self.reader.expert_loader is not None else 0

    @wire(keep_outputs=True)
    def ffn(self, batch: int, layer: int, group: int, slot: int, hidden: Tensor, token_mask: Tensor | None) -> Tensor:
        """hidden [rows, T, H] -> [rows, T, H] through layer `layer`'s FFN / experts (token_mask [rows, T]).

        A layer that streams in expert groups runs one group per call, in order: the first routes, each adds its
        experts' outputs (kept here per batch), the last returns the combination; the others return `hidden`."""
        units = self.plan.groups_of(layer)
        self._batch = batch
        host = hidden.device  # the attention worker's (the CPU): the result goes back there
        hidden = hidden.to(self.model.device)
        token_mask = None if token_mask is None else token_mask.to(self.model.device)
        with self.reader.bind(layer, slot, max(group, 0)):
            if units <= 1 or not self.model.config.is_moe_layer(layer):
                return self.model.ffn(layer, hidden, token_mask).to(host)
            if group == 0:
                self.partial[batch] = self.model.moe_route(layer, hidden, token_mask)
            state = self.partial[batch]
            self.model.moe_experts(state, self.plan.experts_of(group))
            if group < units - 1:
                return hidden.to(host)
            del self.partial[batch]
            return self.model.moe_finish(state, hidden).to(host)

    @wire(keep_outputs=True)
    def head(self, slot: int, hidden: Tensor, positions: Tensor) -> Tensor:
        """hidden [rows, T, H], positions [rows, P] -> logits [rows, P, vocab] (float32)."""
        hidden = hidden.to(self.model.device)
        index = positions.to(hidden.device)[:, :, None].expand(-1, -1, hidden.shape[-1])
        with self.reader.bind(self.model.config.num_layers, slot, 0):
            return self.model.logits(torch.gather(hidden, 1, index)).to(HOST)  # (verification runs on the host)

    @wire
    def logits(self, logits: Tensor) -> Tensor:
        """The head's logits [rows, P, vocab] in the caller's hands: the identity here; over the wire (where the
        head's output stays in this role's arena) a copy for the caller, for rows whose logits it processes itself
        (penalties, min_tokens, logprobs: runtime/logits_process.py) before handing them back to `verify`."""
        return logits

    @wire
    def routing_counts(self, batch: int) -> list[list[int]]:
        """Tokens the target routed to each (layer, expert) in batch `batch`'s passes since the last call (expert
        hotness; [] for a dense layer), counting every valid token, prefill included; resets them. Per batch, so a
        caller reading after a batch's verify gets whole passes, whatever the other batch's pass is doing."""
        cfg = self.model.config
        counts = self.routing.pop(batch, None)
        if counts is None:
            counts = torch.zeros(cfg.num_layers, max(cfg.num_experts, 1), dtype=torch.long)
        return [counts[j].tolist() if cfg.is_moe_layer(j) else [] for j in range(cfg.num_layers)]

    def _count_routing(self, layer: int, ids: Tensor) -> None:
        """Add the routing of the valid tokens, ids [n, k], to the current batch's counts."""
        cfg = self.model.config
        counts = self.routing.setdefault(self._batch, torch.zeros(cfg.num_layers, max(cfg.num_experts, 1),
                                                                   dtype=torch.long))
        counts[layer] += torch.bincount(ids.reshape(-1).cpu(), minlength=counts.shape[1])

    @wire
    def verify(self, logits: Tensor, drafts: Tensor, num_drafts: list[int], p: Tensor | None,
               params: SamplingParams, seeds: list[int] | None,
               warps: list[list[float]] | None = None) -> tuple[list[int], list[list[int]]]:
        """Greedy match or rejection sampling of ragged drafts, each row at its own warping when `warps` is given
        (runtime/speculative.py `verify_rows`): (accepted per row, emitted tokens per row). On the host: a GPU
        drafter's tokens and probabilities come over here beside the head's logits."""
        return verify_rows(logits, drafts, num_drafts, p, params, seeds, warps)


@dataclass
class Workers:
    """One of each worker: in this process (`local_workers`) or proxies of role actors (actors/)."""

    prefetch: PrefetchWorker
    attention: AttentionWorker
    verifier: VerifierWorker
    drafter: Drafter

    @property
    def bytes_read(self) -> int:
        """Bytes read from the weights tier so far, by every worker that reads (slots, embedding rows, experts)."""
        return self.prefetch.bytes_read + self.attention.bytes_read + self.verifier.bytes_read

    def close(self) -> None:
        for worker in (self.prefetch, self.attention, self.verifier, self.drafter):
            close = getattr(worker, "close", None)
            if close is not None:
                close()


#: builds the workers of an engine for its weight plan and run plan (the local backend, or role actors)
WorkerFactory = Callable[[EngineConfig, WeightPlan, Plan], Workers]


def worker_classes(config: EngineConfig) -> dict[str, type]:
    """role -> worker class; each is built as cls(config, weight plan, slot tensors or None). Backends derive
    their roles and proxies from this table and the classes' `@wire` methods."""
    return {"prefetch": PrefetchWorker, "attention": AttentionWorker, "verifier": VerifierWorker,
            "draft": drafter_class(config)}


def local_workers(config: EngineConfig, weights: WeightPlan, plan: Plan, drafter: type | None = None,
                  sync: SlotSync | None = None) -> Workers:
    """The workers in this process; they share the prefetcher's ring slots and its `SlotSync`. drafter: a drafter
    class to use instead of the config's (e.g. a benchmark's random drafter), when the plan speculates; sync: the
    slot protocol to use (default: events on CUDA, none on the CPU; tests pass a `RecordingSlotSync`)."""
    prefetch = PrefetchWorker(config, weights, sync=sync)
    slots, sync = prefetch.slots, prefetch.sync
    attention = AttentionWorker(config, weights, slots, sync=sync)
    draft = drafter(config, weights, slots) if drafter is not None and plan.drafting else None
    verifier = VerifierWorker(config, weights, slots, sync=sync)
    share = TargetShare(attention.caches, {**attention.model.resident, **verifier.model.resident}, attention.embed)
    return Workers(prefetch, attention, verifier, draft or make_drafter(config, plan, weights, share))
