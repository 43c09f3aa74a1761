"""Backends of the `specoffload generate` chunk loop, looked up by name in a registry that packages fill.

`local` (this module) runs the `Engine` in this process. Other backends register under the entry-point group
`specoffload.backends` (pyproject.toml: actors/ registers `ray`), so the runtime never imports them: the CLI
asks `load_backend(name)` at run time. A backend is a class built from (config, options) with `run` (chunks in,
done chunks out, in any order: runtime/offline/chunks.py), `report`, `summary` and `close` (the `JobBackend`
protocol of runtime/offline/job.py).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.plan import Plan

from .config import EngineConfig
from .offline.chunks import Chunk, ChunkDone
from .offline.rows import RowJob, RowResult

GROUP = "specoffload.backends"


class BackendError(SpecOffloadError, ValueError):
    """An unknown backend, or options the backend cannot honour."""


@dataclass(frozen=True)
class BackendOptions:
    """What the CLI passes to a backend besides the engine config."""

    progress: bool = True
    show_placement: bool = False
    trace: Path | None = None
    ray_address: str | None = None
    replicas: int | str | None = None  # engines on a cluster (ray: one per node; "auto": every node that fits one)


class LocalBackend:
    """The engine in this process (offloaded when the config has device_memory, else resident)."""

    def __init__(self, config: EngineConfig, options: BackendOptions, plan: Plan | None = None) -> None:
        from .engine import Engine  # heavy import (torch, transformers) only when needed

        if options.replicas not in (None, 1):
            raise BackendError("--replicas runs engines on a Ray cluster: add --backend ray")
        self.engine = Engine(config, plan=plan)  # the job's plan (offline/job.py), else the engine's own
        self.options = options
        self.bytes_read = self.passes = 0
        if options.show_placement:
            print(self.engine.describe_placement(), file=sys.stderr)

    def run(self, chunks: Iterator[Chunk], window: int) -> Iterator[ChunkDone]:
        """Every chunk's rows through one long-lived engine stream (`Engine.generate_iter`): rows are pulled as
        slots free up, so a chunk is never a drain point; a chunk is done (and handed back, in any order) when its
        last row finishes. `window` is for backends with several workers."""
        # stream position -> (its chunk's state, its place in the chunk), for the rows in flight only: a finished
        # row's entry goes, so a long job holds the chunks it has not written yet, not the ones it has
        rows: dict[int, tuple[list, int]] = {}
        ready: list[ChunkDone] = []  # chunks of error rows only, done as soon as they are read
        position = itertools.count()

        def jobs() -> Iterator[RowJob]:
            for chunk in chunks:
                if not chunk.jobs:
                    ready.append(ChunkDone(chunk, ()))
                    continue
                state = [chunk, [None] * len(chunk.jobs), len(chunk.jobs)]
                for n, job in enumerate(chunk.jobs):
                    rows[next(position)] = (state, n)
                    yield job

        for r in self.engine.stream((list(j.token_ids), j.params, j.key) for j in jobs()):
            state, n = rows.pop(r.index)
            state[1][n] = RowResult.of(r)
            state[2] -= 1
            if state[2] == 0:
                ready.append(ChunkDone(state[0], tuple(state[1])))
            yield from _take(ready)
        yield from _take(ready)
        stats = self.engine.last_stats
        self.bytes_read += getattr(stats, "bytes_read", 0)
        self.passes += getattr(stats, "passes", 0)

    def committed_tokens(self) -> int:
        """Tokens the engine has committed in this job so far (rows still running included): the live rate."""
        return self.engine.pipeline.committed_tokens

    def report(self) -> None:
        engine = self.engine
        if engine.placement is not None:  # (resident: nothing streamed or re-planned to report)
            print(f"plan: {engine.plan.describe()}; re-planned k {len(engine.replanner.replans)} times "
                  f"(now k = {engine.replanner.k})", file=sys.stderr)
            print(f"weights read: {self.bytes_read / 1e9:.2f} GB in {self.passes} streamed passes", file=sys.stderr)
        if self.options.trace is not None:
            path = engine.tracer.save_chrome_trace(self.options.trace)
            print(engine.tracer.breakdown().table(), file=sys.stderr)
            print(f"trace: {path} (open in https://ui.perfetto.dev)", file=sys.stderr)

    def summary(self) -> dict[str, Any]:
        return {"backend": "local", "bytes_read": self.bytes_read, "passes": self.passes}

    def close(self) -> None:
        self.engine.close()


def backend_names() -> list[str]:
    return sorted({"local", *(ep.name for ep in entry_points(group=GROUP))})


def load_backend(name: str) -> type:
    """The backend class registered as `name` (`local` is built in)."""
    if name == "local":
        return LocalBackend
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise BackendError(f"unknown backend {name!r}; installed: {', '.join(backend_names())}")
    return found[0].load()


def _take(ready: list[ChunkDone]) -> Iterator[ChunkDone]:
    """Hand out (and forget) the chunks that are done."""
    while ready:
        yield ready.pop(0)

