"""The coordinator: `OffloadEngine`'s schedule over role actors, and the Coordinator actor that hosts it.

`RayOffloadEngine` is `OffloadEngine` with its four workers replaced by proxies of role actors (`RoleGroup`
launches them on this node and sets them up); the op handlers, the schedule and verification are unchanged.

Fault tolerance. The coordinator's requests hold every committed token; the workers hold only derived state (KV
caches, slot contents, generators). When a role actor dies mid-generation, the proxy call waiting on it raises
`WorkerLost`, the executor stops the step (`PipelineError`), and `_recover`:
  1. sets every role up again: Ray restarts the dead actor (max_restarts) and its setup builds a fresh worker
     (and, for the prefetch role, fresh slot arenas that the attention and verifier roles re-attach); live roles
     drop their per-batch state;
  2. clears each batch's in-flight pass state (drafts, hidden states, logits), retires rows that finished
     before the fault, and creates empty KV caches for the rest (an empty batch is refilled from the queue);
  3. returns True, and `OffloadEngine._generate` runs the schedule again: each batch's next target pass feeds
     all its committed tokens (the cache is empty), the draft re-prefills the same way. Nothing is lost (a pass
     whose verify did not commit is simply redone) or duplicated (tokens are only appended by verify). Greedy
     results equal a run without faults; sampled ones are a valid sample, not the same one (generators reseed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.models.errors import SpecOffloadError
from specoffload.runtime.offload.engine import OffloadEngine, _Batch
from specoffload.runtime.offload.schedule import Op
from specoffload.runtime.offload.workers import WeightPlan
from specoffload.runtime.request import GenerationResult
from specoffload.runtime.sampling import SamplingParams
from specoffload.runtime.transport.arena import sweep_dead_arenas
from specoffload.runtime.transport.procs import pid_alive
from specoffload.runtime.transport.shm import ShmTensors

from .launcher import ActorResources, current_node_id, launch, plan_resources
from .proxy import PROXIES, LanePool, RoleProxy, WorkerLost
from .roles import ROLES, RoleInfo, normal_priority

logger = logging.getLogger("specoffload.actors")

#: seconds to wait for a role's setup (a restarted actor imports torch and loads its resident weights)
SETUP_TIMEOUT_S = 300.0


class RoleGroup:
    """The role actors of one engine: launch (pinned to this node), setup in dependency order, shutdown."""

    def __init__(self, config: EngineConfig, roles: Sequence[str], resources: dict[str, ActorResources],
                 max_restarts: int) -> None:
        node = current_node_id()
        self.actors = {
            role: launch(ROLES[role], config, resources[role].threads, resources=resources[role],
                         max_restarts=max_restarts, node_id=node)
            for role in roles
        }
        self.infos: dict[str, RoleInfo] = {}

    def drop(self, role: str) -> None:
        """End a role that turned out not to be needed (the planner chose no draft)."""
        ray.kill(self.actors.pop(role), no_restart=True)

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
        while any(pid_alive(pid) for pid in self.pids().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        sweep_dead_arenas()
        self.actors = {}


class RayOffloadEngine(OffloadEngine):
    """OffloadEngine whose workers are role actors; recovers from a lost actor (see the module docstring).

    resources: per-actor shares and threads (default `plan_resources`); max_restarts: per role actor, and the
    number of recoveries one `generate` may make. `verified` and `recoveries` count within the current generate.
    """

    def __init__(self, config: EngineConfig, resources: dict[str, ActorResources] | None = None,
                 max_restarts: int = 3) -> None:
        self.resources = resources or plan_resources(config)
        self.max_restarts = max_restarts
        self.recoveries = 0
        self.verified = 0  # verify ops run, for progress reports
        self.running = False
        # The actors start (import torch, ...) while this process reads the checkpoints and places the model.
        roles = ["prefetch", "attention", "verifier"] + (["draft"] if config.draft is not None else [])
        self.group = self._launch_roles(config, roles)
        try:
            super().__init__(config)
        except BaseException:
            self.group.shutdown()
            raise

    def _launch_roles(self, config: EngineConfig, roles: list[str]) -> RoleGroup:
        return RoleGroup(config, roles, self.resources, self.max_restarts)

    def _make_workers(self) -> None:
        if self.draft is None and "draft" in self.group.actors:
            self.group.drop("draft")
        self.shm = ShmTensors("coordinator")
        self.lanes = LanePool()
        infos = self.group.setup(self.plan)
        self.proxies: dict[str, RoleProxy] = {
            role: PROXIES[role](info, self.shm, self.lanes) for role, info in infos.items()
        }
        self.prefetch = self.proxies["prefetch"]
        self.attn = self.proxies["attention"]
        self.verifier = self.proxies["verifier"]
        self.drafter = self.proxies.get("draft")

    def _generate(self, encoded: list[list[int]], params: SamplingParams, progress: bool) -> list[GenerationResult]:
        self.verified = self.recoveries = 0
        self.running = True
        try:
            return super()._generate(encoded, params, progress)
        finally:
            self.running = False

    def _op_verify(self, op: Op) -> None:
        super()._op_verify(op)
        self.verified += 1

    def _recover(self, error: SpecOffloadError) -> bool:
        lost = _lost_worker(error) or next((p.role for p in self.proxies.values() if not p.alive()), None)
        if lost is None or self.recoveries >= self.max_restarts:
            return False
        self.recoveries += 1
        logger.warning("recovering from a lost %s actor (%s); replaying from the committed tokens", lost, error)
        for role, info in self.group.setup(self.plan).items():
            self.proxies[role].rebind(info)
        for b in self._batches:
            self._restart_batch(b)
        return True

    def _restart_batch(self, b: _Batch) -> None:
        """Forget the batch's pass in flight; fresh caches for its unfinished rows (or refill an empty batch)."""
        b.drafts = b.p = b.hidden = b.logits = b.num_new = b.token_mask = None
        b.draft_tokens, b.draft_probs = [], []
        keep = [r for r in b.rows if not r.finished]
        self._bar.update(len(b.rows) - len(keep))
        b.rows = keep
        if not keep:
            self._admit(b)
            return
        seed = self._params.seed
        capacity = max(len(r.prompt) + r.max_new_tokens for r in keep) + self.k_max + 1
        self.attn.reset(b.index, len(keep), capacity)
        self.verifier.seed(b.index, None if seed is None else seed * 4 + 2 * b.index + self._waves)
        if self.drafter is not None:
            self.drafter.reset(b.index, len(keep), capacity,
                              None if seed is None else seed * 4 + 2 * b.index + 1 + self._waves)
        self._waves += 1

    def pids(self) -> dict[str, int]:
        return self.group.pids()

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        self.group.shutdown()
        self.shm.close()


