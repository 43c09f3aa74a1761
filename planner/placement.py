"""Where each weight and cache lives: a pure function from model sizes, a policy and budgets to a `Placement`.

Tiers:
    "device"  resident where compute happens (on a CPU-only machine that is host RAM too: `unified_memory`);
    "host"    host RAM: the target KV cache (attention runs on the CPU), and the streamed target weights when
              `weights_tier == "ram"`;
    "disk"    the safetensors files: the streamed target weights when `weights_tier == "disk"`, and the
              embedding table when it is not resident (only the rows of the current tokens are read).

Footprint of a plan (what `place` checks against the budgets):
    device = draft weights + draft KV + resident target parts + num_buffers * slot_bytes
             (+ every host item when `unified_memory`: one pool)
A draft whose parts stand in for the target's (`ModelShape.stands_in`: the low-bit drafter's copies) holds only
those of streamed target parts: a target part made resident frees its stand-in's bytes.
    host   = target KV + target weights on "host"
The target KV is rows x `context` positions, or with `kv_block_size` (paged KV, runtime/kv_blocks.py) a pool of
rows x the expected positions per row (`kv_expected_tokens`, else `context`) rounded up to whole blocks, at least
one full-length row per batch, plus the pool's sink block; the draft KV is always rows x `context`.
where slot_bytes is the largest *slot group* of streamed target parts: all streamed parts of one layer load
together into one ring slot (for MoE the router if streamed and every expert: the worst case of routing), and
the streamed head takes a slot of its own (group index num_layers). The embedding never goes through the ring.
With `expert_group` = g > 0, a streamed MoE layer loads in units of g experts instead (unit (j, 0) also holds
the layer's other streamed parts), each unit into its own slot: the ring is sized per expert group, smaller by
up to E / g (runtime/offload: the ffn then runs one unit at a time, accumulating the experts' outputs).

Nothing here reads files, touches tensors or starts threads; the executor consumes the `Placement`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .errors import SpecOffloadError
from .shapes import ModelShape, PartKey
from .units import format_bytes

TIERS = ("device", "host", "disk")
WEIGHTS_TIERS = ("disk", "ram")

#: part kind -> the category it is reported under (dense MLPs and experts are both the "ffn" of priority_order)
_CATEGORY = {
    "embedding": "embedding",
    "attention": "attention",
    "router": "routers",
    "dense_mlp": "ffn",
    "expert": "experts",
    "head": "head",
}
_CATEGORY_ORDER = ("embedding", "routers", "attention", "ffn", "experts", "head")  # report order of the items
_FFN = ("dense_mlp", "expert")


class PlacementError(SpecOffloadError, ValueError):
    """The models do not fit the memory budgets under this policy, or the policy itself is invalid."""


@dataclass(frozen=True)
class PlacementPolicy:
    """The knobs of a placement. Invalid values raise `PlacementError` at construction."""

    batch_size: int  # rows per decode batch
    num_batches: int = 2  # two interleaved batches with a draft, 1 without
    kv_capacity: int = 2048  # KV positions per row (prompt + new tokens + k + 1)
    num_buffers: int = 2  # ring slots for streamed layer weights (>= 1)
    weights_tier: str = "disk"  # where streamed target weights live: "disk" (safetensors) or "ram" (host memory)
    unified_memory: bool = True  # True on CPU: device memory IS host memory, host items count against both
    pinned: frozenset[PartKey] = frozenset()  # target parts resident in every plan (a drafter shares them)
    expert_group: int = 0  # experts per ring slot of a streamed MoE layer (0: the whole layer in one slot)
    kv_block_size: int = 0  # target KV in blocks of this many positions (runtime/kv_blocks.py); 0: contiguous
    kv_expected_tokens: int = 0  # with blocks: KV positions a row is expected to use, k + 1 included (0: context)
    # a GPU with CPU attention (the paper's design): the target's attention and embedding stay in host RAM, where
    # the attention worker computes with them; they never take device memory or a ring slot
    host_attention: bool = False

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("kv_capacity", 1), ("num_buffers", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PlacementError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.num_batches not in (1, 2) or isinstance(self.num_batches, bool):
            raise PlacementError(
                f"num_batches must be 1 (no draft) or 2 (two interleaved batches with a draft), "
                f"got {self.num_batches!r}"
            )
        if isinstance(self.expert_group, bool) or not isinstance(self.expert_group, int) or self.expert_group < 0:
            raise PlacementError(f"expert_group must be an integer >= 0 (0: whole layers), got {self.expert_group!r}")
        for name in ("kv_block_size", "kv_expected_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlacementError(f"{name} must be an integer >= 0, got {value!r}")
        if self.weights_tier not in WEIGHTS_TIERS:
            raise PlacementError(
                f"weights_tier must be 'disk' (stream from the safetensors files) or 'ram' (keep in host "
                f"memory), got {self.weights_tier!r}"
            )

    def kv_cache_bytes(self, shape: ModelShape) -> int:
        """Bytes of `shape`'s KV cache for every row of every batch at full capacity."""
        return shape.kv_cache_bytes(self.batch_size * self.num_batches, self.kv_capacity)

    @property
    def target_kv_positions(self) -> int:
        """KV positions placed per row of the target: `kv_capacity`; with blocks, the expected use when given (at most
        `kv_capacity`), rounded up to whole blocks."""
        if not self.kv_block_size:
            return self.kv_capacity
        tokens = min(self.kv_expected_tokens or self.kv_capacity, self.kv_capacity)
        return -(-tokens // self.kv_block_size) * self.kv_block_size

    @property
    def kv_blocks(self) -> int:
        """Blocks of the target's KV pool: target_kv_positions / kv_block_size per row, every row of every batch,
        and at least one full-length row (kv_capacity) per batch (0: contiguous caches)."""
        if not self.kv_block_size:
            return 0
        by_rows = self.batch_size * self.num_batches * self.target_kv_positions // self.kv_block_size
        one_row = -(-self.kv_capacity // self.kv_block_size)
        return max(by_rows, self.num_batches * one_row)  # (a full-length row per batch always fits: progress)

    def target_kv_cache_bytes(self, target: ModelShape) -> int:
        """Bytes of the target's KV cache: every row of every batch at `target_kv_positions`; paged, the pool's
        `kv_blocks` blocks and its sink block (runtime/kv_blocks.py)."""
        if self.kv_block_size:
            return target.kv_cache_bytes(1, (self.kv_blocks + 1) * self.kv_block_size)
        return target.kv_cache_bytes(self.batch_size * self.num_batches, self.target_kv_positions)

    @property
    def host_kinds(self) -> tuple[str, ...]:
        """Part kinds resident in host RAM beside the host KV cache (`host_attention`), never on the device."""
        return ("attention", "embedding") if self.host_attention else ()

    @property
    def streamed_tier(self) -> str:
        """The tier of a target part that is not resident: "disk" or "host"."""
        return "disk" if self.weights_tier == "disk" else "host"

    def describe(self) -> str:
        return (
            f"batch_size={self.batch_size}, num_batches={self.num_batches}, kv_capacity={self.kv_capacity}, "
            f"num_buffers={self.num_buffers}, weights_tier={self.weights_tier!r}"
            + (f", expert_group={self.expert_group}" if self.expert_group else "")
            + (f", kv_block_size={self.kv_block_size}" if self.kv_block_size else "")
            + (f", kv_expected_tokens={self.kv_expected_tokens}" if self.kv_expected_tokens else "")
            + (", host_attention=True" if self.host_attention else "")
        )


@dataclass(frozen=True)
class PlacementItem:
    """One row of the placement table."""

    name: str
    tier: str  # one of TIERS
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """Tier of every target part, the ring geometry, and the table of what lives where."""

    tiers: Mapping[PartKey, str] = field(hash=False)  # target part -> "device" | "host" | "disk" (read-only)
    streamed_layers: tuple[int, ...]  # layers with a streamed part; the streamed head counts as num_layers
    slot_bytes: int  # bytes of one ring slot: the largest streamed slot group
    num_buffers: int
    policy: PlacementPolicy
    items: tuple[PlacementItem, ...]
    device_memory: int
    host_memory: int

    def tier(self, key: PartKey) -> str:
        try:
            return self.tiers[key]
        except KeyError:
            raise KeyError(f"{key} is not a part of the placed target model") from None

    def is_streamed(self, key: PartKey) -> bool:
        """True if the part is loaded into a ring slot before use (the embedding never is: rows are gathered; nor are
        host-resident attention parts under `host_attention`)."""
        return key.kind != "embedding" and key.kind not in self.policy.host_kinds and self.tier(key) != "device"

    def bytes_by_tier(self) -> dict[str, int]:
        """tier -> sum of the items on it (every tier present, possibly 0)."""
        totals = dict.fromkeys(TIERS, 0)
        for item in self.items:
            totals[item.tier] += item.nbytes
        return totals

    def device_bytes(self) -> int:
        """What counts against device_memory: device items, plus host items under unified memory."""
        totals = self.bytes_by_tier()
        return totals["device"] + (totals["host"] if self.policy.unified_memory else 0)

    def host_bytes(self) -> int:
        return self.bytes_by_tier()["host"]

    def table(self) -> str:
        """Plain-text table (item, tier, bytes) with per-tier totals and budgets, for the CLI."""
        width = max([len("item"), *(len(item.name) for item in self.items)])
        lines = [f"{'item':<{width}}  {'tier':<6}  {'bytes':>10}", f"{'-' * width}  {'-' * 6}  {'-' * 10}"]
        lines += [f"{i.name:<{width}}  {i.tier:<6}  {format_bytes(i.nbytes):>10}" for i in self.items]
        totals = self.bytes_by_tier()
        lines.append(f"{'-' * width}  {'-' * 6}  {'-' * 10}")
        lines.append(f"{'total':<{width}}  {'device':<6}  {format_bytes(totals['device']):>10}")
        lines.append(f"{'total':<{width}}  {'host':<6}  {format_bytes(totals['host']):>10}")
        lines.append(f"{'total':<{width}}  {'disk':<6}  {format_bytes(totals['disk']):>10}")
        pool = " (device + host items: unified memory)" if self.policy.unified_memory else ""
        lines.append(f"device budget: {format_bytes(self.device_bytes())} of {format_bytes(self.device_memory)}{pool}")
        lines.append(f"host budget:   {format_bytes(totals['host'])} of {format_bytes(self.host_memory)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (per-part tiers are summarised as counts per kind and tier)."""
        counts: dict[str, dict[str, int]] = {}
        for key, tier in self.tiers.items():
            by_tier = counts.setdefault(key.kind, {})
            by_tier[tier] = by_tier.get(tier, 0) + 1
        return {
            "policy": {**asdict(self.policy), "pinned": sorted(f"{k.kind}:{k.layer}" for k in self.policy.pinned)},
            "device_memory": self.device_memory,
            "host_memory": self.host_memory,
            "device_bytes": self.device_bytes(),
            "bytes_by_tier": self.bytes_by_tier(),
            "slot_bytes": self.slot_bytes,
            "num_buffers": self.num_buffers,
            "streamed_layers": list(self.streamed_layers),
            "part_tiers": counts,
            "items": [asdict(item) for item in self.items],
        }


def priority_order(target: ModelShape, pinned: frozenset[PartKey] = frozenset(), expert_group: int = 0,
                   num_buffers: int = 2) -> tuple[tuple[PartKey, ...], ...]:
    """The steps in which target parts become resident, highest priority first; each step is all-or-nothing.

    0. the head, first, where that never grows a plan (`head_first`): streamed, a head H larger than every layer
       unit L sizes every ring slot, so making it resident adds H once and takes num_buffers x (H - L) off the
       ring; when H (n - 1) >= n L (n = num_buffers) that is no more than it adds, so every set of other parts
       costs no more with the head resident than without, and every budget keeps at least the steps it kept with
       the head after the attention, and the head besides;
    1. routers, layer 0 upward: tiny and needed by every token to pick the experts;
    2. attention, layer 0 upward: used by every token of every row, and small next to the ffn;
    3. the head (where step 0 did not take it): once per pass, large (vocab x hidden);
    4. the ffn (dense_mlp, or all experts of a MoE layer), whole layers in `spread_order`: it dominates the
       bytes, so it is what streams; resident and streamed layers alternate as evenly as possible, so that
       loading a streamed layer overlaps the compute of the resident layers before it (a block of streamed
       layers at the end would leave the loader idle for the first half of the pass and the device waiting for
       it in the second);
    5. the embedding last: when it is not resident only the rows of the current tokens are read.
    """
    by_kind: dict[str, list[PartKey]] = {}
    ffn: dict[int, list[PartKey]] = {}
    for key, _ in target.parts:
        if key in pinned:  # resident in every plan: not a step
            continue
        if key.kind in _FFN:
            ffn.setdefault(key.layer, []).append(key)
        else:
            by_kind.setdefault(key.kind, []).append(key)
    head = [(key,) for key in by_kind.get("head", [])]
    first = head if head_first(target, pinned, expert_group, num_buffers) else []
    steps: list[tuple[PartKey, ...]] = list(first)
    steps += [(key,) for key in sorted(by_kind.get("router", []))]
    steps += [(key,) for key in sorted(by_kind.get("attention", []))]
    steps += [] if first else head
    layers = sorted(ffn)
    steps += [tuple(ffn[layers[n]]) for n in spread_order(len(layers))]
    steps += [(key,) for key in by_kind.get("embedding", [])]
    return tuple(steps)


def head_first(target: ModelShape, pinned: frozenset[PartKey] = frozenset(), expert_group: int = 0,
               num_buffers: int = 2) -> bool:
    """Whether the head becomes resident before every other part (`priority_order` step 0): its slot bytes H and
    the largest layer unit's L, with every part but `pinned` streamed, satisfy H (n - 1) >= n L > 0 for n =
    `num_buffers` (the head resident then never makes a plan larger: it adds H and takes n (H - L) off the ring)."""
    in_slot = dict(target.parts) | target.slot_bytes()
    units = _unit_bytes(((key, in_slot[key]) for key, _ in target.parts), target.num_layers, expert_group, pinned)
    head = units.pop((target.num_layers, 0), 0)
    layer = max(units.values(), default=0)
    return layer > 0 and head * (num_buffers - 1) >= num_buffers * layer


def spread_order(n: int) -> list[int]:
    """0..n-1 ordered so that every prefix is spread evenly over the range (bit-reversal / van der Corput order).

    spread_order(8) == [0, 4, 2, 6, 1, 5, 3, 7]; for other n, the van der Corput points scaled to n, deduplicated.
    """
    order: list[int] = []
    seen: set[int] = set()
    bits = max(1, (n - 1).bit_length())
    for i in range(1 << bits):
        reversed_i = int(format(i, f"0{bits}b")[::-1], 2)
        index = reversed_i * n >> bits
        if index not in seen:
            seen.add(index)
            order.append(index)
    order += [i for i in range(n) if i not in seen]
    return order


def minimum_device_memory(target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy) -> int:
    """The smallest device footprint over the placement chain (usually: every streamable target part streamed)."""
    return min(device for device, _ in _footprints(target, draft, policy))


def place(
    target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy, device_memory: int, host_memory: int
) -> Placement:
    """Place the target (and draft) within the budgets; see the module docstring for the footprint.

    The draft weights, draft KV cache and the ring are mandatory on the device; the target KV cache is on the
    host. Target parts then become resident step by step in `priority_order`: the plan is the longest prefix of
    those steps whose footprint fits both budgets. More budget never makes fewer parts resident. Raises
    `PlacementError` stating the minimum budgets when no prefix fits.
    """
    chain = _footprints(target, draft, policy)
    fitting = [k for k, (device, host) in enumerate(chain) if device <= device_memory and host <= host_memory]
    if not fitting:
        raise PlacementError(_no_fit_message(target, draft, policy, chain, device_memory, host_memory))
    steps = priority_order(target, policy.pinned | _host_parts(target, policy), policy.expert_group,
                           policy.num_buffers)
    resident = set(policy.pinned) | {key for step in steps[: fitting[-1]] for key in step}
    layout = _layout(target, draft, policy, resident)
    return Placement(
        tiers=MappingProxyType(dict(layout.tiers)),
        streamed_layers=layout.streamed_layers,
        slot_bytes=layout.slot_bytes,
        num_buffers=policy.num_buffers,
        policy=policy,
        items=layout.items,
        device_memory=device_memory,
        host_memory=host_memory,
    )


# --- internals -------------------------------------------------------------------------------------------


def _footprints(target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy) -> list[tuple[int, int]]:
    """(device, host) footprint of every prefix of `priority_order(target)`: index k = first k steps resident
    (the policy's pinned parts are resident in all of them).

    Incremental, O(steps * layers); the items `_layout` builds for a resident set add up to the same numbers.
    """
    nbytes = target.resident_bytes()  # a resident part's bytes (packed, where the target holds them packed)
    in_slot = dict(target.parts) | target.slot_bytes()  # a streamed part's bytes in a ring slot
    stored = target.stored_bytes()  # the RAM tier holds compressed parts compressed
    tier_total = sum(stored.get(key, n) for key, n in target.parts)
    draft_bytes = draft.total_bytes + policy.kv_cache_bytes(draft) if draft is not None else 0
    stand_ins = dict(draft.parts) if draft is not None and draft.stands_in else {}  # freed by a resident target part
    on_host = _host_parts(target, policy)
    kv = policy.target_kv_cache_bytes(target) + sum(nbytes[key] for key in on_host)  # host-resident attention too
    slots = _unit_bytes(((key, in_slot[key]) for key in nbytes), target.num_layers, policy.expert_group,
                        on_host)  # load unit -> streamed bytes
    resident = 0  # target weight bytes resident on the device
    # bytes (as stored) the RAM tier does not hold: the device-resident parts, and the host-resident ones (in kv)
    resident_stored = sum(stored.get(key, nbytes[key]) for key in on_host)
    scratch = packed_scratch_units(target, policy, on_host)  # load unit -> compressed stored bytes streamed

    def footprint() -> tuple[int, int]:
        host = kv + (tier_total - resident_stored if policy.weights_tier == "ram" else 0)
        ring = policy.num_buffers * max(slots.values(), default=0)
        loading = max(scratch.values(), default=0) if ring else 0  # nothing streamed: no load, no scratch
        return draft_bytes + resident + ring + loading + (host if policy.unified_memory else 0), host

    steps = priority_order(target, policy.pinned | on_host, policy.expert_group, policy.num_buffers)
    chain = []
    for step in [tuple(policy.pinned), *steps]:
        for key in step:
            resident += nbytes[key]
            draft_bytes -= stand_ins.get(key, 0)
            resident_stored += stored.get(key, nbytes[key])
            group = slot_unit(key, target.num_layers, policy.expert_group)
            if group is not None:
                slots[group] -= in_slot[key]
                if key in stored and group in scratch:
                    scratch[group] -= stored[key]
        chain.append(footprint())
    return chain


def _host_parts(target: ModelShape, policy: PlacementPolicy) -> frozenset[PartKey]:
    """The target parts resident in host RAM under `host_attention` (attention and embedding), else none."""
    return frozenset(key for key, _ in target.parts if key.kind in policy.host_kinds)


def _unit_bytes(pairs: Iterable[tuple[PartKey, int]], num_layers: int, expert_group: int,
                skip: frozenset[PartKey] | set[PartKey] = frozenset()) -> dict[tuple[int, int], int]:
    """Load unit (`slot_unit`) -> the summed bytes of the (part, bytes) `pairs` not in `skip` (the embedding has
    no unit)."""
    units: dict[tuple[int, int], int] = {}
    for key, n in pairs:
        unit = slot_unit(key, num_layers, expert_group)
        if unit is not None and key not in skip:
            units[unit] = units.get(unit, 0) + n
    return units


def slot_unit(key: PartKey, num_layers: int, expert_group: int = 0) -> tuple[int, int] | None:
    """The load unit of a streamed part, (layer, group): (num_layers, 0) for the head, None for the embedding;
    with expert_group g > 0 expert e of layer j is in (j, e // g) and the layer's other parts in (j, 0)."""
    if key.kind == "embedding":
        return None
    if key.kind == "head":
        return num_layers, 0
    return key.layer, key.expert // expert_group if key.kind == "expert" and expert_group else 0




@dataclass(frozen=True)
class _Layout:
    """The plan for one resident set."""

    tiers: tuple[tuple[PartKey, str], ...]
    streamed_layers: tuple[int, ...]
    slot_bytes: int
    items: tuple[PlacementItem, ...]


def packed_scratch_units(target: ModelShape, policy: PlacementPolicy,
                         resident: frozenset[PartKey] | set[PartKey] = frozenset()) -> dict[tuple[int, int], int]:
    """Load unit -> the stored bytes of its compressed parts that stream (not in `resident`), read from disk."""
    if policy.weights_tier != "disk":
        return {}
    return _unit_bytes(target.stored, target.num_layers, policy.expert_group, resident)


def packed_scratch_bytes(target: ModelShape, policy: PlacementPolicy,
                         resident: frozenset[PartKey] | set[PartKey] = frozenset()) -> int:
    """The loader's scratch for the compressed bytes of one load read from disk (runtime/offload/streamer.py
    `_packed_scratch`): the largest load unit's stored bytes of compressed parts that stream."""
    return max(packed_scratch_units(target, policy, resident).values(), default=0)


def _layout(target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy, resident: set[PartKey]) -> _Layout:
    tiers: list[tuple[PartKey, str]] = []
    slots: dict[tuple[int, int], int] = {}  # load unit -> streamed bytes
    buckets: dict[tuple[str, str], list[Any]] = {}  # (category, tier) -> [bytes, set of layers]
    on_host = _host_parts(target, policy)
    stored, in_slot, held = target.stored_bytes(), target.slot_bytes(), target.resident_bytes()
    for key, nbytes in target.parts:
        tier = "host" if key in on_host else "device" if key in resident else policy.streamed_tier
        tiers.append((key, tier))
        group = slot_unit(key, target.num_layers, policy.expert_group)
        if tier != "device" and group is not None and key not in on_host:
            slots[group] = slots.get(group, 0) + in_slot.get(key, nbytes)
        bucket = buckets.setdefault((_CATEGORY[key.kind], tier), [0, set(), 0])
        bucket[0] += held[key] if tier == "device" else stored.get(key, nbytes)  # off the device: as stored
        bucket[1].add(key.layer)
        bucket[2] += 1
    slot_bytes = max(slots.values(), default=0)

    items: list[PlacementItem] = []
    if draft is not None:
        items.append(PlacementItem("draft weights", "device", draft.held_bytes(resident)))
        items.append(PlacementItem("draft KV cache", "device", policy.kv_cache_bytes(draft)))
    for category in _CATEGORY_ORDER:
        if (category, "device") in buckets:
            nbytes, layers, parts = buckets[category, "device"]
            items.append(PlacementItem(_label(category, layers, parts, streamed=False), "device", nbytes))
    if slot_bytes:
        unit = f" (units of {policy.expert_group} experts)" if policy.expert_group else ""
        ring = f"ring buffers {policy.num_buffers} x {format_bytes(slot_bytes)}{unit}"
        items.append(PlacementItem(ring, "device", policy.num_buffers * slot_bytes))
        scratch = packed_scratch_bytes(target, policy, resident | on_host)
        if scratch:
            items.append(PlacementItem("compressed bytes of one load (read before decompression)", "device", scratch))
    host_categories = {_CATEGORY[kind] for kind in policy.host_kinds}
    for category in _CATEGORY_ORDER:
        if (category, policy.streamed_tier) in buckets and category not in host_categories:
            nbytes, layers, parts = buckets[category, policy.streamed_tier]
            items.append(PlacementItem(_label(category, layers, parts, streamed=True), policy.streamed_tier, nbytes))
    for category in sorted(host_categories, key=_CATEGORY_ORDER.index):
        if (category, "host") in buckets:
            nbytes, layers, parts = buckets[category, "host"]
            items.append(PlacementItem(f"{_label(category, layers, parts, streamed=False)} (host: CPU attention)",
                                       "host", nbytes))
    items.append(PlacementItem("target KV cache", "host", policy.target_kv_cache_bytes(target)))
    return _Layout(tuple(tiers), tuple(sorted({layer for layer, _ in slots})), slot_bytes, tuple(items))


def _label(category: str, layers: set[int], parts: int, streamed: bool) -> str:
    if category == "embedding":
        return "target embedding" if not streamed else "target embedding (rows read on demand)"
    if category == "head":
        return "target head (streamed)" if streamed else "target head"
    count = f"{len(layers)} layer{'s' if len(layers) != 1 else ''}"
    if category == "experts":
        count += f", {parts} experts"
    return f"target {category} ({'streamed, ' if streamed else ''}{count})"


def _no_fit_message(
    target: ModelShape,
    draft: ModelShape | None,
    policy: PlacementPolicy,
    chain: list[tuple[int, int]],
    device_memory: int,
    host_memory: int,
) -> str:
    pair = f"target {target.name!r}" + (f" with draft {draft.name!r}" if draft is not None else "")
    min_device = min(device for device, _ in chain)
    problems = []
    if device_memory < min_device:
        problems.append(
            f"at least {format_bytes(min_device)} ({min_device} bytes) of device memory "
            f"(budget {format_bytes(device_memory)})"
        )
    device_ok = [host for device, host in chain if device <= device_memory]
    min_host = min(device_ok) if device_ok else min(host for _, host in chain)
    if host_memory < min_host:
        problems.append(
            f"at least {format_bytes(min_host)} ({min_host} bytes) of host memory (budget {format_bytes(host_memory)})"
        )
    # the floor: one row, one ring slot, no draft, at the job's KV length; below it only a larger budget helps
    floor = minimum_device_memory(target, None, replace(policy, batch_size=1, num_batches=1, num_buffers=1))
    if device_memory < floor:
        hint = (f"no batch size, ring or draft fits under {format_bytes(floor)} (one row, one buffer, no draft, "
                f"{policy.kv_capacity} KV positions): raise device_memory to at least {format_bytes(floor)}")
    else:
        hint = f"lower batch_size, kv_capacity or num_buffers, or raise device_memory to {format_bytes(min_device)}"
        if policy.weights_tier == "ram":
            hint += ", or stream the weights from disk (weights_tier='disk')"
    return f"{pair} does not fit: with {policy.describe()} it needs {' and '.join(problems)}; {hint}."
