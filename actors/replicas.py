"""Replicas: one engine per node, placed by a placement group, sharing a corpus in leased chunks.

Placement. One placement group for the job, one bundle per replica, strategy STRICT_SPREAD. A bundle always lives on
one node, so a replica's five actors (its coordinator, and the four roles the coordinator launches into the same
bundle) share that node's /dev/shm arenas and ipc sockets: the bundle is the replica's STRICT_PACK. STRICT_SPREAD
keeps two replicas off one node (Ray has no anti-affinity between placement groups, so one group per replica could
not). A bundle holds the replica's CPU (and GPU) shares and, on a cluster that declares the custom resource
`specoffload_replica` (ray_cluster.yaml gives each GPU worker one), one unit of it: replicas then go only to the nodes
that offer it, never to the head.

Leases. A chunk is leased to a replica by calling its coordinator's `run_chunk`; the lease ends with the result, or
with the call's failure. A replica holds several leases at once (up to the job's window): their rows share its one
long-lived engine stream (coordinator.py `ChunkStream`), so a chunk is never a drain point.
When a replica's process or node dies, Ray fails the call (RayActorError): the lease is
lost and the chunk goes back to the front of the queue for the next free replica (`LeaseBook`). Ray reschedules the
lost bundle on another node if one fits and restarts the coordinator there (`max_restarts`); the pool calls its
`start` and the replica takes leases again. A replica with no node to come back to stops taking leases; the others
finish the job. A role actor lost inside a live replica is recovered there (coordinator.py) and keeps its lease.
Each chunk completes once (a late result of a lost lease is dropped), so every row is written exactly once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group

from specoffload.actors.transport.arena import sweep_dead_arenas
from specoffload.actors.transport.shm import ARENA_TAG
from specoffload.planner.errors import SpecOffloadError
from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Prompt
from specoffload.runtime.offline.chunks import Chunk, ChunkDone, LeaseBook, chunked, errors_only
from specoffload.runtime.offline.rows import RowJob, RowRequest, RowResult
from specoffload.runtime.request import GenerationResult
from specoffload.runtime.sampling import SamplingParams
from specoffload.runtime.tokenizer import load_tokenizer

from .coordinator import Coordinator, draft_role
from .launcher import Bundle, bundle_resources, launch, plan_resources
from .proxy import WorkerLost
from .rayget import first_line, ray_get

logger = logging.getLogger("specoffload.actors")

#: custom resource that marks the nodes meant for replicas (declared by ray_cluster.yaml's GPU workers)
REPLICA_RESOURCE = "specoffload_replica"
#: seconds to wait for the placement group (every replica's node) and for the replicas' engines to start
READY_TIMEOUT_S = 300.0
#: with no replica left to lease to, seconds to wait for one to come back (a rescheduled node) before giving up
COMEBACK_TIMEOUT_S = 600.0
#: run_chunk calls in flight per replica at most (its coordinator's threads: they share its one engine stream)
MAX_LEASES = 16
#: seconds between asking an unreachable replica to come back
COMEBACK_RETRY_S = 2.0


class ReplicaError(SpecOffloadError):
    """Replicas cannot be placed, or none is left to finish the job."""


@dataclass
class Replica:
    """One engine (a coordinator actor and its roles) in bundle `index`, and what it has done."""

    index: int
    actor: Any
    node: str = "?"
    rows: int = 0
    tokens: int = 0
    chunks: int = 0
    lost_leases: int = 0
    restarts: int = 0
    recoveries: int = 0  # role actors recovered inside it
    bytes_read: int = 0
    passes: int = 0
    engine_s: float = 0.0  # seconds its engine spent on its chunks
    call_s: float = 0.0  # seconds from lease to result, as the driver saw them (engine + Ray + coordinator)
    slots: int = 0  # rows its engine decodes at once (0: unknown)
    down: bool = False  # lost its lease; not back yet
    gone: bool = False  # will not come back in this job

    def describe(self) -> str:
        text = (f"replica {self.index} (node {self.node[:12]}): {self.rows} rows, {self.tokens} tokens in "
                f"{self.chunks} chunks")
        extras = [f"{self.lost_leases} lost leases" if self.lost_leases else "",
                  f"{self.restarts} restarts" if self.restarts else "",
                  f"{self.recoveries} actor recoveries" if self.recoveries else "", "gone" if self.gone else ""]
        return text + "".join(f", {e}" for e in extras if e)


class ReplicaPool:
    """N engines on N nodes (see the module docstring): `run` for a job's chunks, `generate` like an engine.

    replicas: a number, or "auto": one on every live node that can hold a replica's bundle. max_restarts: restarts
    of each coordinator (a lost node) and of each role actor. log: where placement and fault events are reported.
    """

    def __init__(self, config: EngineConfig, replicas: int | str = 1, *, max_restarts: int = 3,
                 ready_timeout_s: float = READY_TIMEOUT_S, owns_ray: bool = False,
                 log: Callable[[str], None] | None = None) -> None:
        if not config.offloaded:
            raise ConfigError("the Ray backend runs the offloaded engine: set device_memory in the EngineConfig")
        self.config, self.owns_ray = config, owns_ray
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        resources = plan_resources(config)
        roles = ["coordinator", "prefetch", "attention", "verifier"]
        roles += ["draft"] if draft_role(config) else []
        marked = ray.cluster_resources().get(REPLICA_RESOURCE, 0) > 0
        self.bundle = bundle_resources(resources, roles, {REPLICA_RESOURCE: 1.0} if marked else None)
        count = _replica_count(replicas, self.bundle)
        self.group = placement_group([self.bundle] * count, strategy="STRICT_SPREAD",
                                     name=f"specoffload-replicas-{uuid.uuid4().hex[:8]}")
        self.replicas: list[Replica] = []
        self.placement = ""
        try:
            try:
                ray.get(self.group.ready(), timeout=ready_timeout_s)
            except GetTimeoutError:
                hosts = len(_hosts(self.bundle))
                raise ReplicaError(f"{count} replica(s) need {count} nodes with {self.bundle} free each (this cluster "
                                   f"has {hosts} that could hold one); not placed within {ready_timeout_s:.0f} s: "
                                   f"use fewer --replicas or 'auto', or add nodes (see `ray status`)") from None
            for i in range(count):
                here = Bundle(self.group, i)
                actor = launch(Coordinator, config, None, max_restarts, bundle=here, resources=resources["coordinator"],
                               max_restarts=max_restarts, max_concurrency=MAX_LEASES + 4, placement=here)
                self.replicas.append(Replica(i, actor))
            started = [_get(r.actor.start.remote(), ready_timeout_s) for r in self.replicas]
        except BaseException:
            self.shutdown()
            raise
        for replica, info in zip(self.replicas, started):
            replica.node, replica.slots = info["node"], int(info.get("slots", 0))
        self.placement = started[0]["placement"]
        self.log(f"{count} replica(s) of {self.bundle} each, one per node: "
                 + ", ".join(f"replica {r.index} on node {r.node[:12]}" for r in self.replicas))
        self.metrics = _Metrics()
        self.events: list[dict[str, Any]] = []  # lease lost / comeback / gone, with wall-clock times
        self.driver_s = 0.0  # the driver's own time per job: handing out chunks, taking results in

    # ---- a job's chunks ---------------------------------------------------------------------------------------------
    def run(self, chunks: Iterator[Chunk], window: int) -> Iterator[ChunkDone]:
        """Lease chunks to replicas, at most `window` per replica ahead of the oldest unwritten chunk. A replica holds
        several leases at once (up to `window`, at most MAX_LEASES), while its rows in flight are fewer than twice
        the rows its engine decodes at once: its batches full and as many rows queued in its one engine stream
        (coordinator.py `ChunkStream`), so the next chunk's rows take slots as the last one's finish. The replica
        with the fewest rows in flight leases first. Yield each chunk once, when its result is in (any order)."""
        book = LeaseBook(chunks, window * len(self.replicas))
        per_replica = max(1, min(window, MAX_LEASES))
        leases = {r.index: 0 for r in self.replicas}  # run_chunk calls in flight per replica
        rows = {r.index: 0 for r in self.replicas}  # their rows

        def takes(r: Replica) -> bool:  # up, and fewer rows in flight than fill its batches twice (one queued)
            return (not r.gone and not r.down and leases[r.index] < per_replica
                    and (leases[r.index] == 0 or not r.slots or rows[r.index] < 2 * r.slots))

        def free() -> Replica | None:  # the replica with the fewest rows in flight, if it may take another chunk
            up = [r for r in self.replicas if takes(r)]
            return min(up, key=lambda r: rows[r.index]) if up else None

        calls: dict[Any, tuple[Replica, Chunk | None]] = {}  # in flight: run_chunk (a lease) or start (a comeback)
        sent: dict[Any, float] = {}
        redone: set[int] = set()  # chunks of lost leases
        retry: dict[int, float] = {}  # replica -> when to ask it to come back again (it was unreachable)
        stalled_since: float | None = None
        while not book.done:
            for index, at in list(retry.items()):
                if time.monotonic() >= at:
                    del retry[index]
                    calls[self.replicas[index].actor.start.remote()] = (self.replicas[index], None)
            t0 = time.perf_counter()
            while free() is not None and (chunk := book.next()) is not None:
                if (done := errors_only(chunk)) is not None:
                    book.complete(chunk.number)
                    self.driver_s += time.perf_counter() - t0
                    yield done
                    t0 = time.perf_counter()
                    continue
                replica = free()
                assert replica is not None
                leases[replica.index] += 1
                rows[replica.index] += len(chunk.rows)
                ref = replica.actor.run_chunk.remote(*chunk.payload())
                calls[ref], sent[ref] = (replica, chunk), time.perf_counter()
                book.lease(chunk, replica.index)
                if chunk.number in redone:
                    self._event("re_leased", replica, chunk=chunk.number)
            self.driver_s += time.perf_counter() - t0
            if book.done:
                break
            if not calls and not retry:
                raise ReplicaError("every replica is gone (their nodes died and none could be placed again); the "
                                   "rows written so far are safe: rerun with --resume")
            leased = any(chunk is not None for _, chunk in calls.values())
            stalled_since = None if leased or free() is not None else (stalled_since or time.monotonic())
            if stalled_since is not None and time.monotonic() - stalled_since > COMEBACK_TIMEOUT_S:
                raise ReplicaError(f"no replica left to lease to: none came back within {COMEBACK_TIMEOUT_S:.0f} s "
                                   "(see `ray status`); the rows written so far are safe: rerun with --resume")
            if not calls:  # only comebacks to ask again, later
                time.sleep(0.5)
                continue
            ready, _ = ray.wait(list(calls), num_returns=1, timeout=1.0)
            for ref in ready:
                t0 = time.perf_counter()
                replica, chunk = calls.pop(ref)
                if chunk is None:
                    if self._comeback(replica, ref):
                        retry[replica.index] = time.monotonic() + COMEBACK_RETRY_S
                    continue
                try:
                    out = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    if isinstance(exc, RayTaskError) and not isinstance(exc.cause, WorkerLost):
                        raise exc.as_instanceof_cause() from None  # the engine refused the chunk: a bug, not a fault
                    leases[replica.index] -= 1
                    rows[replica.index] -= len(chunk.rows)
                    book.lose(chunk.number)
                    redone.add(chunk.number)
                    self._lost(replica, chunk, exc, calls)
                    continue
                replica.call_s += t0 - sent.pop(ref)
                leases[replica.index] -= 1
                rows[replica.index] -= len(chunk.rows)
                results = tuple(RowResult.of(r) for r in out["results"])
                self._count(replica, chunk, results, out)
                if chunk.number in redone:
                    self._event("chunk_redone", replica, chunk=chunk.number)
                self.driver_s += time.perf_counter() - t0
                if book.complete(chunk.number):
                    yield ChunkDone(chunk, results, f"replica {replica.index}")

    def _lost(self, replica: Replica, chunk: Chunk, exc: Exception, calls: dict[Any, tuple[Replica, Chunk | None]]
              ) -> None:
        """A lease ended without a result: count it and ask the replica to come back (Ray restarts its
        coordinator, on another node if its own is gone). Its other leases in flight fail with the same fault: only
        the first asks."""
        replica.lost_leases += 1
        first_loss = not replica.down
        replica.down = True
        self._event("lease_lost", replica, chunk=chunk.number, error=first_line(exc, with_type=True))
        self.metrics.inc("lost_leases", 1, replica.index)
        first, last = chunk.rows[0].index, chunk.rows[-1].index
        self.log(f"replica {replica.index} (node {replica.node[:12]}) lost its lease on chunk {chunk.number} (rows "
                 f"{first}-{last}): {first_line(exc, with_type=True)}; the chunk goes back to the queue")
        if not first_loss:
            return
        if isinstance(exc, RayTaskError):  # alive, but its role actors are spent: a fresh coordinator, from Ray
            with contextlib.suppress(RayError):
                ray.kill(replica.actor, no_restart=False)
        calls[replica.actor.start.remote()] = (replica, None)

    def _comeback(self, replica: Replica, ref: Any) -> bool:
        """The answer to a lost replica's `start`: back (it takes leases again), unreachable for now (True: ask
        again soon; Ray is noticing its node's death, or restarting it), or gone for this job."""
        try:
            info = ray.get(ref)
        except ActorUnavailableError:
            return True
        except (RayActorError, RayTaskError) as exc:
            replica.gone = True
            self._event("gone", replica, error=first_line(exc, with_type=True))
            self.log(f"replica {replica.index} is gone for this job: {first_line(exc, with_type=True)}")
            return False
        replica.restarts += 1
        replica.down = False
        replica.node, replica.slots = info["node"], int(info.get("slots", replica.slots))
        self._event("back", replica)
        self.log(f"replica {replica.index} is back, on node {replica.node[:12]}")
        return False

    def _count(self, replica: Replica, chunk: Chunk, results: tuple[RowResult, ...], out: dict[str, Any]) -> None:
        tokens = sum(len(r.token_ids) for r in results)
        replica.rows += len(chunk.rows)
        replica.tokens += tokens
        replica.chunks += 1
        replica.recoveries += int(out.get("recoveries", 0))
        replica.bytes_read += int(out.get("bytes_read", 0))
        replica.passes += int(out.get("passes", 0))
        replica.engine_s += float(out.get("wall_s", 0.0))
        self.metrics.inc("rows", len(chunk.rows), replica.index)
        self.metrics.inc("tokens", tokens, replica.index)

    def _event(self, kind: str, replica: Replica, **details: Any) -> None:
        self.events.append({"event": kind, "time": time.time(), "replica": replica.index, "node": replica.node}
                           | details)

    # ---- like an engine ---------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chunk_size: int | None = None) -> list[GenerationResult]:
        """Complete every prompt on the replicas; results in input order, equal to `Engine.generate`'s (a sampled
        row draws from its seed and its index alone, whichever replica and chunk run it)."""
        per_row = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        tokenizer = load_tokenizer(self.config.target) if any(isinstance(p, str) for p in prompts) else None
        jobs = []
        for i, (prompt, p) in enumerate(zip(prompts, per_row)):
            ids = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
            jobs.append(RowJob(RowRequest(i, i + 1), tuple(int(t) for t in ids), p))
        size = chunk_size or max(1, math.ceil(len(jobs) / (2 * len(self.replicas))))
        out: list[GenerationResult | None] = [None] * len(jobs)
        for done in self.run(chunked(iter(jobs), size), window=2):
            for job, r in zip(done.chunk.jobs, done.results):
                if job.sample:
                    continue  # Engine.generate's meaning: one result per prompt
                out[job.index] = GenerationResult(job.index, list(job.token_ids), list(r.token_ids), r.text,
                                                  r.finish_reason, r.num_drafted, r.num_accepted)
        return [r for r in out if r is not None]

    def stats(self) -> list[dict[str, Any]]:
        """Per replica: node, rows, tokens, chunks, lost leases, restarts, actor recoveries, and seconds: its engine's
        on its chunks, and lease to result as the driver saw them (the difference is Ray's and the coordinator's)."""
        return [{"replica": r.index, "node": r.node, "rows": r.rows, "tokens": r.tokens, "chunks": r.chunks,
                 "lost_leases": r.lost_leases, "restarts": r.restarts, "recoveries": r.recoveries,
                 "bytes_read": r.bytes_read, "passes": r.passes, "engine_s": r.engine_s, "call_s": r.call_s,
                 "gone": r.gone} for r in self.replicas]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """End every replica (each unlinks its shared memory), remove the placement group, sweep what the dead left."""
        refs = []
        for r in self.replicas:
            if r.down or r.gone:  # a call to it could wait for a restart that never comes
                continue
            with contextlib.suppress(RayError):
                refs.append(r.actor.shutdown.remote())
        if refs:
            with contextlib.suppress(RayError):
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for r in self.replicas:
            with contextlib.suppress(RayError, ValueError):
                ray.kill(r.actor, no_restart=True)
        self.replicas = []
        with contextlib.suppress(RayError, ValueError):
            remove_placement_group(self.group)
        sweep_dead_arenas(ARENA_TAG)
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _hosts(bundle: dict[str, float]) -> list[dict[str, Any]]:
    """The live nodes whose resources can hold `bundle`."""
    return [n for n in ray.nodes()
            if n.get("Alive") and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items())]


