"""The one place that turns plain classes into Ray actors, with explicit resources.

Every actor gets a fractional CPU share, so the five actors of one engine (coordinator + four roles) fit even a
one-CPU Ray node: Ray's logical CPUs only gate scheduling, and the real parallelism is set per process with
`torch.set_num_threads` (whatever OMP_NUM_THREADS Ray derives from a fractional share, every role sets its thread
count itself, from `ActorResources.threads`). Roles are pinned to the coordinator's node: they share memory
(/dev/shm arenas) and ipc sockets with it: by node affinity for a single engine, or, for a replica (replicas.py), by
launching all five into the replica's placement-group bundle (`Bundle`), which Ray keeps on one node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from specoffload.runtime.config import EngineConfig

#: environment of every actor process. libgomp (torch's OpenMP) lets idle team threads spin 300,000 times before
#: sleeping, but only 100 times when a process has more OpenMP threads than CPUs, as the local backend's one
#: process does (its cpu and device threads each run a team). One team per role process never hits that limit,
#: so each role would keep a core spinning after every kernel while another role computes: +24% wall time on
#: 2 cores (docs/perf/README.md, ray_backend). Give the roles the local backend's spin count, unless the user
#: chose an OpenMP wait policy.
ACTOR_ENV: dict[str, str] = {"GOMP_SPINCOUNT": "100"}


@dataclass(frozen=True)
class ActorResources:
    """Ray's scheduling share of one actor and the torch threads it computes with."""

    num_cpus: float
    num_gpus: float = 0.0
    threads: int = 1


def plan_resources(config: EngineConfig, cpus: int | None = None) -> dict[str, ActorResources]:
    """Shares for the coordinator and the four roles, adding up to one CPU (and one GPU on CUDA).

    The compute roles (attention: cpu; verifier, draft: device) each get `config.num_threads` torch threads,
    default all `cpus` of the node, as the local backend's cpu and device threads do; the loader and the
    coordinator one each (they mostly wait on I/O and sockets).
    """
    compute = config.num_threads or cpus or len(os.sched_getaffinity(0)) or 1  # the cores this process may use
    gpu = 0.5 if torch.device(config.device).type == "cuda" else 0.0  # verifier and draft share the device
    return {
        "coordinator": ActorResources(0.1),
        "prefetch": ActorResources(0.1),
        "attention": ActorResources(0.3, threads=compute),
        "verifier": ActorResources(0.3, gpu, compute),
        "draft": ActorResources(0.2, gpu, compute),
    }


@dataclass(frozen=True)
class Bundle:
    """Bundle `index` of placement group `group`: the node-local share of one replica (all five of its actors)."""

    group: Any  # ray.util.placement_group.PlacementGroup
    index: int


def bundle_resources(resources: dict[str, ActorResources], roles: list[str],
                     extra: dict[str, float] | None = None) -> dict[str, float]:
    """The resources of a bundle that holds `roles` (and `extra`, e.g. one unit of a replica resource)."""
    cpus = round(sum(resources[r].num_cpus for r in roles), 4)  # Ray counts in 1e-4 units: 0.1 + 0.2 is 0.3 there
    gpus = round(sum(resources[r].num_gpus for r in roles), 4)
    return {"CPU": cpus} | ({"GPU": gpus} if gpus else {}) | (extra or {})


_ACTOR_CLASSES: dict[type, Any] = {}


def launch(cls: type, *args: Any, resources: ActorResources, max_restarts: int = 0, max_concurrency: int = 1,
           node_id: str | None = None, placement: Bundle | None = None, name: str | None = None,
           **kwargs: Any) -> Any:
    """Start `cls(*args, **kwargs)` as a Ray actor and return its handle.

    max_restarts: how often Ray restarts the actor after its process dies (its constructor runs again with the
    same arguments; in-flight Ray calls fail, later ones wait for the restart). node_id: pin it to that node
    (hard affinity), e.g. the coordinator's. placement: run it in that placement-group bundle instead (a restarted
    actor goes where Ray has rescheduled the bundle). max_concurrency > 1: a threaded actor (answers control calls
    while a long call runs).
    """
    actor_cls = _ACTOR_CLASSES.get(cls)
    if actor_cls is None:
        actor_cls = _ACTOR_CLASSES[cls] = ray.remote(cls)
    options: dict[str, Any] = dict(
        num_cpus=resources.num_cpus,
        num_gpus=resources.num_gpus,
        max_restarts=max_restarts,
        max_task_retries=0,
        max_concurrency=max_concurrency,
    )
    if not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ):  # this node's environment says nothing
        options["runtime_env"] = {"env_vars": dict(ACTOR_ENV)}
    if placement is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement.group, placement_group_bundle_index=placement.index, placement_group_capture_child_tasks=False)
    elif node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    if name is not None:
        options["name"] = name
    return actor_cls.options(**options).remote(*args, **kwargs)


def current_node_id() -> str:
    """The Ray node this process runs on (inside an actor or a connected driver)."""
    return ray.get_runtime_context().get_node_id()
