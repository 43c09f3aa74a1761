"""The "lowbit" drafter: the target drafts for itself with resident low-bit copies of the parts it streams (SubSpec,
Wang et al. 2025, arXiv 2509.18344: a quantized substitute of the offloaded layers, the resident parts and the KV
cache shared).

What it holds. The target's architecture with each part the target streams (attention, dense MLP, router's shared
expert, routed expert, head: every one, so the draft routes through all experts as the target does) as an int4
(group `lowbit_group`) or int8 copy of its matrices (`COPIED_FIELDS`; norms, biases and the router's own gate as
stored), made at load time from the checkpoint and multiplied by torch's weight-only kernels
(runtime/models/packed.py `PackedInt4`, `PackedInt8`) in bfloat16 whatever the target's dtype (`KERNEL_DTYPE`:
in float32 the kernels run a scalar loop, ~10x slower); a compressed checkpoint already stored in that format gives
its components as they are (no second rounding). A part the target keeps resident is drafted with as the target
holds it (exact, no copy); so is the embedding (the attention worker's rows).

Placement. Its footprint (`lowbit_footprint`) lists every part but the embedding at its copy's bytes as stand-ins
(planner/shapes.py `ModelShape.stands_in`): placement counts a copy only while its target part streams, so making
a target part resident costs its bytes less its copy's. In a process of its own (a backend's draft role) it
cannot see the target's parts: it holds copies of them all, the embedding and a KV cache of its own.

KV: in the target's process it drafts into the target's KV cache (shared_kv.py `SharedKV`: drafted positions lie
past the committed ones and the verify pass overwrites them before any read). Verification by the full target keeps
the output lossless whatever the copy proposes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specoffload.planner.shapes import ModelShape, PartKey

from ...errors import ConfigError
from ...formats import WeightFormat, dequantize, quantize, weight_format
from ...kv_cache import KVCache
from ...models.model import Transformer
from ...models.packed import KERNEL_DTYPE
from ...models.weights import ATTENTION_MATRICES, TRANSPOSED_EXPERT_FIELDS, WeightLoader, Weights
from ..wire import wire
from . import DrafterTraits, DraftFootprint, TargetShare, option, register_drafter
from .shared_kv import SharedKV

if TYPE_CHECKING:
    from ...config import EngineConfig
    from ..workers import WeightPlan

Tensor = torch.Tensor

#: part kind -> the fields held as low-bit copies when the target streams the part (the router's gate, which picks
#: the experts, and the shared expert's gate stay as stored: they are small; a fused expert's gate_up is copied as
#: its gate and up halves); the embedding is never copied
COPIED_FIELDS = {
    "attention": ATTENTION_MATRICES,
    "dense_mlp": ("gate", "up", "down"),
    "router": ("shared_gate_proj", "shared_up_proj", "shared_down_proj"),
    "expert": ("gate", "up", "down", "gate_up", "gate_up_t", "down_t"),
    "head": ("lm_head",),
}
#: the part kinds the profiler's draft step holds as copies (`LowbitDrafter.step_model`)
STEP_COPIES = ("dense_mlp", "router", "expert")
LOWBIT_FORMATS = ("int4", "int8")


@dataclass(frozen=True)
class LowbitOptions:
    """The "lowbit" drafter's settings."""

    lowbit_format: str = option("int4", "format of the drafter's resident copies of the parts the target streams: "
                                        "int4 (groups of --lowbit-group inputs) or int8 (per channel)")
    lowbit_group: int = option(64, "inputs per scale of an int4 copy: 32, 64, 128 or 256 (the int4 kernel's)")

    def __post_init__(self) -> None:
        if self.lowbit_format not in LOWBIT_FORMATS:
            raise ConfigError(f"lowbit_format must be one of {LOWBIT_FORMATS}, got {self.lowbit_format!r}")
        if self.lowbit_group not in (32, 64, 128, 256):
            raise ConfigError(f"lowbit_group must be 32, 64, 128 or 256, got {self.lowbit_group!r}")

    @property
    def format(self) -> WeightFormat:
        return weight_format(self.lowbit_format, self.lowbit_group if self.lowbit_format == "int4" else None)


