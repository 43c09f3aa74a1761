"""The pure two-batch pipeline schedule (runtime/offload/schedule.py), checked without threads.

Layout: literal schedules worked out by hand, then hypothesis properties over random configurations
(layers, streamed layers, ring slots, draft tokens, skipped passes): op counts and batch roles, weights loaded
before use, at most `num_buffers` live slots in any execution order, the batch-ordering rules of the swap and the
prefetch across the step boundary. Convention as in the module: step i, layer j, batch k, draft token t.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime.offload.schedule import RESOURCES, Op, PipelineSchedule, check_schedule

# --- helpers ------------------------------------------------------------------------------------------------


def ancestors(ops: Sequence[Op]) -> dict[int, int]:
    """op id -> bitmask of the ids it transitively depends on (deps point to earlier ops)."""
    anc: dict[int, int] = {}
    for op in ops:
        mask = 0
        for d in op.deps:
            mask |= anc[d] | (1 << d)
        anc[op.id] = mask
    return anc


def depends(anc: dict[int, int], op: Op, on: Op) -> bool:
    return bool(anc[op.id] >> on.id & 1)


def lines(ops: Sequence[Op]) -> list[str]:
    return [f"{op.id} {op} <- {list(op.deps)}" for op in ops]


@dataclass(frozen=True)
class Config:
    num_layers: int
    streamed: frozenset[int]
    num_buffers: int
    draft_ops: int
    attention_streamed: frozenset[int]
    passes: tuple[tuple[bool, bool], ...]  # per step: (target, draft)
    groups: tuple[tuple[int, int], ...] = ()  # (layer, units) for layers that stream in expert groups
    interleave: bool = True

    @property
    def units(self) -> list[tuple[int, int]]:
        """The load units: each streamed layer j as (j, 0) .. (j, n - 1) with n its expert groups (1: whole)."""
        per_layer = dict(self.groups)
        return sorted((j, g) for j in self.streamed for g in range(per_layer.get(j, 1)))

    def build(self) -> tuple[PipelineSchedule, list[list[Op]]]:
        sched = PipelineSchedule(
            self.num_layers, self.units, self.num_buffers, self.draft_ops, self.attention_streamed, self.interleave
        )
        steps = [sched.next_step(target=target, draft=draft) for target, draft in self.passes]
        return sched, steps


@st.composite
def configs(draw: st.DrawFn, all_streamed: bool = False) -> Config:
    num_layers = draw(st.integers(1, 8))
    streamed = frozenset(range(num_layers + 1)) if all_streamed else draw(st.frozensets(st.integers(0, num_layers)))
    candidates = sorted(j for j in streamed if j < num_layers)
    attention = draw(st.frozensets(st.sampled_from(candidates))) if candidates else frozenset()
    groups = tuple((j, draw(st.integers(1, 3))) for j in candidates)  # some layers stream in expert groups
    passes = draw(
        st.lists(
            st.tuples(st.sampled_from([True, True, True, False]), st.sampled_from([True, True, False])),
            min_size=1,
            max_size=6,
        )
    )
    return Config(
        num_layers,
        streamed,
        draw(st.integers(2, 4) if all_streamed else st.integers(1, 4)),
        draw(st.integers(0, 5)),
        attention,
        tuple(passes),
        groups,
    )


def find(ops: Sequence[Op], kind: str, step: int, **where: int) -> Op:
    found = [
        op for op in ops if op.kind == kind and op.step == step and all(getattr(op, k) == v for k, v in where.items())
    ]
    assert len(found) == 1, f"{kind} step {step} {where}: {found}"
    return found[0]


def random_execution(ops: Sequence[Op], rnd: random.Random) -> Iterator[tuple[str, Op]]:
    """One random concurrent execution: repeatedly start any op whose deps are finished, or finish any running
    op. Yields ("start" | "end", op). Any number of ops may run at once (more freedom than the executor has)."""
    by_id = {op.id: op for op in ops}
    waiting_on = {op.id: len(op.deps) for op in ops}
    users: dict[int, list[int]] = {op.id: [] for op in ops}
    for op in ops:
        for d in op.deps:
            users[d].append(op.id)
    ready = [i for i, n in waiting_on.items() if n == 0]
    running: list[int] = []
    while ready or running:
        if ready and (not running or rnd.random() < 0.5):
            i = ready.pop(rnd.randrange(len(ready)))
            running.append(i)
            yield "start", by_id[i]
        else:
            i = running.pop(rnd.randrange(len(running)))
            yield "end", by_id[i]
            for u in users[i]:
                waiting_on[u] -= 1
                if waiting_on[u] == 0:
                    ready.append(u)


def slot_readers(ops: Sequence[Op], load: Op, num_layers: int, attention_streamed: frozenset[int]) -> list[Op]:
    """The ops that read `load`'s weights, by meaning (not by the schedule's deps): the ffn of that unit (the
    layer, or one expert group of it), the attention of an attention-streamed layer (its first unit), the head
    for the head's pseudo-layer L."""
    step_ops = [op for op in ops if op.step == load.step]
    if load.layer == num_layers:
        return [op for op in step_ops if op.kind == "head"]
    readers = [op for op in step_ops if op.kind == "ffn" and op.layer == load.layer and op.group == load.group]
    if load.layer in attention_streamed and load.group == 0:
        readers += [op for op in step_ops if op.kind == "attention" and op.layer == load.layer]
    return readers


