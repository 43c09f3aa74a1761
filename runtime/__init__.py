"""SpecOffload runtime: model executors, KV cache, speculative verification and the in-process Engine.

Never imports Ray: everything here runs and is tested in one process. The public names below are loaded
lazily (PEP 562), so importing one submodule does not pull in the executors.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EngineConfig": ".config",
    "Engine": ".engine",
    "GenerateStats": ".stats",
    "PromptError": ".engine",
    "EngineBusyError": ".turns",
    "VocabularyMismatchError": ".engine",
    "CheckpointError": ".models.errors",
    "SpecOffloadError": "specoffload.planner.errors",
    "UnsupportedModelError": ".models.errors",
    "GenerationResult": ".request",
    "LLM": ".llm",
    "CompletionOutput": ".outputs",
    "Logprob": ".outputs",
    "RequestMetrics": ".outputs",
    "RequestOutput": ".outputs",
    "SamplingParams": ".sampling",
}

__all__ = [
    "LLM",
    "CheckpointError",
    "CompletionOutput",
    "Engine",
    "EngineBusyError",
    "EngineConfig",
    "GenerateStats",
    "GenerationResult",
    "Logprob",
    "PromptError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpecOffloadError",
    "UnsupportedModelError",
    "VocabularyMismatchError",
]

if TYPE_CHECKING:
    from specoffload.planner.errors import SpecOffloadError

    from .config import EngineConfig
    from .engine import Engine, PromptError, VocabularyMismatchError
    from .llm import LLM
    from .models.errors import CheckpointError, UnsupportedModelError
    from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from .request import GenerationResult
    from .sampling import SamplingParams
    from .stats import GenerateStats
    from .turns import EngineBusyError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)  # relative or absolute module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
