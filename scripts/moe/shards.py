"""Streamed safetensors shards, the shard index, and provenance.json.

A shard is written tensor by tensor straight from its source buffer, so an upcycled layer that holds the same
FFN eight times never has eight copies in memory: each copy is a separate byte range in the file (no
deduplication), written from the one tensor. Files appear under a temporary name and are renamed when whole.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specoffload.runtime.hashing import PROVENANCE, sha256_file, source_record  # noqa: F401 (re-exported)

INDEX_FILE = "model.safetensors.index.json"
#: provenance key of {file name: SHA-256} of the shards and index, as scripts/get_models.py's hash check reads it
HASHES = "safetensors_sha256"
#: files copied from the dense checkpoint as they are (tokenizer, chat template, generation config)
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)

_DTYPE_NAME = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def write_shard(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> tuple[int, str]:
    """Write `(name, tensor)` pairs as one safetensors file (names may share data); return (bytes, SHA-256).

    Layout: 8-byte little-endian header length, JSON header (space-padded to 8 bytes), then the tensors'
    raw little-endian bytes back to back in the given order. The file is fsynced before the rename, so the
    dirty pages of an 18 GB build never pile up in RAM.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors:
        if name in header:
            raise ValueError(f"tensor {name!r} written twice to {path.name}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPE_NAME[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        for block in (len(blob).to_bytes(8, "little"), blob):
            f.write(block)
            digest.update(block)
        for _, tensor in tensors:
            if tensor.numel():
                data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().data
                f.write(data)
                digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return 8 + len(blob) + offset, digest.hexdigest()


@dataclass
class ShardedWriter:
    """Writes shards `model-00001-of-NNNNN.safetensors` into `out_dir` and, on `finish`, the index."""

    out_dir: Path
    num_shards: int
    weight_map: dict[str, str] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)  # file name -> SHA-256, the index included
    total_bytes: int = 0
    _written: int = 0

    def add(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._written += 1
        if self._written > self.num_shards:
            raise ValueError(f"more than the {self.num_shards} announced shards")
        name = f"model-{self._written:05d}-of-{self.num_shards:05d}.safetensors"
        nbytes, self.sha256[name] = write_shard(self.out_dir / name, tensors)
        self.total_bytes += nbytes
        self.weight_map |= {tensor_name: name for tensor_name, _ in tensors}

    def finish(self) -> None:
        if self._written != self.num_shards:
            raise ValueError(f"wrote {self._written} of {self.num_shards} shards")
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self.sha256[INDEX_FILE] = sha256_file(self.out_dir / INDEX_FILE)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer and generation files the dense checkpoint has; return their names."""
    copied = [name for name in SIDE_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, dst / name)
    return copied


def write_provenance(out_dir: Path, record: dict[str, object]) -> None:
    """Write provenance.json: the builder's record plus the date and the library versions."""
    import transformers

    stamp = {
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    (out_dir / PROVENANCE).write_text(json.dumps(record | stamp, indent=2) + "\n")

