"""The interleaved two-batch schedule, as a list of operations a test can check without threads.

Convention (stated once): **step i, layer j, batch b**; k is the draft length (tokens per round), nothing else.
Step i is one pass of the target's weights. With a drafter there are two batches, b in {0, 1}: at step i the
target verifies batch ``b = i % 2`` ("A") while the drafter proposes tokens for batch ``1 - i % 2`` ("B");
roles swap every step. Without a drafter there is one batch (b = 0), verified every step (layer streaming only,
FlexGen style).

A target pass over batch A at step i is, per layer j:

    load(i, j)  [io]      the layer's streamed weights into ring slot j % num_buffers
    attention(i, j, A)    [cpu]     CPU attention against the host KV cache (after ffn(i, j-1, A))
    ffn(i, j, A)          [device]  FFN / experts with the streamed weights (after attention and load)

bracketed by embed(i, A) [cpu] before layer 0 and head(i, A) [device] + verify(i, A) [cpu] after the last
layer (the head is loaded as pseudo-layer L when it streams). Meanwhile draft(i, B, t) [device], t < draft_ops,
proposes draft token t for batch B (the handler skips t >= the round's k: online re-planning may lower k below
draft_ops = k_max). Dependencies:

- load(i, j) into slot s waits for the last op that used slot s (so at most ``num_buffers`` layers of
  streamed weights are live); it depends on nothing else, so step i+1's first loads start while step i
  still computes.
- embed(i, A) waits for verify of batch A's previous pass and for A's drafts (draft(i-1, A, draft_ops - 1)).
- draft(i, B, 0) waits only for verify of batch B's previous pass, which finished at the end of step i-1
  (the swap): batch B's drafting never waits on batch A's verification of step i.

Each resource runs its ops in list order of priority: an executor picks the first op whose dependencies are
done (so the device runs draft ops while the next ffn waits for its weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

RESOURCES = ("io", "cpu", "device")
KINDS = ("load", "embed", "attention", "ffn", "head", "verify", "draft")
_RESOURCE_OF = {
    "load": "io",
    "embed": "cpu",
    "attention": "cpu",
    "ffn": "device",
    "head": "device",
    "verify": "cpu",
    "draft": "device",
}


@dataclass(frozen=True)
class Op:
    """One operation. `layer` is the pseudo-layer L for the head's load; `token` is the draft token index; `group`
    the expert group of a load or ffn of a layer that streams in expert groups (0 for a whole-layer unit)."""

    id: int
    kind: str
    step: int
    layer: int = -1
    batch: int = -1
    token: int = -1
    slot: int = -1
    deps: tuple[int, ...] = ()
    group: int = -1

    @property
    def resource(self) -> str:
        return _RESOURCE_OF[self.kind]

    def __str__(self) -> str:
        parts = [f"i={self.step}"]
        if self.layer >= 0:
            parts.append(f"j={self.layer}")
        if self.group > 0:
            parts.append(f"g={self.group}")
        if self.batch >= 0:
            parts.append(f"b={self.batch}")
        if self.token >= 0:
            parts.append(f"t={self.token}")
        if self.slot >= 0:
            parts.append(f"slot={self.slot}")
        return f"{self.kind}({', '.join(parts)})"


@dataclass
class PipelineSchedule:
    """Emits the ops of successive steps, keeping the cross-step state (slot owners, last verify per batch).

    num_layers: L; streamed_layers: layers whose weights are loaded per pass (the head is layer L);
    attention_streamed: layers whose attention weights are in their slot (attention then waits for the load);
    num_buffers: ring slots; draft_ops: draft ops per step, the plan's k_max (0: no drafter, one batch, no draft ops).
    interleave: with draft ops, two batches alternate (the default); False: one batch drafts for itself after its
        own verify, its next pass waiting for the drafts (the ring's loads for that pass still start during them).
    keep_ops: keep every op emitted (`ops`, for tests and checks); False (the pipeline): only count them, so a long
        job's memory stays flat (a step's ops refer to earlier ones by id only).
    """

    num_layers: int
    streamed_layers: Sequence[int]
    num_buffers: int = 2
    draft_ops: int = 0
    attention_streamed: Sequence[int] = ()
    interleave: bool = True
    keep_ops: bool = True
    _ops: list[Op] = field(default_factory=list, init=False)
    _emitted: int = field(default=0, init=False)  # ops emitted so far: the next op's id
    _slot_user: dict[int, int] = field(default_factory=dict, init=False)  # slot -> last op id using it
    _next_slot: int = field(default=0, init=False)
    _last_verify: dict[int, int] = field(default_factory=dict, init=False)  # batch -> verify op id
    _last_draft: dict[int, int] = field(default_factory=dict, init=False)  # batch -> last draft op id
    _step: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {self.num_buffers}")
        if self.draft_ops < 0:
            raise ValueError(f"draft_ops must be >= 0, got {self.draft_ops}")
        bad = [u for u in self.streamed_layers if not 0 <= (u[0] if isinstance(u, tuple) else u) <= self.num_layers]
        if bad:
            raise ValueError(f"streamed layers {bad} outside 0..{self.num_layers} (L = the head)")
        # load units (layer, expert group); a plain layer number is the whole layer, unit (j, 0)
        self.streamed_layers = tuple(sorted({u if isinstance(u, tuple) else (u, 0) for u in self.streamed_layers}))
        self.attention_streamed = frozenset(self.attention_streamed)

    @property
    def num_batches(self) -> int:
        return 2 if self.draft_ops > 0 and self.interleave else 1

    @property
    def ops(self) -> list[Op]:
        """Every op emitted so far, in priority order (with keep_ops)."""
        if not self.keep_ops:
            raise RuntimeError("this schedule keeps no ops (keep_ops=False)")
        return list(self._ops)

    def target_batch(self, step: int) -> int:
        return step % self.num_batches

    def draft_batch(self, step: int) -> int | None:
        """The batch drafted for at `step`: the other one when interleaving, the same one when not, or None."""
        if self.draft_ops == 0:
            return None
        return 1 - step % 2 if self.num_batches == 2 else 0

    def next_step(self, target: bool = True, draft: bool = True) -> list[Op]:
        """Ops of the next step. target=False: batch A has no rows (no pass); draft=False: B has no rows."""
        i = self._step
        self._step += 1
        a, b = self.target_batch(i), self.draft_batch(i)
        new: list[Op] = []

        def emit(kind: str, deps: Sequence[int | None] = (), **where: int) -> int:
            op = Op(self._emitted + len(new), kind, i, deps=tuple(sorted({d for d in deps if d is not None})),
                    **where)
            new.append(op)
            return op.id

        drafts: list[tuple[int, int]] = []  # (after this layer, token): where draft ops go in priority order
        if b is not None and draft and (self.interleave or target):
            n = self.draft_ops
            # interleaved: spread through the other batch's pass; one batch: after its own verify (layer L)
            drafts = [((t + 1) * self.num_layers // (n + 1) if self.interleave else self.num_layers, t)
                      for t in range(n)]
        if target:
            loads: dict[tuple[int, int], int] = {}  # load unit -> load op id
            pending = list(self.streamed_layers)

            def issue_load() -> None:  # the next pending load, into the next ring slot
                unit = pending.pop(0)
                slot = self._next_slot
                self._next_slot = (slot + 1) % self.num_buffers
                loads[unit] = emit("load", [self._slot_user.get(slot)], layer=unit[0], group=unit[1], slot=slot)
                self._slot_user[slot] = loads[unit]

            def release(unit: tuple[int, int], user: int) -> None:  # user: the slot's last reader
                self._slot_user[self._slot_of(loads[unit], new)] = user
                if pending:
                    issue_load()

            for _ in range(min(self.num_buffers, len(pending))):
                issue_load()
            prev = emit("embed", [self._last_verify.get(a), self._last_draft.get(a)], batch=a)
            self._last_draft.pop(a, None)
            for j in range(self.num_layers):
                first = loads.get((j, 0))
                streamed_attn = j in self.attention_streamed and first is not None
                attn = emit("attention", [prev, first if streamed_attn else None], layer=j, batch=a,
                            slot=self._slot_of(first, new) if streamed_attn else -1)
                prev = attn
                units = [u for u in self.streamed_layers if u[0] == j] or [(j, -1)]  # -1: resident, no load
                for unit in units:  # an ffn per load unit: a whole layer, or one expert group after another
                    load = loads.get(unit)
                    prev = emit("ffn", [prev, load], layer=j, batch=a, group=unit[1],
                                slot=self._slot_of(load, new))
                    if load is not None:
                        release(unit, prev)
                while drafts and drafts[0][0] <= j:
                    self._emit_draft(emit, i, b, drafts.pop(0)[1])
            head_unit = (self.num_layers, 0)
            head_load = loads.get(head_unit)
            head = emit("head", [prev, head_load], batch=a, slot=self._slot_of(head_load, new))
            if head_load is not None:
                release(head_unit, head)
            self._last_verify[a] = emit("verify", [head], batch=a)
        for _, t in drafts:
            self._emit_draft(emit, i, b, t)
        self._emitted += len(new)
        if self.keep_ops:
            self._ops.extend(new)
        return new

    def _emit_draft(self, emit, step: int, batch: int, token: int) -> None:  # noqa: ANN001
        if token > 0:
            deps = [self._last_draft.get(batch)]
        else:  # B's last verify, and B's drafts no pass verified (B's pass was skipped): they share draft state
            deps = [self._last_verify.get(batch), self._last_draft.get(batch)]
        self._last_draft[batch] = emit("draft", deps, batch=batch, token=token)

    def _slot_of(self, op_id: int | None, new: list[Op]) -> int:
        if op_id is None:
            return -1
        base = self._emitted  # (a slot is only ever asked of this step's ops)
        return new[op_id - base].slot


def check_schedule(ops: Sequence[Op], num_buffers: int) -> None:
    """Raise AssertionError if ops violate the schedule invariants (used by tests and in debug runs).

    - deps point to earlier ops (the list is a valid topological order);
    - every (step, layer, batch) attention and (step, layer, group, batch) ffn appears exactly once per pass;
    - each ffn of a streamed unit depends (directly) on the load of that unit in the same step;
    - a slot is never reloaded before the previous user of that slot is done, so in any topological
      execution at most `num_buffers` loaded layers are live.
    """
    by_id = {op.id: op for op in ops}
    for op in ops:
        for d in op.deps:
            assert d in by_id and d < op.id, f"{op} depends on a later or unknown op {d}"
    seen: set[tuple[str, int, int, int, int]] = set()
    for op in ops:
        if op.kind in ("attention", "ffn"):
            key = (op.kind, op.step, op.layer, op.group, op.batch)
            assert key not in seen, f"{op} computed twice"
            seen.add(key)
    loads = {(op.step, op.layer, op.group): op for op in ops if op.kind == "load"}
    for op in ops:
        if op.kind == "ffn" and (op.step, op.layer, op.group) in loads:
            assert loads[(op.step, op.layer, op.group)].id in op.deps, f"{op} does not wait for its weights"
    users: dict[int, list[Op]] = {}
    for op in ops:
        if op.slot >= 0:
            assert op.slot < num_buffers, f"{op} uses slot {op.slot} >= {num_buffers}"
            users.setdefault(op.slot, []).append(op)
    for slot_ops in users.values():
        last_use: int | None = None
        for op in slot_ops:
            if op.kind == "load":
                if last_use is not None:
                    assert last_use in op.deps, f"{op} overwrites slot {op.slot} before op {last_use} is done"
                last_use = op.id
            else:
                last_use = op.id
