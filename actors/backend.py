"""The `ray` backend of `specoffload generate` (registered in pyproject.toml under `specoffload.backends`)."""

from __future__ import annotations

import sys

from specoffload.runtime.backends import BackendError, BackendOptions
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.request import GenerationResult
from specoffload.runtime.sampling import SamplingParams

from .client import connect


class RayBackend:
    """The Ray actor runtime (`connect`) behind the CLI's chunk loop."""

    def __init__(self, config: EngineConfig, options: BackendOptions) -> None:
        if not config.offloaded:
            raise BackendError("--backend ray runs the offloaded engine: give --device-memory")
        if options.trace is not None:
            raise BackendError("--trace is recorded by the local backend only; drop it or use --backend local")
        self.handle = connect(config, options.ray_address)
        self.bytes_read = self.passes = self.recoveries = 0
        if options.show_placement:
            print(self.handle.placement, file=sys.stderr)

    def generate(self, prompts: list, params: SamplingParams) -> list[GenerationResult]:
        results = self.handle.generate(prompts, params)
        s = self.handle.stats()
        self.bytes_read += int(s.get("bytes_read", 0))
        self.passes += int(s.get("passes", 0))
        self.recoveries += int(s.get("recoveries", 0))
        return results

    def report(self) -> None:
        print(f"weights read: {self.bytes_read / 1e9:.2f} GB in {self.passes} streamed passes; "
              f"{self.recoveries} recoveries from lost actors", file=sys.stderr)

    def close(self) -> None:
        self.handle.shutdown()
