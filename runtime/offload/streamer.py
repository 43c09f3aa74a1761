"""`WeightStreamer`: loads the streamed parts of a model into a ring of preallocated device buffers ("slots").

A slot is one uint8 device tensor of `slot_bytes`. `load(slot, keys)` lays the parts out back to back in the slot
(every tensor at a `TENSOR_ALIGN`-aligned byte offset, in the compute dtype), fills them from the source tier and
returns each part's `Weights` dataclass built by `WeightLoader.assemble` over views into the slot, so streamed and
resident weights are the same objects to the compute code. Nothing is allocated per load.

Source tiers:
  "disk"  raw bytes are read from the safetensors files with `DirectReader` (O_DIRECT), tensors that are close in a
          file coalesced into one read of up to `staging_bytes`, then converted to the compute dtype into the slot.
  "ram"   at construction the streamable `parts` are read once into host memory in the compute dtype (pinned on
          CUDA), laid out per part exactly as in a slot, so a load is one memcpy per part.

On CUDA all copies are issued on a dedicated copy stream with `non_blocking=True`; the streamer's `SlotSync`
(slot_sync.py, shared with the workers that read the slots) makes the copy stream wait for the slot's last readers
before a load and records the load's event, which a reader's stream waits on before it reads. From disk, the raw
file bytes go host->device first (in the file dtype,
e.g. float16: half the PCIe bytes of float32) into a device scratch buffer, and are converted on the device; two
pinned staging buffers let the read of one chunk overlap the transfer of the previous one. On CPU the conversion
runs in the calling thread and reads straight from the staging buffer (float16 into a bfloat16 slot through small
float32 blocks, 3x faster than torch's direct conversion: runtime/cast.py), while one reader thread reads the next
chunk into the other staging buffer.

Compressed checkpoints (`specoffload quantize`, runtime/quant.py): a compressed weight's stored bytes (codes,
scales, zero points) are read from disk into a packed scratch buffer, or kept as such in the host tier, and
`dequantize_into` writes the weight into its place in the slot in the compute dtype, on the loading thread (a
"decompress" span; `decompress_seconds`). Only the streamed bytes shrink: a slot holds the same compute-dtype
weights either way, except with `packed` (weights a torch kernel multiplies as codes, runtime/models/packed.py:
int8 ones whose width the kernel takes, int4 ones of whole kernel blocks): then the codes stay in the slot beside
their scales in the compute dtype (int8: read straight into their place; int4: permuted there from the scratch,
the format's `fill_packed`), and the layer multiplies by them (`PackedInt8`, `PackedInt4`); the slot shrinks with
the stream, and nothing is dequantized.
In the host tier a part is laid out by `FieldLayout.host_offset` (compute-dtype fields as in a slot, compressed
ones as their components); a part without compressed fields is laid out exactly as in a slot.

Threading: `load` may run in a dedicated io thread (calls are serialised by a lock); the caller guarantees that a
slot being reloaded is no longer in use (on CUDA: calls `sync.after_use(slot)` after queueing its last use).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import torch

from ..cast import copy_cast
from ..formats import dequantize_into
from ..models.checkpoint import QuantRef, TensorLocation
from ..models.errors import CheckpointError
from ..models.packed import PackedWeight, stays_packed
from ..models.weights import PartKey, TensorRef, WeightLoader, Weights
from .direct_io import ALIGN, AlignedBuffer, DirectReader, align_up
from .slot_sync import SlotSync, slot_sync

TENSOR_ALIGN = 64  # bytes: start of every tensor in a slot (and in the host tier)
SOURCES = ("disk", "ram")


@dataclass(frozen=True)
class FieldLayout:
    """One tensor of a part: where its bytes are in the file and where it goes in the part's region of a slot."""

    field: str
    ref: TensorRef
    location: TensorLocation  # the raw bytes in the checkpoint (file dtype)
    file_dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset in the part's region, TENSOR_ALIGN-aligned
    nbytes: int  # bytes in the compute dtype
    quant: QuantRef | None = None  # a compressed weight: its components (location unused)
    host_offset: int = 0  # byte offset in the part's region of the host tier / packed scratch, TENSOR_ALIGN-aligned
    host_nbytes: int = 0  # bytes there: nbytes, or the compressed components' (each TENSOR_ALIGN-aligned)
    packed: bool = False  # a weight kept packed in the slot: its codes, then its scales (its format's packed_view)

    def component_offsets(self) -> list[int]:
        """Byte offset of each compressed component relative to `host_offset`."""
        out, at = [], 0
        for c in self.quant.components if self.quant is not None else ():
            out.append(at)
            at = align_up(at + c.location.length, TENSOR_ALIGN)
        return out