# --- literal schedules ---------------------------------------------------------------------------------------


def test_two_layers_all_streamed_two_buffers_one_draft_token() -> None:
    # Step 0 verifies batch 0 and drafts batch 1; step 1 swaps. The head streams as pseudo-layer 2.
    sched = PipelineSchedule(2, [0, 1, 2], num_buffers=2, draft_ops=1)
    sched.next_step()
    sched.next_step()
    assert lines(sched.ops) == [
        "0 load(i=0, j=0, slot=0) <- []",
        "1 load(i=0, j=1, slot=1) <- []",
        "2 embed(i=0, b=0) <- []",
        "3 attention(i=0, j=0, b=0) <- [2]",
        "4 ffn(i=0, j=0, b=0, slot=0) <- [0, 3]",
        "5 load(i=0, j=2, slot=0) <- [4]",  # the head's load reuses slot 0 once ffn(0, 0) is done
        "6 attention(i=0, j=1, b=0) <- [4]",
        "7 ffn(i=0, j=1, b=0, slot=1) <- [1, 6]",
        "8 draft(i=0, b=1, t=0) <- []",  # batch 1 has never been verified: nothing to wait for
        "9 head(i=0, b=0, slot=0) <- [5, 7]",
        "10 verify(i=0, b=0) <- [9]",
        "11 load(i=1, j=0, slot=1) <- [7]",  # prefetch: waits for slot 1's last reader, not for verify(0)
        "12 load(i=1, j=1, slot=0) <- [9]",
        "13 embed(i=1, b=1) <- [8]",  # batch 1's target pass waits for its draft from step 0
        "14 attention(i=1, j=0, b=1) <- [13]",
        "15 ffn(i=1, j=0, b=1, slot=1) <- [11, 14]",
        "16 load(i=1, j=2, slot=1) <- [15]",
        "17 attention(i=1, j=1, b=1) <- [15]",
        "18 ffn(i=1, j=1, b=1, slot=0) <- [12, 17]",
        "19 draft(i=1, b=0, t=0) <- [10]",  # the swap: batch 0 drafts after its own verify of step 0
        "20 head(i=1, b=1, slot=1) <- [16, 18]",
        "21 verify(i=1, b=1) <- [20]",
    ]
    check_schedule(sched.ops, 2)
    assert [op.resource for op in sched.ops[:11]] == [
        "io",
        "io",
        "cpu",
        "cpu",
        "device",
        "io",
        "cpu",
        "device",
        "device",
        "device",
        "cpu",
    ]


