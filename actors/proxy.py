"""Coordinator-side proxies: the plain workers' methods, executed by the role actors over ZeroMQ.

`proxy_class(worker class)` generates a proxy with the worker's `@wire` methods (runtime/offload/wire.py), same
signatures and docstrings, so the engine's pipeline runs unchanged against actors. A call becomes one
`WorkerCall`: tensor arguments the coordinator made (token ids, masks, positions, draft tokens) are written into
the coordinator's own arenas (one region per calling thread and argument, reused: calls are synchronous); tensors
that came back from a role are passed on by reference.

Hidden states and logits never visit the coordinator: the methods marked keep_outputs (`embed`, `attention`,
`ffn`, `head`) return a `RemoteTensor` (a `TensorRef` into the producing role's output arena) and the next call
forwards the header. The output region is picked by the chain's `Lane`: a call with no RemoteTensor argument
(`embed`) takes a free lane and every later result of that pass reuses it, so two batches' passes in flight never
overwrite each other; a lane returns to the pool when the last handle of its chain is garbage-collected (after
`verify` consumed the logits). Small results (lengths, draft tokens and probabilities) are copied out at once.

Sockets are not thread-safe and the executor calls proxies from its io / cpu / device threads: each proxy keeps
one DEALER socket per thread. A call waits in short polls and checks in between that the role's process is
alive: a dead one raises `WorkerLost` naming the role, which the coordinator turns into a restart and a replay.
"""

from __future__ import annotations

import heapq
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from specoffload.actors.transport.channel import ChannelTimeout, Client
from specoffload.actors.transport.codec import TensorRef, WorkerCall, WorkerReply
from specoffload.actors.transport.procs import pid_alive
from specoffload.actors.transport.shm import ShmTensors
from specoffload.planner.errors import SpecOffloadError
from specoffload.runtime.offload.wire import WireMethod, wire_methods
from specoffload.runtime.sampling import SamplingParams

from .roles import RoleInfo

Tensor = torch.Tensor

#: seconds between liveness checks while a call waits for its reply
POLL_S = 0.1
#: a call that gets no reply for this long although its role is alive counts as lost (a hung worker)
CALL_TIMEOUT_S = 600.0


class WorkerLost(SpecOffloadError):
    """A role actor died (or stopped answering) during a call; the coordinator restarts it and replays."""

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"the {role} worker actor was lost: {reason}")
        self.role, self.reason = role, reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses Ray to the client as itself
        return type(self), (self.role, self.reason)


class Lane:
    """One output lane of a pass's chain of hidden states; returns to its pool when the last handle is freed."""

    __slots__ = ("id", "__weakref__")

    def __init__(self, lane_id: int, pool: LanePool) -> None:
        self.id = lane_id
        weakref.finalize(self, pool.release, lane_id)


class LanePool:
    """Lanes 0, 1, 2, ...: the lowest free one is handed out (at most one per pass in flight is taken)."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0
        self._lock = threading.Lock()

    def acquire(self) -> Lane:
        with self._lock:
            if self._free:
                lane_id = heapq.heappop(self._free)
            else:
                lane_id, self._next = self._next, self._next + 1
        return Lane(lane_id, self)

    def release(self, lane_id: int) -> None:
        with self._lock:
            heapq.heappush(self._free, lane_id)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._next - len(self._free)


@dataclass(frozen=True, eq=False)
class RemoteTensor:
    """A tensor left in a role's output arena: forwarded to the next role by header, never copied."""

    ref: TensorRef
    lane: Lane

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ref.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.ref.torch_dtype


