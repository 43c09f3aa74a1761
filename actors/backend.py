"""The `ray` backend of `specoffload generate` (registered in pyproject.toml under `specoffload.backends`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from ray.exceptions import RayError

from specoffload.planner.plan import Plan
from specoffload.runtime.backends import BackendError, BackendOptions
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.offline.chunks import Chunk, ChunkDone

from .client import EngineLost, connect
from .rayget import first_line


class RayBackend:
    """The Ray actor runtime behind the CLI's job: `--replicas` engines, one per node, leasing its chunks
    (replicas.py)."""

    def __init__(self, config: EngineConfig, options: BackendOptions, plan: Plan | None = None) -> None:
        """plan: the job's plan; each replica plans for its own node instead (its profile), so it is unused."""
        if not config.offloaded:
            raise BackendError("--backend ray runs the offloaded engine: give --device-memory")
        if options.trace is not None:
            raise BackendError("--trace is recorded by the local backend only; drop it or use --backend local")
        try:
            self.pool = connect(config, options.ray_address, replicas=options.replicas or 1)
        except (RayError, ConnectionError, TimeoutError) as exc:  # Ray could not start or be reached: one line
            raise EngineLost(f"could not start the Ray backend: {first_line(exc, with_type=True)}") from None
        if options.show_placement:
            print(self.pool.placement, file=sys.stderr)

    def run(self, chunks: Iterator[Chunk], window: int) -> Iterator[ChunkDone]:
        return self.pool.run(chunks, window)

    def report(self) -> None:
        replicas = self.pool.replicas
        for replica in replicas:
            print(replica.describe(), file=sys.stderr)
        recoveries = sum(r.recoveries for r in replicas)
        lost = sum(r.lost_leases for r in replicas)
        print(f"weights read: {sum(r.bytes_read for r in replicas) / 1e9:.2f} GB in "
              f"{sum(r.passes for r in replicas)} streamed passes; {recoveries} recoveries from lost actors; "
              f"{lost} lost leases (chunks redone on another replica)", file=sys.stderr)

    def summary(self) -> dict[str, Any]:
        return {"backend": "ray", "replicas": self.pool.stats(), "events": self.pool.events,
                "driver_s": self.pool.driver_s, "bundle": self.pool.bundle}

    def close(self) -> None:
        self.pool.shutdown()
