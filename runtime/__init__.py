"""SpecOffload runtime: model executors, KV cache, speculative verification and the in-process Engine.

Never imports Ray: everything here runs and is tested in one process.
"""

from .config import EngineConfig
from .engine import Engine, GenerateStats, PromptError, VocabularyMismatchError
from .models.errors import CheckpointError, SpecOffloadError, UnsupportedModelError
from .request import GenerationResult
from .sampling import SamplingParams

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
