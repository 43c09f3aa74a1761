"""`Checkpoint`: lazy, validated access to the tensors of a Hugging Face safetensors checkpoint directory.

Construction reads only the safetensors headers (a few KB per file, at most `MAX_HEADER_BYTES`) and checks every
entry (known dtype, integer shape, byte range inside the file's data and overlapping no other tensor's, size
matching dtype x shape), so a truncated or corrupt file fails at open time with the file named, not in the middle
of a run, and the byte ranges `file_of` hands to direct reads are exactly the tensors' data. Tensor data is read on
`get`. `file_of` gives the byte range of a tensor (or of one row of its first dimension, e.g. one
expert of a fused `[experts, ...]` tensor) inside its file, for direct reads that bypass safetensors.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..formats import COMPONENTS, WeightFormat, dequantize_into
from ..hashing import check_recorded_hashes
from ..json_bounds import JsonBounds, loads_bounded
from .errors import CheckpointError
from .gguf import GGUFTable, read_pointer
from .quantized import QUANT_FILE, QuantManifest, check_components, read_manifest

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: the largest safetensors JSON header read (the safetensors library's own limit)
MAX_HEADER_BYTES = 100_000_000
#: a header (and an index) is {name: {dtype, shape: [...], data_offsets: [...]}}: 3 levels; offsets < 2**64
HEADER_BOUNDS = JsonBounds(max_depth=4, max_digits=24, max_items=1 << 26)

_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip

_TORCH_DTYPE = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's raw little-endian data lies: `length` bytes at byte `offset` of file `path`."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`
    length: int


@dataclass(frozen=True)
class QuantComponent:
    """One stored component of a compressed weight (or of its row `index`): where it lies, its dtype and shape."""

    suffix: str  # "qweight" | "scale" | "zero"
    location: TensorLocation
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class QuantRef:
    """A compressed weight as the streamer reads it: its scheme and its components, in file order."""

    spec: WeightFormat
    components: tuple[QuantComponent, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.location.length for c in self.components)


class Checkpoint:
    """Read-only view of the safetensors tensors in an HF checkpoint directory (single file or sharded)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {self.path}")
        self._entries: dict[str, _Entry] = {}
        self._handles: dict[Path, Any] = {}
        self._fds: dict[Path, int] = {}
        #: a compressed weight's components, format, and logical (shape, dtype), by the weight's name
        self._quant: dict[str, dict[str, _Entry]] = {}
        self._qspec: dict[str, WeightFormat] = {}
        self._qlogical: dict[str, tuple[tuple[int, ...], str]] = {}
        #: the GGUF file a companion directory stands for (models/gguf.py), read in place; else None
        table = read_pointer(self.path)
        self.gguf: Path | None = table.file if table is not None else None
        #: the compression manifest of a `specoffload quantize` checkpoint (models/quantized.py), else None
        self.quantization: QuantManifest | None = None
        if table is not None:
            self._open_gguf(table)
            return
        check_recorded_hashes(self.path)  # the files its provenance.json records, when it records them
        for file in self._files():
            for name, entry in _read_header(file).items():
                self._entries.setdefault(name, entry)
        self.quantization = read_manifest(self.path)
        self._open_quantized()
        self._check_scales()

    def names(self) -> list[str]:
        """Every weight's name; a compressed weight under its own name (its components are not listed)."""
        hidden = {f"{n}.{c}" for n in self._quant for c in COMPONENTS}
        return sorted((set(self._entries) - hidden) | set(self._quant))

    def has(self, name: str) -> bool:
        return name in self._entries or name in self._quant

    def quantized(self, name: str, index: int | None = None) -> QuantRef | None:
        """A compressed weight's scheme and components (of its row `index` of the first dimension if given), or
        None for a weight stored as is."""
        parts = self._quant.get(name)
        if parts is None:
            return None
        if index is not None:
            self._check_index(name, self._entry(name), index)
        components = []
        for suffix in COMPONENTS:
            entry = parts.get(suffix)
            if entry is None:
                continue
            location = TensorLocation(str(entry.file), entry.offset, entry.length)
            shape = entry.shape
            if index is not None:
                row = entry.length // entry.shape[0]
                location = TensorLocation(location.path, entry.offset + index * row, row)
                shape = shape[1:]
            components.append(QuantComponent(suffix, location, _TORCH_DTYPE[entry.dtype], shape))
        return QuantRef(self._qspec[name], tuple(components))

    __contains__ = has

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def shape_of(self, name: str, index: int | None = None) -> tuple[int, ...]:
        """Shape of the tensor, or of its row `index` along the first dimension (the shape without that dim)."""
        entry = self._entry(name)
        if index is None:
            return entry.shape
        self._check_index(name, entry, index)
        return entry.shape[1:]

    def torch_dtype(self, name: str) -> torch.dtype:
        """The torch dtype of the tensor's data in the file (from the safetensors dtype string, e.g. "BF16")."""
        entry = self._entry(name)
        try:
            return _TORCH_DTYPE[entry.dtype]
        except KeyError:
            raise CheckpointError(
                f"tensor {name!r} in {entry.file} has dtype {entry.dtype!r}, which this runtime cannot read; "
                f"convert the checkpoint to one of {sorted(_TORCH_DTYPE)}"
            ) from None

    def nbytes(self, name: str, index: int | None = None) -> int:
        """Bytes of the tensor in the file (of row `index` of its first dimension if given); a compressed weight's
        stored bytes (codes, scales and zero points)."""
        ref = self.quantized(name, index)
        return ref.nbytes if ref is not None else self.file_of(name, index).length

    def numel(self, name: str, index: int | None = None) -> int:
        shape = self._entry(name).shape
        return math.prod(shape[1:] if index is not None else shape)

    def file_of(self, name: str, index: int | None = None) -> TensorLocation:
        """Byte range of the tensor's data, or of its row `index` along the first (outermost) dimension."""
        entry = self._entry(name)
        if name in self._quant:
            raise CheckpointError(f"tensor {name!r} of {self.path} is compressed: read it with `quantized` or `get`")
        if index is None:
            return TensorLocation(str(entry.file), entry.offset, entry.length)
        rows = self._check_index(name, entry, index)
        row_bytes = entry.length // rows
        return TensorLocation(str(entry.file), entry.offset + index * row_bytes, row_bytes)

    def get(
        self,
        name: str,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        index: int | None = None,
    ) -> torch.Tensor:
        """Read a tensor (only its row `index` of the first dimension if given), cast to `dtype`, on `device`.
        A compressed weight is dequantized (into `dtype`; float32 if None)."""
        entry = self._entry(name)
        if name in self._quant:
            spec = self._qspec[name]
            dest = torch.empty(self.shape_of(name, index), dtype=dtype or torch.float32, device=device)
            return dequantize_into(dest, self.stored_parts(name, index, device), spec)
        if self.gguf is not None:
            tensor = self._read_raw(name, entry, index)
            return tensor.to(device=device, dtype=dtype or tensor.dtype)
        try:
            handle = self._handle(entry.file)
            if index is None:
                tensor = handle.get_tensor(name)
            else:
                self._check_index(name, entry, index)
                tensor = handle.get_slice(name)[index]
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read tensor {name!r} from {entry.file}: {exc}") from exc
        return tensor.to(device=device, dtype=dtype or tensor.dtype)

    def stored_parts(self, name: str, index: int | None = None,
                     device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """A compressed weight's components (of its row `index` if given) as stored, checked by its format
        (`WeightFormat.check_parts`: a damaged one fails naming tensor and file): suffix -> tensor."""
        ref = self.quantized(name, index)
        if ref is None:
            raise CheckpointError(f"tensor {name!r} of {self.path} is not compressed: read it with `get`")
        parts = {c.suffix: self.get(f"{name}.{c.suffix}", None, device, index) for c in ref.components}
        self._check_parts(name, ref.spec, parts)
        return parts

    def entry(self, name: str) -> _Entry:
        """The validated header entry of a tensor (file, safetensors dtype string, shape, byte range)."""
        return self._entry(name)

    def data_bytes(self) -> int:
        """Bytes of tensor data all the checkpoint's tensors hold (from their headers)."""
        return sum(e.length for e in self._entries.values())

    def _entry(self, name: str) -> _Entry:
        """The header entry of a stored tensor; of a compressed weight, its logical entry (shape and dtype as
        before compression, located at its codes)."""
        parts = self._quant.get(name)
        if parts is not None:
            shape, dtype = self._qlogical[name]
            q = parts["qweight"]
            return _Entry(q.file, dtype, shape, q.offset, sum(e.length for e in parts.values()))
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}") from None

    def _open_gguf(self, table: GGUFTable) -> None:
        """The GGUF's tensors (models/gguf.py `GGUFTable`, checked there): plain ones as entries, block ones as
        compressed weights of their GGML format with one component, the blocks as stored."""
        file = table.file
        for name, t in table.tensors.items():
            if t.fmt is None:
                self._entries[name] = _Entry(file, t.dtype, t.shape, t.offset, t.length)
                continue
            blocks = _Entry(file, "U8", t.byte_shape, t.offset, t.length)
            self._entries[f"{name}.qweight"] = blocks
            self._quant[name], self._qspec[name], self._qlogical[name] = {"qweight": blocks}, t.fmt, (t.shape, "F32")

    def _read_raw(self, name: str, entry: _Entry, index: int | None) -> torch.Tensor:
        """A tensor (or its row `index`) read from its byte range (a GGUF's: no safetensors handle)."""
        offset, length, shape = entry.offset, entry.length, entry.shape
        if index is not None:
            rows = self._check_index(name, entry, index)
            length //= rows
            offset, shape = offset + index * length, shape[1:]
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise CheckpointError(f"truncated {entry.file}: {name} needs bytes {offset}..{offset + length}")
        return torch.frombuffer(bytearray(data), dtype=_TORCH_DTYPE[entry.dtype]).reshape(shape)

    def _open_quantized(self) -> None:
        """Each compressed weight's component entries, checked against the manifest's scheme (models/quantized.py).
        A checkpoint with compressed components and no manifest is refused."""
        manifest = self.quantization
        if manifest is None:
            orphan = next((n for n in self._entries if n.endswith(".qweight")), None)
            if orphan is not None:
                raise CheckpointError(f"{self.path} holds compressed tensors ({orphan}) but no {QUANT_FILE}; "
                                      "re-run `specoffload quantize`")
            return
        for name in manifest.tensors:
            if name in self._entries:
                raise CheckpointError(f"compressed checkpoint {self.path}: {name} is stored both as is and compressed")
            parts = {c: self._entries[f"{name}.{c}"] for c in COMPONENTS if f"{name}.{c}" in self._entries}
            check_components(manifest, name, {c: (e.dtype, e.shape) for c, e in parts.items()} |
                             {c: None for c in COMPONENTS if c not in parts}, self.path)
            files = {e.file for e in parts.values()}
            if len(files) > 1:
                raise CheckpointError(f"compressed checkpoint {self.path}: the components of {name} are split over "
                                      f"{len(files)} files")
            self._quant[name], self._qspec[name], self._qlogical[name] = parts, manifest.spec, manifest.tensors[name]

    def _check_scales(self) -> None:
        """Every compressed weight's small components (scale, zero point) read and checked by its format (finite,
        in range: `WeightFormat.check_parts`), so a damaged one fails here in one line naming tensor and file;
        the codes are checked where they are first read (`get`, the streamer)."""
        for name, parts in self._quant.items():
            small = {c: self.get(f"{name}.{c}") for c in parts if c != "qweight"}
            self._check_parts(name, self._qspec[name], small)

    def _check_parts(self, name: str, spec: WeightFormat, parts: dict[str, torch.Tensor]) -> None:
        problem = spec.check_parts(parts)
        if problem is not None:
            file = self._quant[name]["qweight"].file
            fix = "the GGUF file is damaged" if self.gguf is not None else "re-run `specoffload quantize`"
            raise CheckpointError(f"compressed checkpoint {file}: {name}: {problem}; {fix}")

    def _check_index(self, name: str, entry: _Entry, index: int) -> int:
        rows = entry.shape[0] if entry.shape else 0
        if not 0 <= index < rows:
            raise IndexError(f"row {index} out of range for {name!r} of shape {entry.shape}")
        return rows

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def _files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            return _shards_from_index(index)
        if (self.path / SINGLE_FILE).is_file():
            return [self.path / SINGLE_FILE]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors files ({SINGLE_FILE} or {INDEX_FILE}) in {self.path}")
        return files


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = loads_bounded(index.read_bytes(), HEADER_BOUNDS)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"corrupt index file {index}: {exc}") from exc
    files = [index.parent / shard for shard in shards]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"shard {file.name} named by {index} is missing")
    return files


