"""The four worker roles as actor classes: thin wrappers that serve a plain worker (runtime/offload/workers.py).

    PrefetchRole   PrefetchWorker   owns the ring slots (shared-memory arenas) and streams weights into them
    AttentionRole  AttentionWorker  attaches the slots; embedding + attention over its host KV caches
    VerifierRole   VerifierWorker   attaches the slots; FFN / experts / head and verification
    DraftRole      DraftWorker      the resident draft model and its KV caches

A role is a plain class (actors/launcher.py makes it a Ray actor; tests can run one in-process). Its Ray methods
are control only: `setup` builds the worker and starts a ZeroMQ server thread, `pid`, `ping`, `address`,
`shutdown`. The hot path never goes through Ray: the server thread answers `WorkerCall` messages (msgpack over an
ipc:// socket derived from the role's pid) by calling the worker method with zero-copy views of the tensor
arguments, writes tensor results into its own output arenas and replies with their `TensorRef`s.

Shared memory goes through `ShmTensors` (runtime/transport/shm.py), as in the coordinator's proxies. Arena files
carry the owner's pid: `setup` sweeps the files (and ipc sockets) of dead owners, e.g. the previous incarnation of
a role that was killed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.offload.workers import (
    AttentionWorker,
    DraftWorker,
    PrefetchWorker,
    VerifierWorker,
    WeightPlan,
)
from specoffload.runtime.transport.arena import Arena, sweep_dead_arenas
from specoffload.runtime.transport.channel import ChannelConfig, Server
from specoffload.runtime.transport.codec import WorkerCall, WorkerReply
from specoffload.runtime.transport.shm import ARENA_TAG, ShmTensors, sweep_dead_sockets

logger = logging.getLogger("specoffload.actors")

def normal_priority() -> bool:
    """Run this thread (and threads it starts later) at niceness 0 if allowed; returns whether it does.

    Ray starts worker processes at niceness 15 (its `worker_niceness`), so that its daemons stay responsive. The
    role actors are the engine itself: at 15 every Ray daemon, and anything else on the machine, preempts them in
    the middle of a layer. Lowering niceness needs CAP_SYS_NICE (root); without it the role stays at Ray's level.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # Linux: the calling thread; new threads inherit it
    except PermissionError:
        return False
    return os.getpriority(os.PRIO_PROCESS, 0) == 0


@dataclass(frozen=True)
class RoleInfo:
    """What the coordinator needs to reach a role after `setup`: its pid, its socket, the slot arenas it shares."""

    role: str
    pid: int
    channel: ChannelConfig
    slot_paths: tuple[str, ...] = ()