@dataclass(frozen=True)
class PartLayout:
    fields: tuple[FieldLayout, ...]
    nbytes: int  # bytes the part takes in a slot, a multiple of TENSOR_ALIGN
    host_nbytes: int = 0  # bytes the part takes in the host tier (its compressed fields compressed)
    stored_nbytes: int = 0  # bytes of its compressed fields' components (0: none compressed)

    @property
    def compressed(self) -> bool:
        return any(f.quant is not None for f in self.fields)


@dataclass(frozen=True, eq=False)
class Piece:
    """`length` bytes at `offset` of file `path` (in `file_dtype`), to be converted into the elements of `dest`."""

    path: str
    offset: int
    length: int
    file_dtype: torch.dtype
    dest: torch.Tensor  # [length // file_dtype.itemsize], compute dtype, flat view into a slot or the host tier
    tensor: str = ""  # the checkpoint tensor these bytes belong to (named in errors)

    @property
    def end(self) -> int:
        return self.offset + self.length


def coalesce(pieces: Sequence[Piece], max_span: int, max_gap: int) -> list[list[Piece]]:
    """Group pieces into reads: same file, sorted by offset, gaps of at most `max_gap` bytes read through, each
    read's ALIGN-aligned span at most `max_span` bytes (a piece must fit alone: see `split_pieces`)."""
    groups: list[list[Piece]] = []
    start = end = 0
    for piece in sorted(pieces, key=lambda p: (p.path, p.offset)):
        last = groups[-1][-1] if groups else None
        fits = align_up(max(end, piece.end)) - start // ALIGN * ALIGN <= max_span
        if last is not None and last.path == piece.path and piece.offset - end <= max_gap and fits:
            groups[-1].append(piece)
            end = max(end, piece.end)
        else:
            groups.append([piece])
            start, end = piece.offset, piece.end
    return groups


def split_pieces(field: FieldLayout, dest: torch.Tensor, max_piece: int) -> Iterator[Piece]:
    """Cut a tensor's file bytes into pieces of at most `max_piece` bytes (a multiple of TENSOR_ALIGN, hence of
    the item size) with the matching ranges of `dest` (flat, compute dtype)."""
    return split_range(field.location, field.file_dtype, dest, max_piece, field.ref.name)