class RoleProxy:
    """Calls one role's worker methods; see the module docstring. `rebind` after the role was set up again."""

    def __init__(self, info: RoleInfo, shm: ShmTensors, lanes: LanePool, poll_s: float = POLL_S,
                 timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.info = info
        self.shm, self.lanes = shm, lanes
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.bytes_read = 0  # bytes the role read from the weights tier, summed over replies
        self.calls = 0
        self._clients: dict[int, Client] = {}  # thread ident -> its socket
        self._thread_lanes: dict[str, int] = {}  # thread name -> negative lane for copied-out results
        self._lock = threading.Lock()

    @property
    def role(self) -> str:
        return self.info.role

    def alive(self) -> bool:
        return pid_alive(self.info.pid)

    def rebind(self, info: RoleInfo) -> None:
        self.close()
        self.info = info

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def call(self, method: str, lane: Lane | None = None, **args: Any) -> tuple[Any, ...]:
        """Run `method(**args)` in the role. Tensor outputs: RemoteTensor on `lane`, or (lane None) local copies."""
        thread = threading.current_thread().name
        tensors: dict[str, TensorRef] = {}
        scalars: dict[str, Any] = {}
        params = None
        for name, value in args.items():
            if isinstance(value, RemoteTensor):
                tensors[name] = value.ref
            elif isinstance(value, Tensor):
                tensors[name] = self.shm.write((thread, name), value)
            elif isinstance(value, SamplingParams):
                params = value
            else:
                scalars[name] = list(value) if isinstance(value, (list, tuple)) else value
        lane_id = lane.id if lane is not None else self._thread_lane(thread)
        reply = self._roundtrip(WorkerCall(method, tensors, scalars, params, lane_id))
        self.bytes_read += reply.bytes_read
        self.calls += 1
        outputs: list[Any] = []
        for ref, value in zip(reply.tensors, reply.values):
            if ref is None:
                outputs.append(value)
            elif lane is not None:
                outputs.append(RemoteTensor(ref, lane))
            else:
                outputs.append(self.shm.read(ref).clone())
        return tuple(outputs)

    def _roundtrip(self, msg: WorkerCall) -> WorkerReply:
        client = self._client()
        request = client.submit(msg, timeout_s=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                reply = client.wait(request, self.poll_s)
            except ChannelTimeout:
                if not self.alive():
                    raise WorkerLost(self.role, f"process {self.info.pid} died during {msg.method}") from None
                if time.monotonic() > deadline:
                    raise WorkerLost(self.role, f"no reply to {msg.method} in {self.timeout_s:.0f} s") from None
                client._pending.add(request)  # Client.wait abandons a request on timeout: keep waiting for it
                continue
            if not isinstance(reply, WorkerReply):
                raise SpecOffloadError(f"{self.role}: unexpected reply {type(reply).__name__} to {msg.method}")
            return reply

    def _client(self) -> Client:
        ident = threading.get_ident()
        client = self._clients.get(ident)
        if client is None:
            with self._lock:
                live = {t.ident for t in threading.enumerate()}
                for gone in [i for i in self._clients if i not in live]:  # sockets of finished executor threads
                    self._clients.pop(gone).close()
                client = self._clients[ident] = Client(self.info.channel)
        return client

    def _thread_lane(self, thread: str) -> int:
        with self._lock:
            return self._thread_lanes.setdefault(thread, -1 - len(self._thread_lanes))


def proxy_class(worker_class: type) -> type[RoleProxy]:
    """A RoleProxy subclass with one method per `@wire` method of `worker_class` (signature and docstring kept)."""
    namespace: dict[str, Any] = {"__doc__": f"{worker_class.__name__}'s wire methods, executed by its role actor."}
    for spec in wire_methods(worker_class).values():
        namespace[spec.name] = _remote_method(spec)
    return type(f"{worker_class.__name__}Proxy", (RoleProxy,), namespace)


def _remote_method(spec: WireMethod) -> Any:
    def method(self: RoleProxy, *args: Any, **kwargs: Any) -> Any:
        bound = spec.signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = {name: value for name, value in bound.arguments.items() if name != "self"}
        lane = None
        if spec.keep_outputs:  # results stay in the role, on the lane of the chain they continue (or a new one)
            chained = [v for v in values.values() if isinstance(v, RemoteTensor)]
            lane = chained[0].lane if chained else self.lanes.acquire()
        outputs = self.call(spec.name, lane, **values)
        return outputs if spec.returns_tuple else outputs[0]

    method.__name__ = method.__qualname__ = spec.name
    method.__doc__ = spec.doc
    method.__signature__ = spec.signature  # type: ignore[attr-defined]
    return method
