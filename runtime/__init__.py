"""SpecOffload runtime: model executors, KV cache, speculative verification and the in-process Engine.

Never imports Ray: everything here runs and is tested in one process. The public names below are loaded
lazily (PEP 562), so importing a pure submodule (e.g. `runtime.offload.placement` from the planner) does not
pull in the executors.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EngineConfig": ".config",
    "Engine": ".engine",
    "GenerateStats": ".engine",
    "PromptError": ".engine",
    "VocabularyMismatchError": ".engine",
    "CheckpointError": ".models.errors",
    "SpecOffloadError": ".models.errors",
    "UnsupportedModelError": ".models.errors",
    "GenerationResult": ".request",
    "SamplingParams": ".sampling",
}

__all__ = [
    "CheckpointError",
    "Engine",
    "EngineConfig",
    "GenerateStats",
    "GenerationResult",
    "PromptError",
    "SamplingParams",
    "SpecOffloadError",
    "UnsupportedModelError",
    "VocabularyMismatchError",
]

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine import Engine, GenerateStats, PromptError, VocabularyMismatchError
    from .models.errors import CheckpointError, SpecOffloadError, UnsupportedModelError
    from .request import GenerationResult
    from .sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