def split_range(loc: TensorLocation, file_dtype: torch.dtype, dest: torch.Tensor, max_piece: int,
                tensor: str = "") -> Iterator[Piece]:
    """`split_pieces` for any byte range: of a tensor, or of a compressed weight's component (uint8 into uint8)."""
    itemsize = file_dtype.itemsize
    for begin in range(0, loc.length, max_piece):
        length = min(max_piece, loc.length - begin)
        elems = dest[begin // itemsize : (begin + length) // itemsize]
        yield Piece(loc.path, loc.offset + begin, length, file_dtype, elems, tensor)


class WeightStreamer:
    """Loads the streamed parts of a model into one of `num_slots` preallocated device buffers ("slots").

    `source` is "disk" or "ram" (see the module docstring); `parts` are the parts that may be streamed (required
    for "ram", which preloads them); `tracer`, if given, has `span(name, resource, **args)` returning a context
    manager. `bytes_read` counts bytes moved from the source tier by `load` (file bytes including alignment padding
    and coalesced gaps for "disk", host bytes for "ram"); `read_seconds` and `copy_seconds` the host time spent
    reading and copying/converting (on CUDA copies are asynchronous: only their issue time). `reader` is the
    `DirectReader` (its `mode` and `reads` are worth reporting). `direct=False` forces buffered reads; `max_gap` is
    the largest hole between two tensors of a file that is read through to merge their reads.
    """

    def __init__(
        self,
        loader: WeightLoader,
        slot_bytes: int,
        num_slots: int,
        source: str,
        device: str | torch.device,
        staging_bytes: int = 64 << 20,
        parts: Sequence[PartKey] | None = None,
        tracer: Any = None,
        direct: bool = True,
        max_gap: int = 64 << 10,
        slots: Sequence[torch.Tensor] | None = None,
        sync: SlotSync | None = None,
        packed: bool = False,
    ) -> None:
        if source not in SOURCES:
            raise ValueError(f"unknown weight source {source!r}; expected one of {SOURCES}")
        if source == "ram" and parts is None:
            raise ValueError('source "ram" preloads the streamed parts: pass them as `parts`')
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"need at least one slot of at least one byte, got {num_slots} x {slot_bytes} bytes")
        self.loader = loader
        self.source = source
        self.device = torch.device(device)
        if packed and self.device.type != "cpu":
            raise ValueError("packed slots are for CPU compute (runtime/models/packed.py)")
        #: int8 / int4 weights stay packed in the slots (`PackedInt8`, `PackedInt4`), the layer multiplying by them
        self.packed = packed
        self.dtype = loader.dtype
        self.slot_bytes = slot_bytes
        self.max_gap = max_gap
        self.tracer = tracer
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.copy_seconds = 0.0
        self.decompress_seconds = 0.0  # of compressed weights, included in copy_seconds
        self._packed: torch.Tensor | None = None  # scratch for compressed bytes read from disk (grown on demand)
        self._checked: set[tuple[PartKey, str]] = set()  # compressed fields whose components were checked
        self._cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._layouts: dict[PartKey, PartLayout] = {}
        self.reader = DirectReader(direct=direct)
        if slots is not None:  # caller-owned slot buffers, e.g. shared-memory arenas another process maps
            if len(slots) != num_slots or any(t.dtype != torch.uint8 or t.numel() < slot_bytes for t in slots):
                raise ValueError(f"need {num_slots} uint8 slot tensors of at least {slot_bytes} bytes")
            self._slots = list(slots)
        else:
            self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_slots)]
        staging_bytes = max(align_up(staging_bytes), 4 * ALIGN)
        #: two staging buffers: one being read while the other is converted (on CUDA: transferred)
        self._staging = [AlignedBuffer(staging_bytes, pin=self._cuda) for _ in range(2)]
        self._reads: futures.ThreadPoolExecutor | None = None  # the CPU read-ahead thread (`_fill_from_disk`)
        self._max_piece = (staging_bytes - 2 * ALIGN) // TENSOR_ALIGN * TENSOR_ALIGN  # + alignment fits staging
        self._turn = 0
        self._staging_free: list[torch.cuda.Event | None] = [None] * len(self._staging)
        #: the slot protocol (events on CUDA; shared with the slots' readers, who call before_use / after_use)
        self.sync = sync if sync is not None else slot_sync(num_slots, self.device)
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        on_device_disk = self._cuda and source == "disk"
        self._scratch = torch.empty(staging_bytes, dtype=torch.uint8, device=self.device) if on_device_disk else None
        self._host: torch.Tensor | None = None
        self._host_offset: dict[PartKey, int] = {}
        if source == "ram":
            self._preload(list(dict.fromkeys(parts or ())))

    # --- public --------------------------------------------------------------------------------------------

    def nbytes(self, keys: Sequence[PartKey]) -> int:
        """Bytes the parts take in a slot, in the compute dtype, with per-tensor alignment."""
        return sum(self.layout(key).nbytes for key in dict.fromkeys(keys))

    def stored_nbytes(self, keys: Sequence[PartKey]) -> int:
        """Bytes the parts take in the host tier: in a slot's layout, compressed weights compressed."""
        return sum(self.layout(key).host_nbytes for key in dict.fromkeys(keys))

    def layout(self, key: PartKey) -> PartLayout:
        """Where each tensor of the part lies in the file and in the part's region of a slot (cached)."""
        if key not in self._layouts:
            self._layouts[key] = self._make_layout(key)
        return self._layouts[key]

    def load(self, slot: int, keys: Sequence[PartKey]) -> dict[PartKey, Weights]:
        """Fill slot `slot` with the parts and return their weights (views into the slot, compute dtype, device).

        Blocks until the data is in the slot on CPU; on CUDA until it is queued (`sync.before_use(slot)` before use).
        Raises ValueError if the parts do not fit in a slot, CheckpointError if the checkpoint cannot be read.
        """
        if not 0 <= slot < len(self._slots):
            raise IndexError(f"slot {slot} out of range for {len(self._slots)} slots")
        keys = list(dict.fromkeys(keys))
        need = self.nbytes(keys)
        if need > self.slot_bytes:
            raise ValueError(
                f"parts {keys} need {need} bytes but a slot holds {self.slot_bytes}; load fewer parts per slot "
                "or make the slots larger"
            )
        missing = [key for key in keys if self.source == "ram" and key not in self._host_offset]
        if missing:
            raise ValueError(f"parts {missing} are not in the host RAM tier; pass them in `parts` at construction")
        with self._lock, self._span("load", "io", slot=slot, parts=len(keys), bytes=need):
            bases = self._bases(keys)
            self.sync.before_load(slot, self._stream)
            if self.source == "disk":
                before = self.reader.bytes_read
                packed, packed_bases = self._packed_scratch(keys)
                self._fill_from_disk(self._pieces(self._slots[slot], bases, packed, packed_bases), on_device=self._cuda)
                self.bytes_read += self.reader.bytes_read - before
                if packed is not None:
                    self._decompress(self._slots[slot], bases, packed, packed_bases, codes_in_slot=True)
            else:
                self._fill_from_host(self._slots[slot], bases)
            self.sync.after_load(slot, self._stream)
            return {key: self.loader.assemble(key, self._views(self._slots[slot], key, base)) for key, base in bases}

    def views(self, slot: int, keys: Sequence[PartKey]) -> dict[PartKey, Weights]:
        """The weights `load(slot, keys)` put in the slot, without loading: for a reader of shared slot buffers.

        The layout is a pure function of the keys (in order), so a streamer in another process that shares the
        slot buffers sees exactly what the loading process wrote.
        """
        keys = list(dict.fromkeys(keys))
        return {key: self.loader.assemble(key, self._views(self._slots[slot], key, base))
                for key, base in self._bases(keys)}

    def close(self) -> None:
        """Close the checkpoint files and free the slots, staging buffers and host tier."""
        with self._lock:
            if self._stream is not None:
                self._stream.synchronize()
            if self._reads is not None:
                self._reads.shutdown(wait=True)
                self._reads = None
            self.reader.close()
            self._slots, self._staging, self._scratch, self._host = [], [], None, None

    def __enter__(self) -> WeightStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- layout --------------------------------------------------------------------------------------------

    def _make_layout(self, key: PartKey) -> PartLayout:
        ckpt, fields, offset, host, stored = self.loader.checkpoint, [], 0, 0, 0
        for field, ref in self.loader.refs(key).items():
            shape = ckpt.shape_of(ref.name, ref.index)
            numel = ckpt.numel(ref.name, ref.index)
            quant = ckpt.quantized(ref.name, ref.index)
            packed = self.packed and stays_packed(quant, shape)
            nbytes = (quant.spec.packed_nbytes(shape, self.dtype, TENSOR_ALIGN) if packed
                      else numel * self.dtype.itemsize)
            if quant is None:
                location, host_nbytes = ckpt.file_of(ref.name, ref.index), nbytes
            else:  # the codes' range stands in for the location; the components are read one by one
                location = quant.components[0].location
                host_nbytes = sum(align_up(c.location.length, TENSOR_ALIGN) for c in quant.components)
                stored += host_nbytes
            fields.append(FieldLayout(field, ref, location, ckpt.torch_dtype(ref.name), shape, offset, nbytes,
                                      quant, host, host_nbytes, packed))
            offset = align_up(offset + nbytes, TENSOR_ALIGN)
            host = align_up(host + host_nbytes, TENSOR_ALIGN)
        return PartLayout(tuple(fields), offset, host, stored)

    def _bases(self, keys: Sequence[PartKey]) -> list[tuple[PartKey, int]]:
        """Byte offset of each part's region in a slot: back to back, in the given order."""
        bases, offset = [], 0
        for key in keys:
            bases.append((key, offset))
            offset += self.layout(key).nbytes
        return bases

    def _flat(self, buffer: torch.Tensor, base: int, field: FieldLayout) -> torch.Tensor:
        start = base + field.offset
        return buffer[start : start + field.nbytes].view(self.dtype)  # [numel]

    def _packed_view(self, buffer: torch.Tensor, base: int, field: FieldLayout) -> PackedWeight:
        """A packed field's weight over its region of the slot (its format's `packed_view`)."""
        assert field.quant is not None
        start = base + field.offset
        return field.quant.spec.packed_view(buffer[start : start + field.nbytes], field.shape, self.dtype,
                                            TENSOR_ALIGN)

    def _views(self, buffer: torch.Tensor, key: PartKey, base: int) -> dict[str, torch.Tensor | PackedWeight]:
        return {f.field: self._packed_view(buffer, base, f) if f.packed else self._flat(buffer, base, f).view(f.shape)
                for f in self.layout(key).fields}

    def _pieces(self, buffer: torch.Tensor, bases: Sequence[tuple[PartKey, int]], packed: torch.Tensor | None = None,
                packed_bases: Sequence[tuple[PartKey, int]] = ()) -> list[Piece]:
        """What to read for the parts: each stored field converted into `buffer` at its slot offset, each compressed
        field's components copied raw into `packed` (scratch or host tier) at its host layout offsets."""
        pieces = []
        packed_at = dict(packed_bases)
        for key, base in bases:
            for field in self.layout(key).fields:
                if field.quant is None:
                    pieces += split_pieces(field, self._flat(buffer, base, field), self._max_piece)
                    continue
                assert packed is not None
                in_slot = field.packed and field.quant.spec.codes_in_slot  # (int8: the codes read into the slot)
                codes = self._packed_view(buffer, base, field).qweight.view(torch.uint8) if in_slot else None
                pieces += self._component_pieces(field, packed, packed_at[key], codes)
        return pieces

    def _host_pieces(self, host: torch.Tensor, bases: Sequence[tuple[PartKey, int]]) -> list[Piece]:
        """The host tier's reads: stored fields converted at their host offsets, compressed ones kept raw."""
        pieces = []
        for key, base in bases:
            for field in self.layout(key).fields:
                if field.quant is None:
                    dest = host[base + field.host_offset : base + field.host_offset + field.nbytes].view(self.dtype)
                    pieces += split_pieces(field, dest, self._max_piece)
                else:
                    pieces += self._component_pieces(field, host, base)
        return pieces

    def _component_pieces(self, field: FieldLayout, packed: torch.Tensor, base: int,
                          codes: torch.Tensor | None = None) -> list[Piece]:
        """A compressed field's components, read raw into `packed` at the part's `base` + their host offsets (the
        codes of a packed field straight into their place in the slot, `codes`, when given)."""
        assert field.quant is not None
        start, pieces = base + field.host_offset, []
        for c, at in zip(field.quant.components, field.component_offsets()):
            dest = packed[start + at : start + at + c.location.length]  # [bytes] uint8
            if codes is not None and c.suffix == "qweight":
                dest = codes.reshape(-1)  # [bytes] uint8, in the slot
            pieces += split_range(c.location, torch.uint8, dest, self._max_piece, field.ref.name)
        return pieces

    # --- compressed weights --------------------------------------------------------------------------------

    def _packed_scratch(self, keys: Sequence[PartKey]) -> tuple[torch.Tensor | None, list[tuple[PartKey, int]]]:
        """The scratch buffer for the compressed bytes of `keys` (None if none is compressed), and each part's
        base in it (host layout). Grown when a load needs more than any before."""
        bases, at = [], 0
        for key in keys:
            if self.layout(key).compressed:
                bases.append((key, at))
                at += self.layout(key).host_nbytes
        if not bases:
            return None, []
        if self._packed is None or self._packed.numel() < at:
            self._packed = torch.empty(at, dtype=torch.uint8, device=self.device)
        return self._packed, bases

    def _components(self, packed: torch.Tensor, base: int, field: FieldLayout) -> dict[str, torch.Tensor]:
        """Views of a compressed field's components in `packed` (scratch or host tier), in their dtypes."""
        assert field.quant is not None
        out, start = {}, base + field.host_offset
        for c, at in zip(field.quant.components, field.component_offsets()):
            raw = packed[start + at : start + at + c.location.length]  # [bytes] uint8
            out[c.suffix] = raw.view(c.dtype).view(c.shape)
        return out

    def _decompress(self, slot: torch.Tensor, bases: Sequence[tuple[PartKey, int]], packed: torch.Tensor,
                    packed_bases: Sequence[tuple[PartKey, int]], codes_in_slot: bool = False) -> None:
        """Dequantize every compressed field of the parts from `packed` into its place in the slot; a packed field
        gets its scale in the compute dtype (and its codes copied, unless the disk read put them in the slot)."""
        t0 = time.perf_counter()
        packed_at = dict(packed_bases)
        with self._span("decompress", "copy", parts=len(packed_at)), contextlib.ExitStack() as stack:
            if self._stream is not None:
                stack.enter_context(torch.cuda.stream(self._stream))
            for key, base in bases:
                if key not in packed_at:
                    continue
                for field in self.layout(key).fields:
                    if field.quant is None:
                        continue
                    parts = self._components(packed, packed_at[key], field)
                    if field.packed:
                        spec, view = field.quant.spec, self._packed_view(slot, base, field)
                        there = codes_in_slot and spec.codes_in_slot  # the disk read put the codes in the slot
                        self._check_once(key, field, {**parts, "qweight": view.qweight} if there else parts)
                        spec.fill_packed(view, parts, codes_there=there)
                        continue
                    self._check_once(key, field, parts)
                    dequantize_into(self._flat(slot, base, field).view(field.shape), parts, field.quant.spec)
        elapsed = time.perf_counter() - t0
        self.decompress_seconds += elapsed
        self.copy_seconds += elapsed

    def _check_once(self, key: PartKey, field: FieldLayout, parts: dict[str, torch.Tensor]) -> None:
        """The first time a compressed field is read, check its components (codes included: the small ones were
        checked when the checkpoint was opened); a damaged one is a CheckpointError naming tensor and file."""
        if (key, field.field) in self._checked:
            return
        assert field.quant is not None
        problem = field.quant.spec.check_parts(parts)
        if problem is not None:
            raise CheckpointError(f"compressed checkpoint {field.location.path}: {field.ref.name}: {problem}; "
                                  "re-run `specoffload quantize`")
        self._checked.add((key, field.field))

    # --- copies --------------------------------------------------------------------------------------------

    def _fill_from_disk(self, pieces: Sequence[Piece], on_device: bool) -> None:
        """Read the pieces with as few reads as `coalesce` allows, converting each into its destination.

        On the CPU the next group's read (into the other staging buffer, on the streamer's one reader thread, so
        reads stay in file order and DirectReader stays single-threaded) overlaps this group's conversion: preadv
        and the copy both leave the GIL, so a layer costs max(read, copy) per group instead of their sum (a
        128-expert layer converts 384 tensors of 3 MB where an 8-expert layer of the same bytes converts 24)."""
        groups = coalesce(pieces, self._staging[0].nbytes, self.max_gap)
        if on_device or len(groups) < 2:
            for group in groups:
                turn, self._turn = self._turn, (self._turn + 1) % len(self._staging)
                self._convert_group(group, self._read_group(group, turn), turn, on_device)
            return
        pending = self._reader_thread().submit(self._read_group, groups[0], 0)
        try:
            for i, group in enumerate(groups):
                raw = pending.result()
                pending = self._reader_thread().submit(self._read_group, groups[i + 1], (i + 1) % 2) \
                    if i + 1 < len(groups) else None
                self._convert_group(group, raw, i % 2, on_device)
        finally:
            if pending is not None:  # an error: the read in flight must leave its staging buffer before reuse
                futures.wait([pending])

    def _read_group(self, group: Sequence[Piece], turn: int) -> torch.Tensor:
        """Read one coalesced group into staging buffer `turn`; returns its bytes (uint8 [end - start])."""
        start, end = group[0].offset, max(p.end for p in group)
        free = self._staging_free[turn]
        if free is not None:
            free.synchronize()  # the staging buffer's previous transfer has left it
        t0 = time.perf_counter()
        with self._span("read", "disk", bytes=end - start), _naming(group):
            raw = self.reader.read_into(group[0].path, start, end - start, self._staging[turn])  # [end - start]
        self.read_seconds += time.perf_counter() - t0
        return raw

    def _convert_group(self, group: Sequence[Piece], raw: torch.Tensor, turn: int, on_device: bool) -> None:
        """Convert a read group's bytes into its pieces' destinations (on CUDA via the device scratch)."""
        start, end = group[0].offset, max(p.end for p in group)
        t1 = time.perf_counter()
        with self._span("copy", "copy", bytes=end - start), _naming(group):
            if on_device:
                assert self._stream is not None and self._scratch is not None
                with torch.cuda.stream(self._stream):
                    scratch = self._scratch[: end - start]
                    scratch.copy_(raw, non_blocking=True)
                    self._staging_free[turn] = self._stream.record_event()
                    for p in group:
                        p.dest.copy_(_typed(scratch, p.offset - start, p.length, p.file_dtype))
            else:
                for p in group:
                    copy_cast(p.dest, _typed(raw, p.offset - start, p.length, p.file_dtype))
        self.copy_seconds += time.perf_counter() - t1

    def _reader_thread(self) -> futures.ThreadPoolExecutor:
        """The one thread that issues reads ahead of the conversions (created on first use, shut down by close)."""
        if self._reads is None:
            self._reads = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="specoffload-read")
        return self._reads

    def _fill_from_host(self, slot: torch.Tensor, bases: Sequence[tuple[PartKey, int]]) -> None:
        """Copy each part's region from the host tier: the layouts match, so one copy per part; a part with
        compressed fields is copied field by field, its compressed ones decompressed (on CUDA: from a device copy of
        their bytes)."""
        assert self._host is not None
        t0 = time.perf_counter()
        compressed = []
        with self._span("copy", "copy", parts=len(bases)), contextlib.ExitStack() as stack:
            if self._stream is not None:
                stack.enter_context(torch.cuda.stream(self._stream))
            for key, base in bases:
                host, layout = self._host_offset[key], self.layout(key)
                if not layout.compressed:
                    n = layout.nbytes
                    slot[base : base + n].copy_(self._host[host : host + n], non_blocking=self._cuda)
                    self.bytes_read += n
                    continue
                compressed.append(key)
                for field in layout.fields:
                    if field.quant is None:
                        src = self._host[host + field.host_offset : host + field.host_offset + field.nbytes]
                        self._flat(slot, base, field).view(torch.uint8).copy_(src, non_blocking=self._cuda)
                self.bytes_read += layout.host_nbytes
        self.copy_seconds += time.perf_counter() - t0
        if compressed:
            host_bases = [(key, self._host_offset[key]) for key in compressed]
            packed = self._host
            if self._cuda:  # the compressed bytes cross the link, and are decompressed on the device
                packed, device_bases = self._packed_scratch(compressed)
                assert packed is not None
                with torch.cuda.stream(self._stream):
                    for (key, src), (_, dst) in zip(host_bases, device_bases):
                        n = self.layout(key).host_nbytes
                        packed[dst : dst + n].copy_(self._host[src : src + n], non_blocking=True)
                host_bases = device_bases
            self._decompress(slot, bases, packed, host_bases)

    def _preload(self, parts: Sequence[PartKey]) -> None:
        """Read `parts` into the host RAM tier (compute dtype, pinned on CUDA), through the disk path."""
        offset = 0
        for key in parts:
            self._host_offset[key] = offset
            offset += self.layout(key).host_nbytes
        self._host = torch.empty(max(offset, 1), dtype=torch.uint8, pin_memory=self._cuda)
        with self._span("preload", "io", parts=len(parts), bytes=offset):
            self._fill_from_disk(self._host_pieces(self._host, list(self._host_offset.items())), on_device=False)
        self.read_seconds = self.copy_seconds = 0.0

    def _span(self, name: str, resource: str, **args: Any) -> contextlib.AbstractContextManager[Any]:
        return self.tracer.span(name, resource, **args) if self.tracer is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _naming(group: Sequence[Piece]) -> Iterator[None]:
    """Re-raise an error of reading or converting a group's bytes as a CheckpointError naming its tensors and file."""
    try:
        yield
    except (OSError, RuntimeError, ValueError) as exc:  # CheckpointError is a ValueError
        names = sorted({p.tensor for p in group if p.tensor})
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise CheckpointError(f"streaming tensor {shown or '?'} from {group[0].path}: {exc}") from exc


def _typed(raw: torch.Tensor, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """`raw[start:start + length]` (uint8) viewed as `dtype`; copied first if the bytes are not aligned for it."""
    data = raw[start : start + length]
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype)
