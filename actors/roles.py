"""`Role`: one actor class that serves any plain worker of runtime/offload/ over a socket. Which worker, per role:

    prefetch   PrefetchWorker   owns the ring slots (shared-memory arenas) and streams weights into them
    attention  AttentionWorker  attaches the slots; embedding + attention over its host KV caches
    verifier   VerifierWorker   attaches the slots; FFN / experts / head and verification
    draft      the drafter      the config's drafter (runtime/offload/drafters.py) and its per-batch state

A role is a plain class (actors/launcher.py makes it a Ray actor; tests can run one in-process). Its Ray methods
are control only: `setup` builds the worker and starts a ZeroMQ server thread, `pid`, `ping`, `address`,
`shutdown`. The hot path never goes through Ray: the server thread answers `WorkerCall` messages (msgpack over an
ipc:// socket derived from the role's pid) by calling the worker method with zero-copy views of the tensor
arguments, writes tensor results into its own output arenas and replies with their `TensorRef`s. The methods it
answers are exactly the worker class's `@wire` methods (runtime/offload/wire.py): nothing is listed twice.

Shared memory goes through `ShmTensors` (actors/transport/shm.py), as in the coordinator's proxies. Arena files
carry the owner's pid: `setup` sweeps the files (and ipc sockets) of dead owners, e.g. the previous incarnation of
a role that was killed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specoffload.actors.transport.arena import Arena, sweep_dead_arenas
from specoffload.actors.transport.channel import ChannelConfig, Server
from specoffload.actors.transport.codec import WorkerCall, WorkerReply
from specoffload.actors.transport.shm import ARENA_TAG, ShmTensors, sweep_dead_sockets
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.offload.wire import wire_methods
from specoffload.runtime.offload.workers import WeightPlan, worker_classes

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


#: seconds `setup` / `shutdown` wait for the server thread to finish its call in flight
SERVER_STOP_TIMEOUT_S = 10.0
#: the role that creates the ring slot arenas (the others attach them)
SLOT_OWNER = "prefetch"
ROLES = ("prefetch", "attention", "verifier", "draft")


class Role:
    """A role actor: the worker class of `role` (runtime/offload/workers.py `worker_classes`), built by `setup`
    and served on a ZeroMQ socket by a thread.

    threads: torch intra-op threads of this process, set explicitly whatever OMP_NUM_THREADS Ray derived from
    the actor's (fractional) CPU share. The constructor is cheap (an actor can start while the coordinator still
    places the model); the weight plan comes with `setup`.
    """

    def __init__(self, role: str, config: EngineConfig, threads: int = 1) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
        self.role, self.worker_class = role, worker_classes(config)[role]
        self.owns_slots = role == SLOT_OWNER
        self.config, self.threads = config, threads
        self.plan: WeightPlan | None = None
        self.normal_priority = normal_priority()
        torch.set_num_threads(threads)
        self.worker: Any = None
        self.methods = frozenset(wire_methods(self.worker_class))
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
            self.worker = self.worker_class(self.config, plan, [arena.data for arena in self._slots] or None)
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

    def _reset(self) -> None:
        """Drop the worker's per-batch state (the coordinator re-creates it)."""
        for name in ("caches", "routing", "partial"):
            getattr(self.worker, name, {}).clear()

    def _own_slots(self) -> tuple[str, ...]:
        """The prefetch role's ring: one shared-memory arena per slot, created once per weight plan."""
        plan = self.plan
        if not self._slots and plan is not None and plan.streamed:
            self._slots = [Arena.create(f"slot{i}", plan.slot_bytes, ARENA_TAG) for i in range(plan.num_buffers)]
        return tuple(str(arena.path) for arena in self._slots)

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _stop_server(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=SERVER_STOP_TIMEOUT_S)
            if self._thread.is_alive():  # stuck in a worker call: only a restart of this process frees it
                raise RuntimeError(f"the {self.role} server thread is stuck in a call; restart this actor")
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
