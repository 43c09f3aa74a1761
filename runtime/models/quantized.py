"""The compressed checkpoint format (`specoffload quantize`, runtime/quantize.py): its manifest and its validation.

A compressed checkpoint is an ordinary safetensors checkpoint directory plus `quantization.json`:

    {"format": "specoffload.quantized", "version": 1, "scheme": "int8" | "int4", "group_size": 0 | 64,
     "tensors": {"model.layers.0.mlp.gate_proj.weight": {"shape": [8960, 1536], "dtype": "BF16"}, ...}}

Each listed weight W is absent as such; its components `W.qweight`, `W.scale` (and `W.zero` for int4) are stored
instead, adjacent in one file (runtime/formats/ gives their dtypes and shapes). `Checkpoint` opens it like any
other: the listed names keep their logical shape and dtype, `get` dequantizes them, and `quantized(name)` tells
the weight streamer where each component lies so that it reads the compressed bytes. Every listed weight is
checked at open time against the scheme (component present, dtype, shape, group size), so a damaged or
hand-edited checkpoint fails with one line naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats import COMPONENTS, FORMATS, WeightFormat, weight_format
from ..json_bounds import JsonBounds, loads_bounded
from .errors import CheckpointError

QUANT_FILE = "quantization.json"
FORMAT = "specoffload.quantized"
VERSION = 1
_LOGICAL_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class QuantManifest:
    """What `quantization.json` says: the scheme and each compressed weight's logical shape and dtype."""

    spec: WeightFormat
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (logical shape, logical safetensors dtype)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "scheme": self.spec.name, "group_size": self.spec.group,
                "tensors": {n: {"shape": list(s), "dtype": d} for n, (s, d) in sorted(self.tensors.items())}}


def read_manifest(directory: Path) -> QuantManifest | None:
    """The directory's `quantization.json`, validated, or None if it has none."""
    path = directory / QUANT_FILE
    if not path.is_file():
        return None

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"corrupt {path}: {what}; re-run `specoffload quantize`")

    try:
        raw = loads_bounded(path.read_bytes(), JsonBounds(max_depth=6, max_digits=24))  # untrusted: bounded parse
    except (OSError, ValueError) as exc:  # (BoundsError, JSONDecodeError, UnicodeDecodeError are ValueErrors)
        raise bad(str(exc)) from exc
    if type(raw) is not dict or raw.get("format") != FORMAT:
        raise bad(f"format is not {FORMAT!r}")
    if raw.get("version") != VERSION:
        raise bad(f"version {raw.get('version')!r}, this runtime reads version {VERSION}")
    scheme, group = raw.get("scheme"), raw.get("group_size")
    writable = tuple(sorted(n for n, f in FORMATS.items() if f.writable))
    if scheme not in writable or type(group) is not int:
        raise bad(f"scheme {scheme!r:.20} / group_size {group!r:.20} (expected one of {writable} and "
                  "an integer)")
    try:
        spec = weight_format(scheme, group)
    except ValueError as exc:
        raise bad(str(exc)) from exc
    tensors = raw.get("tensors")
    if type(tensors) is not dict:
        raise bad("no 'tensors' object")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, info in tensors.items():
        shape = info.get("shape") if type(info) is dict else None
        dtype = info.get("dtype") if type(info) is dict else None
        if type(shape) is not list or len(shape) < 2 or not all(type(d) is int and d > 0 for d in shape):
            raise bad(f"tensor {name!r:.80} has shape {shape!r:.60}, not a list of at least two positive integers")
        if dtype not in _LOGICAL_DTYPES:
            raise bad(f"tensor {name!r:.80} has dtype {dtype!r:.20}, expected one of {_LOGICAL_DTYPES}")
        out[name] = (tuple(shape), dtype)
    return QuantManifest(spec, out)


def check_components(manifest: QuantManifest, name: str, found: dict[str, tuple[str, tuple[int, ...]] | None],
                     where: Path) -> None:
    """Check one weight's stored components (suffix -> (dtype, shape) from the headers, None if absent) against
    what the scheme prescribes for its logical shape; raise CheckpointError naming the first mismatch."""
    shape, _ = manifest.tensors[name]
    expected = manifest.spec.components(shape)
    for suffix in COMPONENTS:
        want, got = expected.get(suffix), found.get(suffix)
        if want is None:
            if got is not None:
                raise CheckpointError(f"compressed checkpoint {where}: {name}.{suffix} is stored, but "
                                      f"{manifest.spec.name} has no {suffix}")
            continue
        if got is None:
            raise CheckpointError(f"compressed checkpoint {where}: {name}.{suffix} is missing "
                                  f"({manifest.spec.name} of {name} needs it)")
        if got != want:
            group = f", group {manifest.spec.group}" if manifest.spec.group else ""
            raise CheckpointError(
                f"compressed checkpoint {where}: {name}.{suffix} is {got[0]} {list(got[1])}, but "
                f"{manifest.spec.name}{group} of a {list(shape)} weight stores {want[0]} {list(want[1])}"
            )

