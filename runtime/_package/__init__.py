"""SpecOffload: offloaded LLM inference with speculative decoding (`from specoffload import LLM, SamplingParams`).

The installed top-level package `specoffload`. Its source lives in runtime/_package/ because the repository's
top-level layout is fixed (actors/ runtime/ planner/ ...); pyproject.toml maps it here and maps runtime/,
planner/ and actors/ to `specoffload.runtime`, `specoffload.planner` and `specoffload.actors`.

The names are re-exported lazily from `specoffload.runtime` (PEP 562): `import specoffload.planner` stays free
of torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("specoffload")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "SpecOffloadError",
]

if TYPE_CHECKING:
    from specoffload.runtime import (
        LLM,
        CompletionOutput,
        Engine,
        EngineConfig,
        RequestOutput,
        SamplingParams,
        SpecOffloadError,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        import specoffload.runtime as runtime

        value = getattr(runtime, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specoffload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
