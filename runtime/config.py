"""User-facing engine configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .models.errors import SpecOffloadError

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ConfigError(SpecOffloadError, ValueError):
    """An invalid EngineConfig field."""


@dataclass(frozen=True)
class EngineConfig:
    """What to run and how.

    target: HF checkpoint directory of the model whose output we reproduce.
    draft: checkpoint directory of a small model on the same vocabulary, or None for plain decoding.
    num_draft_tokens: k, tokens the draft proposes per verification step (>= 1; unused without a draft).
    max_batch_size: rows decoded together; finished rows are refilled from waiting prompts.
    num_threads: torch intra-op threads (None: leave torch's default, one per core).
    """

    target: str | Path
    draft: str | Path | None = None
    dtype: str = "float32"
    num_draft_tokens: int = 4
    max_batch_size: int = 16
    device: str = "cpu"
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens (k) must be an integer >= 1, got {self.num_draft_tokens!r}")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads!r}")
        if self.device != "cpu" and not torch.device(self.device).type == "cuda":
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
