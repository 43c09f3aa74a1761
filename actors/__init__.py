"""SpecOffload's Ray backend: the offloaded engine's workers as actors, one coordinator, shared-memory tensors.

    from specoffload.actors import connect
    llm = connect(EngineConfig(...))          # starts or joins Ray; launches the coordinator and four role actors
    results = llm.generate(prompts, params)   # the same results as Engine(config).generate
    llm.shutdown()

Modules: `roles` (the worker roles: plain classes serving a runtime worker over ZeroMQ), `proxy` (the
coordinator's stand-ins, generated from the worker classes), `coordinator` (`RoleGroup`, `RoleWorkers`: the
engine's worker factory and recovery, and the Coordinator actor), `backend` (the CLI's `ray` backend),
`launcher` (the only place that applies `ray.remote`), `client` (`connect`, `EngineHandle`), `transport/` (shared-memory
arenas, msgpack messages and ZeroMQ channels: the wire the roles speak).
The names below load lazily: importing this package does not import Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "connect": ".client",
    "EngineHandle": ".client",
    "WorkerLost": ".proxy",
}

__all__ = ["EngineHandle", "WorkerLost", "connect"]

if TYPE_CHECKING:
    from .client import EngineHandle, connect
    from .proxy import WorkerLost


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