def test_one_batch_without_draft_streams_one_layer_through_one_buffer() -> None:
    sched = PipelineSchedule(2, [1], num_buffers=1)
    first, second = sched.next_step(), sched.next_step()
    assert lines(first) == [
        "0 load(i=0, j=1, slot=0) <- []",
        "1 embed(i=0, b=0) <- []",
        "2 attention(i=0, j=0, b=0) <- [1]",
        "3 ffn(i=0, j=0, b=0) <- [2]",
        "4 attention(i=0, j=1, b=0) <- [3]",
        "5 ffn(i=0, j=1, b=0, slot=0) <- [0, 4]",
        "6 head(i=0, b=0) <- [5]",
        "7 verify(i=0, b=0) <- [6]",
    ]
    assert lines(second) == [
        "8 load(i=1, j=1, slot=0) <- [5]",  # overlaps step 0's head and verify
        "9 embed(i=1, b=0) <- [7]",
        "10 attention(i=1, j=0, b=0) <- [9]",
        "11 ffn(i=1, j=0, b=0) <- [10]",
        "12 attention(i=1, j=1, b=0) <- [11]",
        "13 ffn(i=1, j=1, b=0, slot=0) <- [8, 12]",
        "14 head(i=1, b=0) <- [13]",
        "15 verify(i=1, b=0) <- [14]",
    ]
    assert sched.draft_batch(0) is None and sched.target_batch(1) == 0


def test_attention_streamed_layer_waits_for_its_load() -> None:
    sched = PipelineSchedule(1, [0], num_buffers=1, attention_streamed=[0])
    assert lines(sched.next_step()) == [
        "0 load(i=0, j=0, slot=0) <- []",
        "1 embed(i=0, b=0) <- []",
        "2 attention(i=0, j=0, b=0, slot=0) <- [0, 1]",
        "3 ffn(i=0, j=0, b=0, slot=0) <- [0, 2]",
        "4 head(i=0, b=0) <- [3]",
        "5 verify(i=0, b=0) <- [4]",
    ]


def test_skipped_pass_keeps_each_batch_in_order() -> None:
    # Step 1 has no target pass (batch 1 has no rows): only batch 0 drafts. Step 2 verifies batch 0 again.
    sched = PipelineSchedule(1, [], num_buffers=1, draft_ops=2)
    for target in (True, False, True):
        sched.next_step(target=target)
    assert lines(sched.ops) == [
        "0 embed(i=0, b=0) <- []",
        "1 attention(i=0, j=0, b=0) <- [0]",
        "2 ffn(i=0, j=0, b=0) <- [1]",
        "3 draft(i=0, b=1, t=0) <- []",
        "4 draft(i=0, b=1, t=1) <- [3]",
        "5 head(i=0, b=0) <- [2]",
        "6 verify(i=0, b=0) <- [5]",
        "7 draft(i=1, b=0, t=0) <- [6]",
        "8 draft(i=1, b=0, t=1) <- [7]",
        "9 embed(i=2, b=0) <- [6, 8]",
        "10 attention(i=2, j=0, b=0) <- [9]",
        "11 ffn(i=2, j=0, b=0) <- [10]",
        # Batch 1's drafts of step 0 were never verified; its new drafts come after them, not beside them.
        "12 draft(i=2, b=1, t=0) <- [4]",
        "13 draft(i=2, b=1, t=1) <- [12]",
        "14 head(i=2, b=0) <- [11]",
        "15 verify(i=2, b=0) <- [14]",
    ]


def test_draft_tokens_spread_between_layers_in_priority_order() -> None:
    # k = 3 drafts over L = 8 layers go after layers 2, 4 and 6: the device has draft work between ffns.
    sched = PipelineSchedule(8, [], draft_ops=3)
    ops = sched.next_step()
    after = [max((o.layer for o in ops[: op.id] if o.kind == "ffn"), default=-1) for op in ops if op.kind == "draft"]
    assert after == [2, 4, 6]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_buffers": 0}, "num_buffers"),
        ({"draft_ops": -1}, "draft_ops"),
        ({"streamed_layers": [0, 4]}, "outside 0..3"),
        ({"streamed_layers": [-1]}, "outside 0..3"),
    ],
)
def test_rejects_bad_configuration(kwargs: dict[str, object], message: str) -> None:
    args = {"num_layers": 3, "streamed_layers": [0], **kwargs}
    with pytest.raises(ValueError, match=message):
        PipelineSchedule(**args)


