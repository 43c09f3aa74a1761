"""`connect`: start or join Ray, launch a coordinator with its role actors, and drive it like an engine.

    from specoffload.actors import connect
    with connect(EngineConfig(target, draft, device_memory="4.5GiB", max_batch_size=8, num_draft_tokens=3)) as llm:
        results = llm.generate(prompts, SamplingParams(max_new_tokens=64))

Prompts, sampling settings and results travel through Ray (control: a few calls per `generate`); tensors never
do (they stay in shared memory between the coordinator and the roles, on the coordinator's node).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from specoffload.actors.transport.arena import sweep_dead_arenas
from specoffload.actors.transport.channel import ChannelConfig
from specoffload.actors.transport.procs import pid_exited
from specoffload.actors.transport.shm import ARENA_TAG, sweep_dead_sockets
from specoffload.planner.errors import SpecOffloadError
from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Prompt
from specoffload.runtime.request import GenerationResult
from specoffload.runtime.sampling import SamplingParams

from .coordinator import Coordinator
from .launcher import launch, plan_resources
from .proxy import CALL_TIMEOUT_S
from .rayget import first_line, ray_get
from .replicas import ReplicaPool
from .roles import RoleInfo

logger = logging.getLogger("specoffload.actors")


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
        return _get(self._coordinator.stats.remote(), CONTROL_TIMEOUT_S)

    def progress(self) -> dict[str, Any]:
        """The generate in flight: running, verify rounds done, recoveries from lost actors."""
        return _get(self._coordinator.progress.remote(), CONTROL_TIMEOUT_S)

    def pids(self) -> dict[str, int]:
        """Process id of the coordinator and of each role actor now (a restarted role has a new one)."""
        return _get(self._coordinator.pids.remote(), CONTROL_TIMEOUT_S)

    def roles(self) -> dict[str, RoleInfo]:
        """Each role's pid, socket and shared slot arenas."""
        return _get(self._coordinator.role_infos.remote(), CONTROL_TIMEOUT_S)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the role actors and the coordinator (their shared memory is unlinked); disconnect from a Ray this
        handle started. Always cleans up, whatever state the coordinator or Ray is in (dead, hung, gone)."""
        if self._coordinator is None:
            return
        coordinator, self._coordinator = self._coordinator, None
        pids = set(self._pids.values())
        socket_dirs = set()
        try:
            pids |= set(_get(coordinator.pids.remote(), timeout_s).values())
            socket_dirs = {str(i.channel.socket_dir) for i in _get(coordinator.role_infos.remote(), timeout_s).values()}
            _get(coordinator.shutdown.remote(), timeout_s)
        except SpecOffloadError as exc:  # dead or hung: its roles die with it (fate sharing); the sweeps clean up
            logger.warning("engine shutdown: %s", exc)
        try:
            with contextlib.suppress(RayError, ConnectionError, ValueError):
                ray.kill(coordinator, no_restart=True)
            deadline = time.monotonic() + 10.0
            while not all(pid_exited(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            # On this node (the usual case): whatever a killed actor could not remove itself.
            sweep_dead_arenas(ARENA_TAG)
            for folder in socket_dirs or {str(ChannelConfig("probe").socket_dir)}:
                sweep_dead_sockets(folder)
        finally:
            if self._owns_ray:
                ray.shutdown()

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def connect(config: EngineConfig, address: str | None = None, *, max_restarts: int = 3,
            call_timeout_s: float = CALL_TIMEOUT_S, replicas: int | str | None = None,
            **ray_init: Any) -> EngineHandle | ReplicaPool:
    """Start the Ray backend for `config` (an offloaded config: device_memory set) and return its handle.

    address: None: start a local Ray (or join one found on this machine, as `ray.init()` does); "auto": join the
    running cluster; "ray://host:port": Ray client (needs `ray[client]`). Ignored when this process is already
    connected to Ray: that connection is used. ray_init: more keyword arguments for `ray.init`. max_restarts:
    how often each role actor may be lost (died, or hung past call_timeout_s and killed) over the engine's life;
    one more fails the call at once (`RestartsExhausted`). A dead coordinator fails the call with `EngineLost`.
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
    # The coordinator is not restarted: a restarted one would have lost its engine (its role actors die with it,
    # fate sharing); a call in flight fails with EngineLost instead, and the caller reconnects.
    coordinator = launch(Coordinator, config, None, max_restarts, call_timeout_s, resources=resources["coordinator"],
                         max_restarts=0, max_concurrency=4)
    try:
        started = _get(coordinator.start.remote())
    except BaseException:
        ray.kill(coordinator, no_restart=True)
        if owns_ray:
            ray.shutdown()
        raise
    return EngineHandle(coordinator, started, owns_ray)


class EngineLost(SpecOffloadError):
    """The coordinator actor, or Ray itself, is gone: this engine cannot go on (rows already written stay)."""


#: seconds a control call (stats, pids, progress) may take before the coordinator counts as unresponsive
CONTROL_TIMEOUT_S = 60.0


def _get(ref: Any, timeout_s: float | None = None) -> Any:
    """ray.get, re-raising an error of the coordinator as its own type (e.g. PromptError), not RayTaskError, and
    a dead coordinator or Ray as one `EngineLost` line. timeout_s: None for generate (it may take hours)."""
    try:
        return ray_get(ref, timeout_s)
    except RayTaskError:  # the coordinator's own error, already re-raised as its type: not a lost engine
        raise
    except GetTimeoutError:
        raise EngineLost(f"the coordinator did not answer a control call within {timeout_s:.0f} s") from None
    except RayActorError as exc:
        raise EngineLost(f"the coordinator actor died ({first_line(exc)}); its role actors died with it. "
                         "Reconnect to go on (with the CLI: rerun with --resume)") from None
    except RayError as exc:
        raise EngineLost(f"Ray failed under the engine: {first_line(exc, with_type=True)}") from None
    except ConnectionError as exc:
        raise EngineLost(f"the connection to Ray was lost: {first_line(exc)}") from None

