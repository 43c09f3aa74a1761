"""Backends of the `specoffload generate` chunk loop, looked up by name in a registry that packages fill.

`local` (this module) runs the `Engine` in this process. Other backends register under the entry-point group
`specoffload.backends` (pyproject.toml: actors/ registers `ray`), so the runtime never imports them: the CLI
asks `load_backend(name)` at run time. A backend is a class built from (config, options) with `generate`,
`report` and `close`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

from specoffload.planner.errors import SpecOffloadError

from .config import EngineConfig
from .request import GenerationResult
from .sampling import SamplingParams

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


class Backend(Protocol):
    def generate(self, prompts: list, params: SamplingParams) -> list[GenerationResult]: ...
    def report(self) -> None: ...
    def close(self) -> None: ...


class LocalBackend:
    """The engine in this process (offloaded when the config has device_memory, else resident)."""

    def __init__(self, config: EngineConfig, options: BackendOptions) -> None:
        from .engine import Engine  # heavy import (torch, transformers) only when needed

        self.engine = Engine(config)
        self.options = options
        self.bytes_read = self.passes = 0
        if options.show_placement:
            print(self.engine.describe_placement(), file=sys.stderr)

    def generate(self, prompts: list, params: SamplingParams) -> list[GenerationResult]:
        results = self.engine.generate(prompts, params, progress=self.options.progress)
        stats = self.engine.last_stats
        self.bytes_read += getattr(stats, "bytes_read", 0)
        self.passes += getattr(stats, "passes", 0)
        return results

    def report(self) -> None:
        engine = self.engine
        if engine.pipeline is None:
            return
        print(f"plan: {engine.plan.describe()}; re-planned k {len(engine.replanner.replans)} times "
              f"(now k = {engine.replanner.k})", file=sys.stderr)
        print(f"weights read: {self.bytes_read / 1e9:.2f} GB in {self.passes} streamed passes", file=sys.stderr)
        if self.options.trace is not None:
            path = engine.tracer.save_chrome_trace(self.options.trace)
            print(engine.tracer.breakdown().table(), file=sys.stderr)
            print(f"trace: {path} (open in https://ui.perfetto.dev)", file=sys.stderr)

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
