"""The coordinator: the runtime's `Engine` over role actors, and the Coordinator actor that hosts it.

Nothing here subclasses the engine: `RoleGroup` launches the role actors on this node and sets them up;
`RoleWorkers` is the engine's `WorkerFactory` (proxies of the roles, generated from the worker classes) and its
`Recovery`. The pipeline, the schedule and verification are the local backend's, unchanged.

Fault tolerance. The coordinator's requests hold every committed token; the workers hold only derived state (KV
caches, slot contents, generators). When a role actor dies mid-generation, the proxy call waiting on it raises
`WorkerLost`, the executor stops the step (`PipelineError`), and `RoleWorkers.recover`:
  1. sets every role up again: Ray restarts the dead actor (max_restarts) and its setup builds a fresh worker
     (and, for the prefetch role, fresh slot arenas that the attention and verifier roles re-attach); live roles
     drop their per-batch state;
  2. returns True, and the pipeline restarts its batches (runtime/offload/batches.py): in-flight pass state is
     dropped, rows that finished before the fault retire, the rest get empty KV caches, and the schedule runs
     again: each batch's next target pass feeds all its committed tokens, the drafter re-prefills the same way.
     Nothing is lost (a pass whose verify did not commit is simply redone) or duplicated (tokens are only
     appended by verify). Greedy results equal a run without faults; sampled ones are a valid sample, not the
     same one (generators reseed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from specoffload.actors.transport.arena import sweep_dead_arenas
from specoffload.actors.transport.procs import pid_exited
from specoffload.actors.transport.shm import ARENA_TAG, ShmTensors
from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.plan import Plan
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.offload.drafters import Drafter, NoDrafter, make_drafter
from specoffload.runtime.offload.workers import WeightPlan, Workers, worker_classes
from specoffload.runtime.request import Feed, GenerationResult
from specoffload.runtime.sampling import SamplingParams

from .launcher import ActorResources, Bundle, current_node_id, launch, plan_resources
from .proxy import CALL_TIMEOUT_S, LanePool, RoleProxy, WorkerLost, proxy_class
from .roles import Role, RoleInfo, normal_priority

logger = logging.getLogger("specoffload.actors")

#: seconds to wait for a role's setup (a restarted actor imports torch and loads its resident weights)
SETUP_TIMEOUT_S = 300.0


class RoleGroup:
    """The role actors of one engine: launch (pinned to this node), setup in dependency order, shutdown."""

    def __init__(self, config: EngineConfig, roles: Sequence[str], resources: dict[str, ActorResources],
                 max_restarts: int, bundle: Bundle | None = None) -> None:
        node = current_node_id() if bundle is None else None  # a replica's bundle is on this node already
        self.actors = {
            role: launch(Role, role, config, resources[role].threads, resources=resources[role],
                         max_restarts=max_restarts, node_id=node, placement=bundle)
            for role in roles
        }
        self.infos: dict[str, RoleInfo] = {}

    def drop(self, role: str) -> None:
        """End a role that turned out not to be needed (the planner chose no draft)."""
        ray.kill(self.actors.pop(role), no_restart=True)

    def restart(self, role: str) -> None:
        """Kill a role whose process is alive but does not answer (hung): Ray restarts it (one of its
        max_restarts), and the next `setup` reaches the fresh process."""
        ray.kill(self.actors[role], no_restart=False)

    def setup(self, plan: WeightPlan, timeout_s: float = SETUP_TIMEOUT_S) -> dict[str, RoleInfo]:
        """Set every role up for `plan` (the prefetch role first: the others attach its slots); retries while an
        actor is restarting."""
        deadline = time.monotonic() + timeout_s
        infos = {"prefetch": self._setup("prefetch", plan, (), deadline)}
        slots = infos["prefetch"].slot_paths
        pending = {role: actor.setup.remote(plan, slots) for role, actor in self.actors.items() if role != "prefetch"}
        for role, ref in pending.items():
            infos[role] = self._setup(role, plan, slots, deadline, ref)
        self.infos = infos
        return infos

    def _setup(self, role: str, plan: WeightPlan, slots: tuple[str, ...], deadline: float,
               ref: Any = None) -> RoleInfo:
        while True:
            if ref is None:
                ref = self.actors[role].setup.remote(plan, slots)
            try:
                return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
            except (RayActorError, GetTimeoutError) as exc:
                if time.monotonic() > deadline:  # restarts used up, or no node has room (see `ray status`)
                    raise WorkerLost(role, f"no answer to setup in time: {type(exc).__name__}: {exc}") from None
                ref = None  # the actor died before answering (or is restarting): ask again
                time.sleep(0.2)

    def pids(self) -> dict[str, int]:
        return {role: info.pid for role, info in self.infos.items()}

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Let every role unlink its arenas, then end the actors; sweep what a dead one left behind."""
        refs = [actor.shutdown.remote() for actor in self.actors.values()]
        try:
            ray.get(refs, timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            logger.warning("role shutdown incomplete: %s", exc)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 10.0
        while not all(pid_exited(pid) for pid in self.pids().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        sweep_dead_arenas(ARENA_TAG)
        self.actors = {}


class RestartsExhausted(WorkerLost):
    """A role actor was lost more often than max_restarts allows: the engine gives up at once, with this error."""


class RoleWorkers:
    """The engine's workers as role actors: its `WorkerFactory` (`__call__`) and its `Recovery` (`recover`).

    group: the role actors (`RoleGroup`, or anything with its setup / drop / restart / pids / shutdown, e.g. roles
    run in-process by a test). max_restarts: how often each role may be lost over the engine's lifetime, the
    same budget Ray's `max_restarts` gives each actor (so a spent budget fails at once, never waits on an actor
    Ray will not restart). call_timeout_s: a call without a reply for this long while its role is alive counts
    as a hang: the role is killed and restarted.
    """

    def __init__(self, group: RoleGroup, max_restarts: int = 3, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.group, self.max_restarts, self.call_timeout_s = group, max_restarts, call_timeout_s
        self.shm = ShmTensors("coordinator")
        self.lanes = LanePool()
        self.proxies: dict[str, RoleProxy] = {}
        self.weights: WeightPlan | None = None
        self.recoveries = 0  # in the current generate (reset by the Coordinator), for stats
        self.lost: dict[str, int] = {}  # role -> times lost over the engine's lifetime

    def __call__(self, config: EngineConfig, weights: WeightPlan, plan: Plan) -> Workers:
        if not plan.drafting and "draft" in self.group.actors:
            self.group.drop("draft")  # the plan does not speculate: its actor is not needed
        self.weights = weights
        classes = worker_classes(config)
        self.proxies = {role: proxy_class(classes[role])(info, self.shm, self.lanes, timeout_s=self.call_timeout_s)
                        for role, info in self.group.setup(weights).items()}
        drafter: Drafter = NoDrafter()
        if plan.drafting:  # a model-free drafter runs here, in the coordinator's process (no actor)
            drafter = (make_drafter(config, plan, weights) if config.drafter_class.model_free
                       else self.proxies["draft"])  # type: ignore[assignment]
        return Workers(self.proxies["prefetch"], self.proxies["attention"], self.proxies["verifier"],  # type: ignore[arg-type]
                       drafter)

    def recover(self, error: BaseException) -> bool:
        """After a failed op: if a role actor was lost (dead, or alive but hung) and its budget allows, restart it
        and set every role up again, rebinding the proxies; the pipeline then replays from the committed tokens.
        A spent budget raises `RestartsExhausted` at once."""
        lost = _lost_worker(error) or next((p.role for p in self.proxies.values() if not p.alive()), None)
        if lost is None or self.weights is None:
            return False
        self.lost[lost] = self.lost.get(lost, 0) + 1
        if self.lost[lost] > self.max_restarts:
            raise RestartsExhausted(lost, f"lost {self.lost[lost]} times, more than max_restarts = "
                                          f"{self.max_restarts}; giving up (last: {error})")
        self.recoveries += 1
        if self.proxies[lost].alive():  # hung, not dead: its server thread is stuck in a call; kill it
            logger.warning("the %s actor does not answer (%s); killing it for a restart", lost, error)
            self.group.restart(lost)
        logger.warning("recovering from a lost %s actor (%s); replaying from the committed tokens", lost, error)
        for role, info in self.group.setup(self.weights).items():
            self.proxies[role].rebind(info)
        return True

    def pids(self) -> dict[str, int]:
        return self.group.pids()

    def calls(self) -> dict[str, int]:
        return {role: proxy.calls for role, proxy in self.proxies.items()}

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        self.group.shutdown()
        self.shm.close()


def draft_role(config: EngineConfig) -> bool:
    """Whether the config's drafter runs in a role actor of its own: one with a model (a model-free drafter runs in
    the coordinator's process)."""
    cls = config.drafter_class
    return bool(cls.proposes and not cls.model_free)


def _lost_worker(error: BaseException | None) -> str | None:
    """The role named by a WorkerLost in the exception's cause chain."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, WorkerLost):
            return error.role
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class _ChunkCall:
    """One run_chunk's rows in a `ChunkStream`: filled in as they finish, in any order."""

    def __init__(self, rows: int) -> None:
        self.results: list[GenerationResult | None] = [None] * rows
        self.left = rows
        self.error: BaseException | None = None
        self.cost: dict[str, Any] = {}
        self.started = time.perf_counter()
        self.done = threading.Event()

    def result(self) -> tuple[list[GenerationResult], dict[str, Any]]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return [r for r in self.results if r is not None], self.cost


class ChunkStream:
    """A replica's one long-lived engine stream (`Engine.stream` over a `Feed`) that its leased chunks feed: a
    background thread runs the stream; `submit` puts a chunk's rows into the feed and returns a call that completes
    once those rows have finished (matched by their index: the stream numbers rows in the order they were put). The
    stream idles while the feed is empty. If it dies, every call in flight fails with its error (the driver then
    re-leases those chunks) and `alive` turns False (the next chunk starts a fresh stream).

    Per chunk it reports what the stream did between the previous chunk's end and its own (bytes read, passes,
    role recoveries): summed over chunks, the stream's totals; wall_s is the chunk's own, lease to result."""

    def __init__(self, engine: Engine, roles: RoleWorkers) -> None:
        self.engine, self.roles = engine, roles
        self.feed: Feed[tuple[Any, SamplingParams, int | str]] = Feed()
        self.lock = threading.Lock()
        self.owner: dict[int, tuple[_ChunkCall, int]] = {}  # stream index -> (its call, its row in the chunk)
        self.fed = 0
        self.error: BaseException | None = None
        self.marks = self._counters() | {"recoveries": 0, "passes": 0}  # (both count from the stream's start)
        self.thread = threading.Thread(target=self._run, name="chunk-stream", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and not self.feed.closed

    def submit(self, rows: list[tuple[Any, SamplingParams, int | str]]) -> _ChunkCall:
        call = _ChunkCall(len(rows))
        with self.lock:
            if self.error is not None:
                raise self.error
            if not rows:
                call.done.set()
                return call
            for n in range(len(rows)):
                self.owner[self.fed + n] = (call, n)
            self.fed += len(rows)
            self.feed.put(rows)  # (under the lock: the stream's indices follow the order of the puts)
        return call

    def close(self, timeout_s: float | None = None) -> None:
        self.feed.close()
        self.thread.join(timeout_s)

    def _run(self) -> None:
        try:
            for r in self.engine.stream(self.feed):
                with self.lock:
                    call, n = self.owner.pop(r.index)
                    call.results[n] = r
                    call.left -= 1
                    if call.left:
                        continue
                    now = self._counters()
                    call.cost = {k: now[k] - self.marks[k] for k in now} | {
                        "wall_s": time.perf_counter() - call.started}
                    self.marks = now
                call.done.set()
        except BaseException as exc:  # noqa: BLE001 (handed to every call in flight, which re-raise it)
            logger.warning("the chunk stream ended: %s: %s", type(exc).__name__, exc)
            with self.lock:
                self.error = exc
                calls = {id(c): c for c, _ in self.owner.values()}
                self.owner.clear()
            for call in calls.values():
                call.error = exc
                call.done.set()

    def _counters(self) -> dict[str, Any]:
        pipeline = self.engine.pipeline
        return {"recoveries": self.roles.recoveries,
                "bytes_read": pipeline.workers.bytes_read, "passes": pipeline.verified}


class Coordinator:
    """The coordinator actor: hosts an `Engine` whose workers are role actors; it returns only plain data.

    bundle: a replica's placement-group bundle (replicas.py): its roles are launched into it. The actor is threaded:
    several `run_chunk` calls (a replica's leased chunks) are in flight at once and share one engine stream
    (`ChunkStream`), and progress and stats answer meanwhile; `generate` waits for that stream to finish, then runs
    alone."""

    def __init__(self, config: EngineConfig, resources: dict[str, ActorResources] | None = None,
                 max_restarts: int = 3, call_timeout_s: float = CALL_TIMEOUT_S, bundle: Bundle | None = None) -> None:
        self.resources = resources or plan_resources(config)  # here: threads from this node's cores
        torch.set_num_threads(self.resources["coordinator"].threads)
        normal_priority()  # the executor threads (and the roles they wait for) are the engine, not background work
        self.config, self.max_restarts, self.call_timeout_s = config, max_restarts, call_timeout_s
        self.engine: Engine | None = None
        self.roles: RoleWorkers | None = None
        self.bundle, self.lock = bundle, threading.Lock()
        self.chunks: ChunkStream | None = None  # the leased chunks' engine stream, while chunks come

    def start(self) -> dict[str, Any]:
        """Build the engine and its role actors (errors such as a too-small budget surface here). Idempotent."""
        with self.lock:
            if self.engine is None:
                self._start()
            assert self.engine is not None
            plan = self.engine.plan
            return {"placement": self.engine.describe_placement(), "pids": self.pids(), "node": current_node_id(),
                    "slots": plan.batch * plan.num_batches}  # rows its engine decodes at once

    def _start(self) -> None:
        # The actors start (import torch, ...) while this process reads the checkpoints and places the model.
        roles = ["prefetch", "attention", "verifier"] + (["draft"] if draft_role(self.config) else [])
        group = RoleGroup(self.config, roles, self.resources, self.max_restarts, self.bundle)
        self.roles = RoleWorkers(group, self.max_restarts, self.call_timeout_s)
        try:
            self.engine = Engine(self.config, workers=self.roles, recovery=self.roles)
        except BaseException:
            self.roles.close()
            self.roles = None
            raise

    def generate(self, prompts: list[Any], params: dict[str, Any] | list[dict[str, Any]] | None,
                 keys: list[int] | None = None) -> list[dict[str, Any]]:
        """params: the fields of one SamplingParams for every prompt, or of one per prompt; keys: each prompt's
        random-stream key (Engine.generate)."""
        with self.lock:
            self._end_chunks()  # the engine runs one thing at a time
            engine, roles = self._engine()
            roles.recoveries = 0
            per_row = [SamplingParams(**p) for p in params] if isinstance(params, list) else (
                SamplingParams(**params) if params else None)
            results = engine.generate(prompts, per_row, keys=keys)
        return [dataclasses.asdict(r) for r in results]

    def run_chunk(self, prompts: list[list[int]], params: list[dict[str, Any]] | dict[str, Any] | None,
                  keys: list[int | str] | None = None) -> dict[str, Any]:
        """A leased chunk of a job (replicas.py): its rows' results without their prompts, and what it cost.

        The rows go into the replica's one long-lived engine stream (`ChunkStream`), beside the rows of the other
        chunks in flight here: a chunk is never a drain point. The call returns once its own rows have finished;
        if the stream dies (a role lost beyond its restarts), it raises that error and the driver re-leases."""
        per_row = ([SamplingParams(**p) for p in params] if isinstance(params, list)
                   else [SamplingParams(**(params or {}))] * len(prompts))
        rows = [(prompt, p, i if keys is None else keys[i]) for i, (prompt, p) in enumerate(zip(prompts, per_row))]
        with self.lock:
            engine, roles = self._engine()
            if self.chunks is None or not self.chunks.alive:
                roles.recoveries = 0
                self.chunks = ChunkStream(engine, roles)
            call = self.chunks.submit(rows)
        results, cost = call.result()
        keep = ("token_ids", "text", "finish_reason", "num_drafted", "num_accepted", "stop_reason", "logprobs",
                "time_to_first_token_s", "time_s")
        return {"results": [{k: getattr(r, k) for k in keep} for r in results]} | cost

    def _end_chunks(self, timeout_s: float | None = None) -> None:
        """Close the chunk stream (its rows in flight finish first, within timeout_s)."""
        if self.chunks is not None:
            self.chunks.close(timeout_s)
            self.chunks = None

    def stats(self) -> dict[str, Any]:
        engine, roles = self._engine()
        out: dict[str, Any] = {}
        if engine.last_stats is not None:
            s = engine.last_stats
            out = dataclasses.asdict(s) | {"tokens_per_s": s.tokens_per_s, "acceptance_rate": s.acceptance_rate}
        return out | {"recoveries": roles.recoveries, "lost": dict(roles.lost), "pids": roles.pids(),
                      "calls": roles.calls(),
                      "k": engine.replanner.k, "batch_size": engine.plan.batch}

    def progress(self) -> dict[str, Any]:
        """Counters readable while `generate` runs (the actor is threaded)."""
        engine, roles = self._engine()
        return {"running": engine.pipeline.running, "verified": engine.pipeline.verified,
                "recoveries": roles.recoveries}

    def pids(self) -> dict[str, int]:
        _, roles = self._engine()
        return {"coordinator": os.getpid()} | roles.pids()

    def role_infos(self) -> dict[str, RoleInfo]:
        _, roles = self._engine()
        return dict(roles.group.infos)

    def shutdown(self) -> None:
        self._end_chunks(timeout_s=5.0)  # (rows still in flight then fail with the engine's closing)
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.roles is not None:
            self.roles.close()
            self.roles = None

    def _engine(self) -> tuple[Engine, RoleWorkers]:
        if self.engine is None or self.roles is None:
            raise SpecOffloadError("the engine was shut down (or never started)")
        return self.engine, self.roles
