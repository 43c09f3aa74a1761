"""The manifest beside an output (`out.jsonl.manifest.json`): what the rows were written by.

`--resume` continues an output only if every compared field equals this run's: the input's content (SHA-256),
format and line limit, the checkpoints' identity (from their provenance), the SHA-256 of every file beside the
weights that changes a row (`ROW_FILES`: config.json, generation_config.json, the tokenizer files and chat template,
of target and draft), the engine options that can change a row (dtypes of target and draft, the drafter and its
options, k, batch, the max lengths), the sampling defaults, the chunk size, and the manifest's format version. The
first field that differs is named in one line (nested fields by their path, e.g. `files.target.config.json`).
`info` (paths, version, time) is for the reader and is not compared: moving the input or the models is fine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..hashing import HASHES, sha256_file
from ..models.gguf import read_pointer

FORMAT_VERSION = 2
#: files of a checkpoint directory, besides its weights, whose content can change a row (hashed when present)
ROW_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
             "merges.txt", "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
             "chat_template.json")
#: provenance.json key with {file name: SHA-256} of a converted checkpoint (scripts/get_models.py writes it)
PROVENANCE_HASHES = HASHES


class ManifestError(ValueError):
    """A manifest that is missing, unreadable, or written for another job."""


@dataclass(frozen=True)
class Manifest:
    input: dict[str, Any]  # sha256, rows, format, max_line_bytes
    models: dict[str, Any]  # target, draft: checkpoint identities (their weights)
    engine: dict[str, Any]  # dtype, draft_dtype, drafter (+ its options), num_draft_tokens, max_batch_size, lengths
    sampling: dict[str, Any]  # the command line's SamplingParams (rows may override some)
    chunk_size: int
    files: dict[str, Any] = field(default_factory=dict)  # target, draft: {ROW_FILES name: SHA-256}
    format_version: int = FORMAT_VERSION
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def compared(self) -> dict[str, Any]:
        """Every compared field as "section.key" -> value, format version first."""
        flat: dict[str, Any] = {"format_version": self.format_version}
        for section in ("input", "models", "files", "engine", "sampling"):
            flat |= _flatten(section, getattr(self, section))
        return flat | {"chunk_size": self.chunk_size}

    def first_difference(self, written: Manifest) -> str | None:
        """'<field>: <written> in the output's manifest, <this> now' for the first field that differs."""
        mine, theirs = self.compared(), written.compared()
        for key in [*theirs, *(k for k in mine if k not in theirs)]:
            if _norm(mine.get(key)) != _norm(theirs.get(key)):
                return f"{key}: {theirs.get(key)!r} in the output's manifest, {mine.get(key)!r} now"
        return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(f"format_version {version!r}, this specoffload writes {FORMAT_VERSION} (which also "
                                "records the checkpoints' config, tokenizer and drafter: an older output cannot be "
                                "checked against them)")
        return cls(input=dict(data["input"]), models=dict(data["models"]), engine=dict(data["engine"]),
                   sampling=dict(data["sampling"]), chunk_size=int(data["chunk_size"]), files=dict(data["files"]),
                   format_version=version, info=dict(data.get("info", {})))


def _flatten(prefix: str, value: dict[str, Any]) -> dict[str, Any]:
    """{"a": {"b": 1}} under "s" -> {"s.a.b": 1} (a nested field is compared, and named, on its own)."""
    flat: dict[str, Any] = {}
    for key, v in value.items():
        if isinstance(v, dict):
            flat |= _flatten(f"{prefix}.{key}", v)
        else:
            flat[f"{prefix}.{key}"] = v
    return flat


def row_files(directory: str | Path | None) -> dict[str, str] | None:
    """{name: SHA-256} of the `ROW_FILES` present in a checkpoint directory (None: no such checkpoint)."""
    if directory is None or not Path(directory).is_dir():
        return None
    out: dict[str, str] = {}
    for name in ROW_FILES:
        path = Path(directory) / name
        if path.is_file():
            out[name] = sha256_file(path)
    return out


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value  # JSON has lists only


def manifest_path(output: Path) -> Path:
    return output.with_name(output.name + ".manifest.json")


def read_manifest(path: Path) -> Manifest:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path} is missing: nothing says what the rows beside it were written by; "
                            "use another --output, or --overwrite") from None
    except OSError as err:
        raise ManifestError(f"cannot read {path}: {err.strerror}") from None
    try:
        return Manifest.from_json(text)
    except ManifestError as err:
        raise ManifestError(f"{path}: {err}; use another --output, or --overwrite") from None
    except (ValueError, KeyError, TypeError):
        raise ManifestError(f"{path} is not a specoffload manifest; use another --output, or --overwrite") from None


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write atomically (a temporary file renamed over it); the temporary file never outlives an error."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # disk full, read-only: name the file (a write error carries no file name)
        raise OSError(err.errno, f"cannot write {path}: {err.strerror}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def checkpoint_identity(directory: str | Path | None) -> str | None:
    """What identifies a checkpoint's weights: the SHA-256 of the GGUF file a GGUF's companion directory stands for;
    the SHA-256 of its safetensors files recorded in its provenance.json, else the pinned GGUF it was converted
    from (and the dtype), else the SHA-256 of the files themselves."""
    if directory is None:
        return None
    d = Path(directory)
    table = read_pointer(d)
    if table is not None:  # a GGUF run in place (runtime/models/gguf.py): the file itself
        return f"gguf-sha256:{sha256_file(table.file)}"
    try:
        record = json.loads((d / "provenance.json").read_text())
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict):
        hashes = record.get(PROVENANCE_HASHES)
        if isinstance(hashes, dict) and hashes:
            return "safetensors-sha256:" + hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
        if isinstance(record.get("gguf_sha256"), str):
            return f"gguf-sha256:{record['gguf_sha256']}:{record.get('dtype')}"
    digest = hashlib.sha256()
    for path in sorted([*d.glob("*.safetensors"), *d.glob("*.safetensors.index.json")]):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return "files-sha256:" + digest.hexdigest()
