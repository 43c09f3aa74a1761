"""File identity for provenance and resume: the SHA-256 of a file, the record that identifies a checkpoint a
builder read (`specoffload quantize`, scripts/make_moe.py), and the check of a checkpoint's files against the
hashes its provenance.json records (`check_recorded_hashes`, run whenever a checkpoint is opened).

A verified file is remembered in VERIFIED_CACHE by (path, size, mtime, inode), so a checkpoint of many GB is hashed
once, not at every start; any write to a file (a swap, an edit) changes that key and the file is hashed again.
`SPECOFFLOAD_SKIP_HASH_CHECK=1` skips the check (and says so once).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from .models.errors import CheckpointError

PROVENANCE = "provenance.json"  # a built checkpoint's record of where it came from
HASHES = "safetensors_sha256"  # provenance key: {file name: hex SHA-256} of the checkpoint's own files
QUANT_HASH = "quantization_sha256"  # provenance key: hex SHA-256 of a compressed checkpoint's quantization.json
SKIP_HASH_ENV = "SPECOFFLOAD_SKIP_HASH_CHECK"
VERIFIED_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specoffload" / "verified.json"

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_warned_skip = False


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


def check_recorded_hashes(directory: str | Path) -> None:
    """Compare each file that `directory`'s provenance.json lists under HASHES (and a compressed checkpoint's
    quantization.json, under QUANT_HASH) with its recorded SHA-256; raise
    CheckpointError naming the first file that differs or is missing. Nothing to do without such a record."""
    global _warned_skip
    d = Path(directory)
    try:
        record = json.loads((d / PROVENANCE).read_text())
    except (OSError, ValueError):
        return
    hashes = record.get(HASHES) if isinstance(record, dict) else None
    if not isinstance(hashes, dict) or not hashes:
        return
    if isinstance(record.get(QUANT_HASH), str):  # a compressed checkpoint's manifest (logical shapes and dtypes)
        hashes = {**hashes, "quantization.json": record[QUANT_HASH]}
    if os.environ.get(SKIP_HASH_ENV, "") not in ("", "0"):
        if not _warned_skip:
            logger.warning("%s is set: checkpoint files are not checked against their recorded SHA-256", SKIP_HASH_ENV)
            _warned_skip = True
        return
    cache = _read_cache()
    changed = False
    for name, want in sorted(hashes.items()):
        path = d / str(name)
        if Path(str(name)).name != name or not path.is_file():
            raise CheckpointError(f"checkpoint {d}: {name!s:.80} is listed in {PROVENANCE} but missing")
        st = path.stat()
        key = str(path.resolve())
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        if cache.get(key) == [*stamp, want]:
            continue
        got = sha256_file(path)
        if got != want:
            raise CheckpointError(f"checkpoint file {path} does not match the SHA-256 its {PROVENANCE} records "
                                  f"({got[:12]}... != {str(want)[:12]}...): it changed after it was built; rebuild "
                                  f"it (or set {SKIP_HASH_ENV}=1 to run it anyway)")
        cache[key] = [*stamp, want]
        changed = True
    if changed:
        _write_cache(cache)


def _read_cache() -> dict[str, list]:
    try:
        value = json.loads(VERIFIED_CACHE.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_cache(cache: dict[str, list]) -> None:
    """Write the verified-file cache atomically (best effort: a read-only home only costs a re-hash later)."""
    with _lock, contextlib.suppress(OSError):
        VERIFIED_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = VERIFIED_CACHE.with_name(f".{VERIFIED_CACHE.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(dict(list(cache.items())[-4096:])))
        os.replace(tmp, VERIFIED_CACHE)
