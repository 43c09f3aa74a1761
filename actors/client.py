"""`connect`: start or join Ray, launch a coordinator with its role actors, and drive it like an engine.

    from specoffload.actors import connect
    with connect(EngineConfig(target, draft, device_memory="4.5GiB", max_batch_size=8, num_draft_tokens=3)) as llm:
        results = llm.generate(prompts, SamplingParams(max_new_tokens=64))

Prompts, sampling settings and results travel through Ray (control: a few calls per `generate`); tensors never
do (they stay in shared memory between the coordinator and the roles, on the coordinator's node).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Prompt
from specoffload.runtime.request import GenerationResult
from specoffload.runtime.sampling import SamplingParams
from specoffload.runtime.transport.arena import sweep_dead_arenas
from specoffload.runtime.transport.procs import pid_alive
from specoffload.runtime.transport.shm import sweep_dead_sockets

from .coordinator import Coordinator
from .launcher import launch, plan_resources
from .replicas import ReplicaPool
from .roles import RoleInfo


class EngineHandle:
    """A running Ray engine: `generate` as the in-process engines have it, plus `stats` and `shutdown`."""

    def __init__(self, coordinator: Any, started: dict[str, Any], owns_ray: bool) -> None:
        self._coordinator = coordinator
        self._owns_ray = owns_ray
        self.placement: str = started["placement"]
        self._pids: dict[str, int] = started["pids"]

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[GenerationResult]:
        """Complete every prompt; results come back in input order (see runtime.Engine.generate)."""
        as_dict = dataclasses.asdict(params) if params is not None else None
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        results = _get(self._coordinator.generate.remote(prompts, as_dict))
        return [GenerationResult(**r) for r in results]

    def stats(self) -> dict[str, Any]:
        """The last generate's totals (OffloadStats fields, tokens_per_s, acceptance_rate), recoveries from lost
        actors, the role processes' pids and calls made to each."""
        return _get(self._coordinator.stats.remote())

    def progress(self) -> dict[str, Any]:
        """The generate in flight: running, verify rounds done, recoveries from lost actors."""
        return _get(self._coordinator.progress.remote())

    def pids(self) -> dict[str, int]:
        """Process id of the coordinator and of each role actor now (a restarted role has a new one)."""
        return _get(self._coordinator.pids.remote())

    def roles(self) -> dict[str, RoleInfo]:
        """Each role's pid, socket and shared slot arenas."""
        return _get(self._coordinator.role_infos.remote())

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the role actors and the coordinator (their shared memory is unlinked); disconnect from a Ray this
        handle started."""
        if self._coordinator is None:
            return
        pids = set(self._pids.values())
        socket_dirs = set()
        try:
            pids |= set(self.pids().values())
            socket_dirs = {str(info.channel.socket_dir) for info in self.roles().values()}
            ray.get(self._coordinator.shutdown.remote(), timeout=timeout_s)
        except (RayActorError, GetTimeoutError):
            pass  # a dead coordinator's roles die with it (fate sharing); the sweeps below clean up
        ray.kill(self._coordinator, no_restart=True)
        self._coordinator = None
        deadline = time.monotonic() + 10.0
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        # On this node (the usual case): whatever a killed actor could not remove itself.
        sweep_dead_arenas()
        for folder in socket_dirs:
            sweep_dead_sockets(folder)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def connect(config: EngineConfig, address: str | None = None, *, max_restarts: int = 3,
            replicas: int | str | None = None, **ray_init: Any) -> EngineHandle | ReplicaPool:
    """Start the Ray backend for `config` (an offloaded config: device_memory set) and return its handle.

    address: None: start a local Ray (or join one found on this machine, as `ray.init()` does); "auto": join the
    running cluster; "ray://host:port": Ray client (needs `ray[client]`). Ignored when this process is already
    connected to Ray: that connection is used. ray_init: more keyword arguments for `ray.init`. max_restarts:
    restarts of each role actor (and recoveries per generate) before a lost actor fails the call.
    replicas: a number or "auto": a `ReplicaPool` of that many engines, one per node (replicas.py), instead of one.
    """
    if not config.offloaded:
        raise ConfigError("the Ray backend runs the offloaded engine: set device_memory in the EngineConfig")
    owns_ray = False
    if not ray.is_initialized():
        ray.init(address=address, **ray_init)
        owns_ray = True
    if replicas is not None:
        try:
            return ReplicaPool(config, replicas, max_restarts=max_restarts, owns_ray=owns_ray)
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
    resources = plan_resources(config)
    coordinator = launch(Coordinator, config, None, max_restarts, resources=resources["coordinator"],
                         max_concurrency=4)
    try:
        started = _get(coordinator.start.remote())
    except BaseException:
        ray.kill(coordinator, no_restart=True)
        if owns_ray:
            ray.shutdown()
        raise
    return EngineHandle(coordinator, started, owns_ray)


def _get(ref: Any) -> Any:
    """ray.get, re-raising an error of the coordinator as its own type (e.g. PromptError), not RayTaskError."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        raise exc.as_instanceof_cause() from None