def _read_header(file: Path) -> dict[str, _Entry]:
    """Parse and validate a safetensors header: 8-byte little-endian length, then JSON, then the data."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"truncated or corrupt safetensors file {file}: {size} bytes")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"corrupt safetensors file {file}: its header claims {header_len} bytes, "
                    f"over the {MAX_HEADER_BYTES}-byte limit"
                )
            if header_len > size - 8:
                raise CheckpointError(
                    f"truncated or corrupt safetensors file {file}: header of {header_len} bytes "
                    f"but the file has {size} bytes"
                )
            header = loads_bounded(f.read(header_len), HEADER_BOUNDS)  # depth and numbers checked before parsing
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    except ValueError as exc:  # BoundsError, JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"corrupt safetensors header in {file}: {exc}") from exc
    if type(header) is not dict:
        raise CheckpointError(f"corrupt safetensors header in {file}: not a JSON object")
    data_start = 8 + header_len
    entries = {name: _entry(file, name, info, data_start) for name, info in header.items() if name != "__metadata__"}
    spans = sorted((e.offset, e.offset + e.length, name) for name, e in entries.items())
    for (_, end, before), (begin, _, name) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"corrupt safetensors header in {file}: tensors {before!r} and {name!r} overlap")
    data_end = max((end for _, end, _ in spans), default=data_start)
    if data_end > size:
        raise CheckpointError(
            f"truncated safetensors file {file}: tensor data ends at byte {data_end} but the file has {size} bytes"
        )
    return entries


def _entry(file: Path, name: str, info: Any, data_start: int) -> _Entry:
    """One validated header entry: known dtype, non-negative integer shape, data range [begin, end) with
    0 <= begin <= end and end - begin = numel x itemsize (the file's size is checked by the caller)."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"corrupt safetensors header in {file}: tensor {name!r:.80} {what}")

    if type(info) is not dict:
        raise bad("has no entry object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise bad(f"has dtype {dtype!r:.40}, which this runtime cannot read (known: {', '.join(_ITEMSIZE)})")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"has shape {shape!r:.80}, not a list of non-negative integers")
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise bad(f"has data_offsets {offsets!r:.80}, not two integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise bad(f"has data_offsets [{begin}, {end}]: negative or reversed")
    if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
        raise bad(f"has {end - begin} bytes of data, but {dtype} x {shape} needs {math.prod(shape) * _ITEMSIZE[dtype]}")
    return _Entry(file, dtype, tuple(shape), data_start + begin, end - begin)