class LowbitDrafter(SharedKV, DrafterTraits):
    """The target with low-bit copies of the parts it streams (module docstring)."""

    shares_target = True
    options = LowbitOptions

    @classmethod
    def footprint(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> DraftFootprint:
        return lowbit_footprint(target, cls.settings(config).format, shares_kv)

    @classmethod
    def profile_key(cls, config: EngineConfig) -> str:
        return f"{config.drafter_name}:{cls.settings(config).format.label}"

    @classmethod
    def step_model(cls, config: EngineConfig) -> tuple[Transformer, dict[int, Tensor] | None] | None:
        """The step of the typical offloaded placement, for the profiler: the FFN parts as copies (they stream
        first), attention and head as stored (the target keeps them resident until the tightest budgets)."""
        return cls(config, copy_kinds=STEP_COPIES).model, None

    def __init__(self, config: EngineConfig, weights: WeightPlan | None = None, slots: Sequence[Tensor] | None = None,
                 *, share: TargetShare | None = None, copy_kinds: Sequence[str] = tuple(COPIED_FIELDS)) -> None:
        """share: the target's state in this process (its resident parts are drafted with as they are); without
        it, the parts of `copy_kinds` are copies and the others loaded as stored."""
        self.target_kv = share.kv if share is not None else None
        self.format = self.settings(config).format
        self.model = Transformer(config.target, dtype=config.torch_dtype, device=config.device,
                                 packed=config.packed_resident)
        parts = self.model.loader.parts()
        copied = [key for key in parts if key.kind in COPIED_FIELDS]
        if share is not None:  # the target's own tensors where it holds them; the embedding is the attention worker's
            self.model.embedder = share.embed
            self.model.resident.update({key: part for key, part in share.parts.items() if key.kind in COPIED_FIELDS})
            copied = [key for key in copied if key not in share.parts]
        else:
            copied = [key for key in copied if key.kind in copy_kinds]
            self.model.preload([key for key in parts if key not in copied])
        for key in copied:
            self.model.resident[key] = lowbit_part(self.model.loader, key, self.format)
        #: the target's parts it holds low-bit copies of, and their bytes
        self.copies = len(copied)
        self.copy_bytes = sum(lowbit_nbytes(self.model.loader, key, self.format) for key in copied)
        self.model.fetch = self._missing
        self.allowed = None
        self.caches: dict[int, KVCache] = {}

    @wire
    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        """It keeps a copy of every expert: nothing to re-choose."""
        return [0, 0, 0, 0]

    def _missing(self, keys: list[PartKey]) -> dict:
        raise RuntimeError(f"the low-bit drafter was asked for parts it does not hold: {keys[:3]}")


def copies_packed(fmt: WeightFormat, shape: tuple[int, ...], device: torch.device) -> bool:
    """A copy of a matrix of `shape` is held packed (its codes, multiplied by the format's kernel in KERNEL_DTYPE,
    whatever the target's dtype: the kernels' vector code is bfloat16's); on the CPU where the kernel takes the shape;
    elsewhere it is held dequantized in the compute dtype (the same values, no saving)."""
    return device.type == "cpu" and fmt.stays_packed(shape)


def lowbit_part(loader: WeightLoader, key: PartKey, fmt: WeightFormat) -> Weights:
    """Part `key` with its `COPIED_FIELDS` as `fmt` copies (`copies_packed`), its other tensors as stored: from the
    checkpoint's components where it stores the matrix in `fmt`, else quantized from the stored weight."""
    ckpt, dtype, device = loader.checkpoint, loader.dtype, loader.device
    fields: dict[str, object] = {}
    for name, ref in loader.refs(key).items():
        if name not in COPIED_FIELDS[key.kind]:
            fields[name] = ckpt.get(ref.name, dtype, device, ref.index)
            continue
        if name in TRANSPOSED_EXPERT_FIELDS:  # gpt-oss stores x @ W ([in, out]): copy the [out, in] matrices
            w = ckpt.get(ref.name, torch.float32, "cpu", ref.index)
            for field, m in TRANSPOSED_EXPERT_FIELDS[name](w).items():
                m = m.contiguous()  # [out, in]
                fields[field] = _copy(fmt, quantize(m, fmt), tuple(m.shape), dtype, device)
            continue
        stored = ckpt.quantized(ref.name, ref.index)
        shape = ckpt.shape_of(ref.name, ref.index)
        components = None
        if stored is not None:  # the stored codes where they are `fmt`'s (int4k's are int4's, permuted)
            components = stored.spec.components_as(fmt, ckpt.stored_parts(ref.name, ref.index), shape)
        if components is None:
            components = quantize(ckpt.get(ref.name, torch.float32, "cpu", ref.index), fmt)
        if name == "gate_up":  # [2 * intermediate, hidden]: rows are output channels, so each component halves
            halves = [{s: c.chunk(2, dim=0)[i].contiguous() for s, c in components.items()} for i in range(2)]
            half = (shape[0] // 2, shape[1])
            fields["gate"], fields["up"] = (_copy(fmt, h, half, dtype, device) for h in halves)
        else:
            fields[name] = _copy(fmt, components, shape, dtype, device)
    return loader.assemble(key, fields)  # type: ignore[arg-type]


def _copy(fmt: WeightFormat, components: dict[str, Tensor], shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device) -> object:
    if copies_packed(fmt, shape, device):
        return fmt.packed_copy(components, shape, KERNEL_DTYPE)
    return dequantize(components, fmt, shape, dtype, device)


def lowbit_nbytes(loader: WeightLoader, key: PartKey, fmt: WeightFormat) -> int:
    """Bytes of part `key`'s copy: its `COPIED_FIELDS` as `copies_packed` holds them, the rest in the compute dtype."""
    ckpt, dtype, total = loader.checkpoint, loader.dtype, 0
    for name, ref in loader.refs(key).items():
        shape = ckpt.shape_of(ref.name, ref.index)
        if name == "gate_up":
            total += 2 * _matrix_nbytes(fmt, (shape[0] // 2, shape[1]), dtype, loader.device)
        elif name == "gate_up_t":  # [hidden, 2 * inter] -> gate and up [inter, hidden]
            total += 2 * _matrix_nbytes(fmt, (shape[1] // 2, shape[0]), dtype, loader.device)
        elif name == "down_t":  # [inter, hidden] -> down [hidden, inter]
            total += _matrix_nbytes(fmt, (shape[1], shape[0]), dtype, loader.device)
        elif name in COPIED_FIELDS[key.kind]:
            total += _matrix_nbytes(fmt, shape, dtype, loader.device)
        else:
            total += math.prod(shape) * dtype.itemsize
    return total


def _matrix_nbytes(fmt: WeightFormat, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> int:
    if copies_packed(fmt, shape, device):
        return fmt.packed_nbytes(shape, KERNEL_DTYPE)
    return math.prod(shape) * dtype.itemsize


def lowbit_footprint(target: Transformer, fmt: WeightFormat, shares_kv: bool) -> DraftFootprint:
    """The low-bit drafter's parts and KV cache as placement counts them (module docstring): shares_kv (in the
    target's process): every part but the embedding at its copy's bytes, as stand-ins for the target's; else those
    copies (held whatever the target keeps), the embedding and a KV cache of its own."""
    shape = target.loader.shape("target")
    parts = tuple((key, lowbit_nbytes(target.loader, key, fmt) if key.kind in COPIED_FIELDS else n)
                  for key, n in shape.parts if key.kind in COPIED_FIELDS or not shares_kv)
    cfg = target.config
    draft = ModelShape(f"lowbit-{fmt.label}", parts, shape.num_layers, 0 if shares_kv else shape.kv_bytes_per_token,
                       hidden_bytes_per_token=shape.hidden_bytes_per_token, stands_in=shares_kv)
    return DraftFootprint(draft, top_k=cfg.num_experts_per_tok if cfg.num_experts else 0)


register_drafter("lowbit", LowbitDrafter)