class Role:
    """Base of the role actors: a worker built by `setup`, served on a ZeroMQ socket by a thread.

    threads: torch intra-op threads of this process, set explicitly whatever OMP_NUM_THREADS Ray derived from
    the actor's (fractional) CPU share. The constructor is cheap (an actor can start while the coordinator still
    places the model); the weight plan comes with `setup`. Subclasses name their role and its wire methods, and
    build the worker.
    """

    role: ClassVar[str]
    methods: ClassVar[frozenset[str]]

    def __init__(self, config: EngineConfig, threads: int = 1) -> None:
        self.config, self.threads = config, threads
        self.plan: WeightPlan | None = None
        self.normal_priority = normal_priority()
        torch.set_num_threads(threads)
        self.worker: Any = None
        self.info: RoleInfo | None = None
        self._slot_paths: tuple[str, ...] | None = None
        self._slots: list[Arena] = []
        self._shm: ShmTensors | None = None
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- control (Ray methods) -------------------------------------------------------------------------------
    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> str:
        return self.role

    def address(self) -> str | None:
        return self.info.channel.address if self.info is not None else None

    def setup(self, plan: WeightPlan, slot_paths: Sequence[str] = ()) -> RoleInfo:
        """(Re)build the worker for `plan` over the given slot arenas and (re)start the server; returns where to
        reach it.

        Called once after launch and again after any role of the group was lost: a worker whose plan and slots did
        not change only drops its per-batch state (KV caches, generators): the coordinator replays from its own.
        """
        self._stop_server()
        if plan != self.plan:
            self._close_worker()
            self._close_slots()
            self.plan = plan
        channel = ChannelConfig(self.role)
        if self._shm is None:  # first setup in this process: clean up after dead processes of earlier runs
            sweep_dead_arenas(ARENA_TAG)
            sweep_dead_sockets(str(channel.socket_dir))
            self._shm = ShmTensors(self.role)
        slot_paths = self._own_slots() if self.owns_slots else tuple(slot_paths)
        if self.worker is None or slot_paths != self._slot_paths:
            self._close_worker()
            if not self.owns_slots:
                self._close_slots()
                self._slots = [Arena.attach(path) for path in slot_paths]
            self.worker = self._build([arena.data for arena in self._slots] or None)
            self._slot_paths = slot_paths
        else:
            self._reset()
        self._server = Server(channel)
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name=f"specoffload-{self.role}-server", daemon=True)
        self._thread.start()
        self.info = RoleInfo(self.role, os.getpid(), channel, slot_paths)
        return self.info

    def shutdown(self) -> None:
        """Stop serving, close the worker and unlink every arena this process owns."""
        self._stop_server()
        self._close_worker()
        self._close_slots()
        if self._shm is not None:
            self._shm.close()
        self._shm = None

    # ---- the hot path (server thread) --------------------------------------------------------------------------
    def handle(self, call: WorkerCall) -> WorkerReply:
        """Run one worker method: tensor arguments are views of their arenas, tensor results go to this role's
        output arena of (method, lane, output index)."""
        if call.method not in self.methods:
            raise ValueError(f"the {self.role} role has no method {call.method!r} (has: {sorted(self.methods)})")
        assert self._shm is not None and self.worker is not None, "setup() first"
        kwargs: dict[str, Any] = {name: self._shm.read(ref) for name, ref in call.tensors.items()}
        kwargs.update(call.scalars)
        if call.params is not None:
            kwargs["params"] = call.params
        before = self.worker.bytes_read if hasattr(self.worker, "bytes_read") else 0
        with torch.inference_mode():
            result = getattr(self.worker, call.method)(**kwargs)
            outputs = result if isinstance(result, tuple) else (result,)
            tensors = tuple(
                self._shm.write((call.method, call.lane, i), out) if isinstance(out, torch.Tensor) else None
                for i, out in enumerate(outputs)
            )
        values = tuple(None if isinstance(out, torch.Tensor) else out for out in outputs)
        after = self.worker.bytes_read if hasattr(self.worker, "bytes_read") else 0
        return WorkerReply(tensors, values, after - before)

    def _serve(self) -> None:
        torch.set_num_threads(self.threads)  # per thread in torch's OpenMP pool
        assert self._server is not None
        self._server.serve_forever(self.handle, self._stop)

    # ---- per role ---------------------------------------------------------------------------------------------
    owns_slots: ClassVar[bool] = False

    def _build(self, slots: list[torch.Tensor] | None) -> Any:
        raise NotImplementedError

    def _reset(self) -> None:
        """Drop the worker's per-batch state (the coordinator re-creates it)."""
        for name in ("caches", "generators"):
            getattr(self.worker, name, {}).clear()

    def _own_slots(self) -> tuple[str, ...]:
        raise NotImplementedError

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _stop_server(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def _close_worker(self) -> None:
        if self.worker is not None and hasattr(self.worker, "close"):
            self.worker.close()
        self.worker = None
        self._slot_paths = None

    def _close_slots(self) -> None:
        """Unmap the slot arenas (the prefetch role, their owner, also unlinks them)."""
        for arena in self._slots:
            arena.close()
        self._slots = []


class PrefetchRole(Role):
    """io: owns the ring slots, one shared-memory arena per slot, and streams layer weights into them."""

    role = "prefetch"
    methods = frozenset({"load"})
    owns_slots = True

    def _own_slots(self) -> tuple[str, ...]:
        plan = self.plan
        if not self._slots and plan is not None and plan.streamed:
            self._slots = [Arena.create(f"slot{i}", plan.slot_bytes, ARENA_TAG) for i in range(plan.num_buffers)]
        return tuple(str(arena.path) for arena in self._slots)

    def _build(self, slots: list[torch.Tensor] | None) -> PrefetchWorker:
        return PrefetchWorker(self.config, self.plan, slots)


class AttentionRole(Role):
    """cpu: the target's embedding and attention, over the slots the prefetch role fills."""

    role = "attention"
    methods = frozenset({"reset", "drop", "lengths", "advance", "truncate", "select_rows", "embed", "attention"})

    def _build(self, slots: list[torch.Tensor] | None) -> AttentionWorker:
        return AttentionWorker(self.config, self.plan, slots)


class VerifierRole(Role):
    """device: the target's FFN / experts / head over the shared slots, and verification."""

    role = "verifier"
    methods = frozenset({"seed", "ffn", "head", "verify"})

    def _build(self, slots: list[torch.Tensor] | None) -> VerifierWorker:
        return VerifierWorker(self.config, self.plan, slots)


class DraftRole(Role):
    """device: the resident draft model and its KV caches."""

    role = "draft"
    methods = frozenset({"reset", "drop", "lengths", "truncate", "select_rows", "propose"})

    def _build(self, slots: list[torch.Tensor] | None) -> DraftWorker:
        return DraftWorker(self.config)


ROLES: dict[str, type[Role]] = {cls.role: cls for cls in (PrefetchRole, AttentionRole, VerifierRole, DraftRole)}