def test_check_schedule_catches_broken_schedules() -> None:
    sched = PipelineSchedule(2, [0, 1, 2], num_buffers=2, draft_ops=1)
    sched.next_step()
    ops = sched.ops
    check_schedule(ops, 2)
    # ffn(0, 0) no longer waits for its weights.
    no_wait = [replace(op, deps=(3,)) if op.id == 4 else op for op in ops]
    with pytest.raises(AssertionError, match="does not wait for its weights"):
        check_schedule(no_wait, 2)
    # The head's load overwrites slot 0 while ffn(0, 0) may still read it.
    overwrite = [replace(op, deps=()) if op.id == 5 else op for op in ops]
    with pytest.raises(AssertionError, match="overwrites slot 0"):
        check_schedule(overwrite, 2)
    with pytest.raises(AssertionError, match="slot 1 >= 1"):
        check_schedule(ops, 1)
    forward = [replace(op, deps=(9,)) if op.id == 3 else op for op in ops]
    with pytest.raises(AssertionError, match="later or unknown"):
        check_schedule(forward, 2)
    twice = [*ops, replace(ops[4], id=len(ops))]
    with pytest.raises(AssertionError, match="computed twice"):
        check_schedule(twice, 2)


# --- properties over random configurations --------------------------------------------------------------------

PROPERTY = settings(max_examples=150, deadline=None)


@PROPERTY
@given(configs())
def test_ops_per_step_and_batch_roles(cfg: Config) -> None:
    sched, steps = cfg.build()
    ops = sched.ops
    check_schedule(ops, cfg.num_buffers)
    assert [op.id for op in ops] == list(range(len(ops)))
    assert [op for step in steps for op in step] == ops
    k, num_layers = cfg.draft_ops, cfg.num_layers
    for i, (step_ops, (target, draft)) in enumerate(zip(steps, cfg.passes)):
        assert {op.step for op in step_ops} <= {i}
        assert all(op.resource in RESOURCES for op in step_ops)
        a = i % 2 if k > 0 else 0
        b = 1 - i % 2 if k > 0 else None
        assert sched.target_batch(i) == a and sched.draft_batch(i) == b
        count = Counter((op.kind, op.layer, op.batch) for op in step_ops if op.kind != "draft")
        expected: Counter[tuple[str, int, int]] = Counter()
        if target:
            units = cfg.units
            expected.update(("load", j, -1) for j, _ in units)
            expected.update(("attention", j, a) for j in range(num_layers))
            expected.update(("ffn", j, a) for j in range(num_layers) for _ in range(max(1, dict(cfg.groups).get(
                j, 1 if j in cfg.streamed else 0))))
            expected.update([("embed", -1, a), ("head", -1, a), ("verify", -1, a)])
        assert count == expected
        drafts = [(op.batch, op.token) for op in step_ops if op.kind == "draft"]
        assert drafts == ([(b, t) for t in range(k)] if k > 0 and draft else [])


@PROPERTY
@given(configs())
def test_weights_are_loaded_before_use(cfg: Config) -> None:
    sched, _ = cfg.build()
    ops = sched.ops
    anc = ancestors(ops)
    for op in ops:
        if op.kind == "load":
            assert 0 <= op.slot < cfg.num_buffers
            for reader in slot_readers(ops, op, cfg.num_layers, cfg.attention_streamed):
                assert depends(anc, reader, op), f"{reader} does not wait for {op}"
        elif op.kind in ("ffn", "head"):
            loaded = (op.layer, op.group) in cfg.units if op.kind == "ffn" else cfg.num_layers in cfg.streamed
            assert (op.slot >= 0) == loaded


