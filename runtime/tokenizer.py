"""Tokenizer loading from a checkpoint directory (optional: tiny test models have none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(path: str | Path) -> Any | None:
    """Return the checkpoint's transformers tokenizer, or None if the directory ships none."""
    path = Path(path)
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
