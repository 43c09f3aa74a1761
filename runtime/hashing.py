"""File identity for provenance and resume: the SHA-256 of a file, and the record that identifies a checkpoint a
builder read (`specoffload quantize`, scripts/make_moe.py)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

PROVENANCE = "provenance.json"  # a built checkpoint's record of where it came from


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    """Hex SHA-256 of a file; cached per (path, size, mtime), since a build and its checks hash a source often."""
    stat = Path(path).stat()
    return _sha256(str(path), stat.st_size, stat.st_mtime_ns, chunk)


@functools.lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int, chunk: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def source_record(directory: Path) -> dict[str, object]:
    """What identifies a source checkpoint: the SHA-256 of its config and weight files, and its own provenance."""
    files = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    record: dict[str, object] = {"dir": str(directory), "sha256": {p.name: sha256_file(p) for p in files}}
    if (directory / PROVENANCE).is_file():
        record["provenance"] = json.loads((directory / PROVENANCE).read_text())
    return record