@PROPERTY
@given(configs(), st.integers(0, 2**32 - 1))
def test_live_slots_never_exceed_num_buffers_in_any_execution_order(cfg: Config, seed: int) -> None:
    rnd = random.Random(seed)
    sched, _ = cfg.build()
    ops = sched.ops
    readers = {op.id: slot_readers(ops, op, cfg.num_layers, cfg.attention_streamed) for op in ops if op.kind == "load"}
    reads: dict[int, list[int]] = {}  # reader id -> the loads whose weights it reads
    for load_id, rs in readers.items():
        for r in rs:
            reads.setdefault(r.id, []).append(load_id)
    for _ in range(3):
        live: dict[int, set[int]] = {}  # load id -> readers not finished yet
        content: dict[int, int] = {}  # slot -> load id whose weights it holds
        started: set[int] = set()
        for event, op in random_execution(ops, rnd):
            if event == "start":
                started.add(op.id)
                if op.kind == "load":
                    old = content.get(op.slot)
                    assert old is None or old not in live, f"{op} overwrites slot {op.slot} still read by {live[old]}"
                    content[op.slot] = op.id
                    live[op.id] = {r.id for r in readers[op.id]}
                    assert len(live) <= cfg.num_buffers, f"{len(live)} live layers > {cfg.num_buffers} buffers"
                else:
                    for load_id in reads.get(op.id, ()):
                        assert load_id in started, f"{op} starts before {ops[load_id]}"
                        assert content[ops[load_id].slot] == load_id, f"{op} reads overwritten weights"
            else:
                for load_id in [lid for lid, pending in live.items() if op.id in pending]:
                    live[load_id].discard(op.id)
                    if not live[load_id]:
                        del live[load_id]
        assert started == {op.id for op in ops} and not live


@PROPERTY
@given(configs())
def test_each_batch_runs_in_order_and_drafting_never_waits_on_the_other_batch(cfg: Config) -> None:
    sched, steps = cfg.build()
    ops = sched.ops
    anc = ancestors(ops)
    k = cfg.draft_ops
    # Every op of one batch mutates that batch's state (KV cache, tokens): they must be totally ordered.
    for batch in (0, 1):
        own = [op for op in ops if op.batch == batch]
        for earlier, later in zip(own, own[1:]):
            assert depends(anc, later, earlier), f"{later} may run beside {earlier}"
    last_verify: dict[int, Op] = {}
    last_draft: dict[int, Op] = {}
    for i, step_ops in enumerate(steps):
        a = i % 2 if k > 0 else 0
        for op in step_ops:
            if op.kind != "draft":
                continue
            b = op.batch
            assert b == 1 - a
            in_step = [ops[d] for d in range(op.id) if anc[op.id] >> d & 1 and ops[d].step == i]
            assert all(d.kind == "draft" and d.batch == b for d in in_step), f"{op} waits on {in_step}"
            if op.token == 0 and b in last_verify:
                assert last_verify[b].id in op.deps
            if op.token > 0:
                assert find(step_ops, "draft", i, batch=b, token=op.token - 1).id in op.deps
        for op in step_ops:
            if op.kind == "embed":
                assert op.batch == a
                pending = a in last_draft and (a not in last_verify or last_draft[a].id > last_verify[a].id)
                if pending:  # A's drafts not verified yet: the pass checks them, so it waits for the last one
                    assert last_draft[a].token == k - 1 and last_draft[a].id in op.deps
                if k > 0 and i > 0 and cfg.passes[i - 1][1]:
                    assert pending and last_draft[a].step == i - 1
                if a in last_verify:
                    assert last_verify[a].id in op.deps
            if op.kind == "verify":
                last_verify[op.batch] = op
            if op.kind == "draft":
                last_draft[op.batch] = op


@PROPERTY
@given(configs())
def test_first_loads_never_wait_for_the_previous_steps_verify(cfg: Config) -> None:
    # A step's first loads (one per slot) wait only for slot reuse: they start while the previous step computes.
    sched, steps = cfg.build()
    ops = sched.ops
    anc = ancestors(ops)
    first = [load for step_ops in steps for load in [op for op in step_ops if op.kind == "load"][: cfg.num_buffers]]
    for load in first:
        late = [ops[d] for d in range(load.id) if anc[load.id] >> d & 1 and ops[d].step >= load.step - 1]
        assert not [d for d in late if d.kind in ("verify", "draft")], f"{load} waits on {late}"


