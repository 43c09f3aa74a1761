"""What the base layer knows of a model: its loadable parts, their bytes, and its KV bytes per token.

A model is cut into independently loadable *parts*, named by `PartKey`, in execution order:

    embedding -> for each layer j: attention(j), then dense_mlp(j) or [router(j), expert(j, e) for each e] -> head

`ModelShape` is all that placement and the cost model need: every part with its bytes in the compute dtype, and,
for a compressed checkpoint (runtime/quant.py), the bytes each compressed part is stored and streamed as.
The runtime builds one from a checkpoint's tensor headers (`WeightLoader.shape`); the planner builds them from
published configs (planner/paper_scale/). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

PART_KINDS = ("embedding", "attention", "dense_mlp", "router", "expert", "head")


@dataclass(frozen=True, order=True)
class PartKey:
    """Names one loadable part: kind in PART_KINDS; layer for per-layer parts; expert for kind "expert"."""

    kind: str
    layer: int = -1
    expert: int = -1


@dataclass(frozen=True)
class ModelShape:
    """What placement needs to know about one model, in the compute dtype."""

    name: str
    parts: tuple[tuple[PartKey, int], ...]  # every part with its bytes, in execution order
    num_layers: int
    kv_bytes_per_token: int  # K + V bytes of one token over all layers
    # parts stored compressed, with their stored bytes (read from disk, held in the RAM tier); the rest are
    # stored as they are computed with (their bytes in `parts`)
    stored: tuple[tuple[PartKey, int], ...] = ()
    hidden_bytes_per_token: int = 0  # one token's hidden state (hidden_size x compute-dtype bytes); 0: unknown
    # parts that take fewer bytes in a ring slot than resident (int8 weights kept packed in the slot,
    # runtime/models/packed.py), with their slot bytes; the rest take their bytes in `parts` in a slot too
    slotted: tuple[tuple[PartKey, int], ...] = ()
    # resident parts are held as a slot holds them (packed), so they too take their `slotted` bytes
    resident_packed: bool = False
    # a draft whose parts stand in for the target's parts of the same key (runtime/offload/drafters/lowbit.py): it
    # holds one only while that target part streams, and drafts with the target's own while it is resident
    stands_in: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 0 or self.kv_bytes_per_token < 0:
            raise ValueError(f"{self.name}: num_layers and kv_bytes_per_token must be >= 0")
        seen: set[PartKey] = set()
        for key, nbytes in self.parts:
            if key.kind not in PART_KINDS:
                raise ValueError(f"{self.name}: unknown part kind {key.kind!r}; expected one of {PART_KINDS}")
            per_layer = key.kind not in ("embedding", "head")
            if per_layer and not 0 <= key.layer < self.num_layers:
                raise ValueError(f"{self.name}: {key} is outside layers 0..{self.num_layers - 1}")
            if nbytes < 0 or key in seen:
                raise ValueError(f"{self.name}: {key} has negative bytes or appears twice")
            seen.add(key)
        for what, pairs in (("stored", self.stored), ("slot", self.slotted)):
            for key, nbytes in pairs:
                if key not in seen or nbytes < 0:
                    raise ValueError(f"{self.name}: {what} bytes for {key}, which is not a part or has negative bytes")

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.parts)

    def held_bytes(self, target_resident: set[PartKey] | frozenset[PartKey]) -> int:
        """Bytes of the parts it holds while the target keeps `target_resident` resident: all of them, or for a
        stand-in draft (`stands_in`) those of target parts that stream."""
        if not self.stands_in:
            return self.total_bytes
        return sum(nbytes for key, nbytes in self.parts if key not in target_resident)

    def stored_bytes(self) -> dict[PartKey, int]:
        """Compressed part -> its stored bytes (absent: stored as computed with)."""
        return dict(self.stored)

    def slot_bytes(self) -> dict[PartKey, int]:
        """Part -> the bytes it takes in a ring slot, where that differs from its bytes in `parts`."""
        return dict(self.slotted)

    def resident_bytes(self) -> dict[PartKey, int]:
        """Part -> the bytes it takes resident: its slot bytes where `resident_packed`, else its bytes in `parts`."""
        return dict(self.parts) | (dict(self.slotted) if self.resident_packed else {})

    def kv_cache_bytes(self, rows: int, kv_capacity: int) -> int:
        """Bytes of this model's KV cache for `rows` rows of `kv_capacity` positions each."""
        return self.kv_bytes_per_token * kv_capacity * rows


def self_draft_shape(target: ModelShape, experts_per_layer: int, name: str = "self-draft",
                     shares_kv: bool = False) -> ModelShape:
    """The target's own resident-expert drafter as a model of its own (runtime/offload/drafters.py): the first
    `experts_per_layer` experts of each MoE layer (which ones are resident changes, their bytes do not: experts of
    one layer are the same size), plus, unless it shares the target's in one process (shares_kv: the local
    backend, where it also drafts into the target's KV cache), every other part (embedding, attention, routers
    with any shared expert, head) and a second KV cache of the target's shape. Sharing needs those parts resident
    in the target (runtime/engine.py checks the placement)."""
    if experts_per_layer < 1:
        raise ValueError(f"{target.name}: a resident-expert drafter keeps at least 1 expert per layer")
    if not any(key.kind == "expert" for key, _ in target.parts):
        raise ValueError(f"{target.name} has no routed experts: it cannot draft with a subset of them")
    parts = tuple((key, n) for key, n in target.parts
                  if (key.expert < experts_per_layer if key.kind == "expert" else not shares_kv))
    kept = {key for key, _ in parts}
    return ModelShape(name, parts, target.num_layers, 0 if shares_kv else target.kv_bytes_per_token,
                      tuple((key, n) for key, n in target.stored if key in kept), target.hidden_bytes_per_token)