def _replica_count(replicas: int | str, bundle: dict[str, float]) -> int:
    """`replicas`, checked against the live nodes that can hold a bundle ("auto": all of them)."""
    hosts = _hosts(bundle)
    if replicas == "auto":
        if not hosts:
            raise ReplicaError(f"no node can hold a replica ({bundle}); see `ray status`")
        return len(hosts)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas must be an integer >= 1 or 'auto', got {replicas!r}")
    if replicas > len(hosts):  # an autoscaler adds nodes for the placement group's demand; else it times out
        logger.warning("%d replicas need %d nodes that can hold one (%s); %d are up: waiting for more", replicas,
                       replicas, bundle, len(hosts))
    return replicas


class _Metrics:
    """Counters on Ray's metrics endpoint (the dashboard's Metrics view, with Prometheus): rows, tokens and lost
    leases per replica."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter

        self.counters = {name: Counter(f"specoffload_{name}", description=f"{name} of the offline job",
                                       tag_keys=("replica",)) for name in ("rows", "tokens", "lost_leases")}

    def inc(self, name: str, value: int, replica: int) -> None:
        if value:
            with contextlib.suppress(Exception):  # metrics are best effort: never fail a job over them
                self.counters[name].inc(value, tags={"replica": str(replica)})


def _get(ref: Any, timeout_s: float | None = None) -> Any:
    """ray.get, re-raising an engine's error (e.g. a too-small budget) as its own type."""
    try:
        return ray_get(ref, timeout_s)
    except GetTimeoutError:
        raise ReplicaError(f"a replica did not start within {timeout_s:.0f} s (see `ray status`)") from None