@PROPERTY
@given(configs(all_streamed=True))
def test_next_steps_first_load_overlaps_this_steps_head(cfg: Config) -> None:
    sched, steps = cfg.build()
    ops = sched.ops
    anc = ancestors(ops)
    passes = [i for i, (target, _) in enumerate(cfg.passes) if target]
    for i, nxt in zip(passes, passes[1:]):
        first_load = find(steps[nxt], "load", nxt, layer=0, group=0)
        for kind in ("head", "verify"):
            assert not depends(anc, first_load, find(steps[i], kind, i)), f"{first_load} waits for {kind}({i})"


def test_a_layer_streamed_in_expert_groups_runs_one_ffn_per_group() -> None:
    """Layer 0 streams in two expert units, layer 1 whole, the head resident: the ffn of layer 0 is two ops, one
    per unit, in order, each after its own load; with one slot the second unit's load waits for the first ffn."""
    sched = PipelineSchedule(2, [(0, 0), (0, 1), (1, 0)], num_buffers=1)
    assert lines(sched.next_step()) == [
        "0 load(i=0, j=0, slot=0) <- []",
        "1 embed(i=0, b=0) <- []",
        "2 attention(i=0, j=0, b=0) <- [1]",
        "3 ffn(i=0, j=0, b=0, slot=0) <- [0, 2]",
        "4 load(i=0, j=0, g=1, slot=0) <- [3]",
        "5 ffn(i=0, j=0, g=1, b=0, slot=0) <- [3, 4]",
        "6 load(i=0, j=1, slot=0) <- [5]",
        "7 attention(i=0, j=1, b=0) <- [5]",
        "8 ffn(i=0, j=1, b=0, slot=0) <- [6, 7]",
        "9 head(i=0, b=0) <- [8]",
        "10 verify(i=0, b=0) <- [9]",
    ]
    check_schedule(sched.ops, 1)


def test_one_batch_drafts_for_itself_between_its_passes() -> None:
    """interleave=False: the single batch's k draft ops follow its own verify, and its next pass (embed) waits for
    the last of them; the next pass's first load does not (the ring streams on while the drafter works)."""
    sched = PipelineSchedule(1, [0], num_buffers=1, draft_ops=2, interleave=False)
    assert sched.num_batches == 1 and sched.draft_batch(0) == 0
    first, second = sched.next_step(), sched.next_step()
    assert lines(first)[-3:] == [
        "5 verify(i=0, b=0) <- [4]",
        "6 draft(i=0, b=0, t=0) <- [5]",
        "7 draft(i=0, b=0, t=1) <- [6]",
    ]
    embed = find(second, "embed", 1)
    load = find(second, "load", 1, layer=0)
    assert embed.deps == (5, 7)
    assert load.deps == (3,)  # only the slot's last reader of step 0 (its ffn), not the drafts
    check_schedule(sched.ops, 1)


@PROPERTY
@given(configs())
def test_one_batch_drafting_keeps_the_invariants(cfg: Config) -> None:
    """interleave=False over random configurations: the schedule invariants hold, every op is batch 0's, each
    step's drafts follow its own verify, and the next pass waits for them."""
    from dataclasses import replace as with_

    sched, steps = with_(cfg, interleave=False).build()
    ops = sched.ops
    check_schedule(ops, cfg.num_buffers)
    anc = ancestors(ops)
    assert {op.batch for op in ops} <= {-1, 0}
    last_draft = None
    for step_ops, (_, drafting) in zip(steps, cfg.passes):
        drafts = [op for op in step_ops if op.kind == "draft"]
        verify = [op for op in step_ops if op.kind == "verify"]
        assert len(drafts) == (cfg.draft_ops if verify and drafting else 0)
        for op in drafts:
            assert depends(anc, op, verify[0])
        embed = [op for op in step_ops if op.kind == "embed"]
        if embed and last_draft is not None:
            assert depends(anc, embed[0], last_draft)
        if drafts:
            last_draft = drafts[-1]