def _lost_worker(error: BaseException | None) -> str | None:
    """The role named by a WorkerLost in the exception's cause chain."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, WorkerLost):
            return error.role
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class Coordinator:
    """The coordinator actor: hosts a RayOffloadEngine; everything it returns is plain data (dicts, lists)."""

    def __init__(self, config: EngineConfig, resources: dict[str, ActorResources] | None = None,
                 max_restarts: int = 3) -> None:
        self.resources = resources or plan_resources(config)  # here: threads from this node's cores
        torch.set_num_threads(self.resources["coordinator"].threads)
        normal_priority()  # the executor threads (and the roles they wait for) are the engine, not background work
        self.config, self.max_restarts = config, max_restarts
        self.engine: RayOffloadEngine | None = None

    def start(self) -> dict[str, Any]:
        """Build the engine and its role actors (errors such as a too-small budget surface here)."""
        self.engine = RayOffloadEngine(self.config, self.resources, self.max_restarts)
        return {"placement": self.engine.describe_placement(), "pids": self.engine.pids()}

    def generate(self, prompts: list[Any], params: dict[str, Any] | None) -> list[dict[str, Any]]:
        engine = self._engine()
        results = engine.generate(prompts, SamplingParams(**params) if params else None)
        return [dataclasses.asdict(r) for r in results]

    def stats(self) -> dict[str, Any]:
        engine = self._engine()
        out: dict[str, Any] = {}
        if engine.last_stats is not None:
            s = engine.last_stats
            out = dataclasses.asdict(s) | {"tokens_per_s": s.tokens_per_s, "acceptance_rate": s.acceptance_rate}
        calls = {role: proxy.calls for role, proxy in engine.proxies.items()}
        return out | {"recoveries": engine.recoveries, "pids": engine.pids(), "calls": calls,
                      "k": engine.k, "batch_size": engine.config.max_batch_size}

    def progress(self) -> dict[str, Any]:
        """Counters readable while `generate` runs (the actor is threaded)."""
        engine = self._engine()
        return {"running": engine.running, "verified": engine.verified, "recoveries": engine.recoveries}

    def pids(self) -> dict[str, int]:
        return {"coordinator": os.getpid()} | self._engine().pids()

    def roles(self) -> dict[str, RoleInfo]:
        return dict(self._engine().group.infos)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _engine(self) -> RayOffloadEngine:
        if self.engine is None:
            raise SpecOffloadError("the engine was shut down (or never started)")
        return self.engine
