"""`specoffload quantize`: write a compressed copy of a checkpoint (int8 per output channel, or int8g / int4 / int4k
per group of inputs).

The streamed parts' matrices are compressed (runtime/formats/): every dense MLP, routed expert and shared expert,
plus, with `--attention`, the attention projections, and with `--head` an untied LM head (at a tight budget the
head is the largest single part: 0.47 GB of the 1.5B in 16 bits). Everything else (embedding, norms, routers) is
copied as stored. The output mirrors the source's files (same shard names, an index if the source has one), each
compressed weight's components written next to each other so that one read fetches them, plus
`quantization.json` (models/quantized.py) and `provenance.json` (the source's hashes and provenance, the scheme,
the date, and the SHA-256 of the written safetensors files under the key scripts/get_models.py checks).
Files are written tensor by tensor under a temporary name and renamed when whole; memory stays at one tensor.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .formats import FORMATS, WeightFormat, quantize, weight_format
from .hashing import HASHES, PROVENANCE, QUANT_HASH, sha256_file, source_record
from .models.checkpoint import INDEX_FILE, Checkpoint
from .models.config import ModelConfig
from .models.errors import CheckpointError
from .models.quantized import QUANT_FILE, QuantManifest
from .models.weights import ATTENTION_MATRICES, WeightLoader

_DTYPE_NAME = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int8: "I8",
               torch.uint8: "U8"}  # fmt: skip
_TORCH = {v: k for k, v in _DTYPE_NAME.items()}


def compressed_names(checkpoint: Checkpoint, config: ModelConfig, attention: bool = False,
                     head: bool = False) -> list[str]:
    """The matrices `quantize` compresses: those of the streamed FFN parts (dense MLPs, routed experts, shared
    experts), with `attention` the attention projections, with `head` the LM head (untied only: a tied head is the
    embedding, whose rows are read one token at a time); never norms, routers or the embedding."""
    if head and config.tie_word_embeddings:
        raise CheckpointError(f"{config.path}: the LM head is the embedding (tie_word_embeddings), so --head would "
                              "compress the embedding too; run without --head")
    if config.family == "gpt_oss":  # its experts are stored transposed ([in, out]) with biases beside them
        raise CheckpointError(f"{config.path}: compressing gpt-oss checkpoints is not supported yet (their experts are "
                              "stored as [in, out] matrices); run it in its own dtype")
    loader = WeightLoader(checkpoint, config, torch.float32, "cpu")
    names: dict[str, None] = {}
    for key in loader.parts():
        refs = loader.refs(key)
        if key.kind in ("dense_mlp", "expert"):
            chosen = [r for f, r in refs.items() if f != "post_norm"]
        elif key.kind == "router":
            chosen = [r for f, r in refs.items() if f.startswith("shared_") and f.endswith("_proj")]
        elif key.kind == "attention" and attention:
            chosen = [r for f, r in refs.items() if f in ATTENTION_MATRICES]
        elif key.kind == "head" and head:
            chosen = [refs["lm_head"]]
        else:
            chosen = []
        names.update((r.name, None) for r in chosen)
    return list(names)


def quantize_checkpoint(src: str | Path, out: str | Path, spec: WeightFormat, attention: bool = False,
                        log: Callable[[str], None] | None = None, head: bool = False) -> dict[str, object]:
    """Write the compressed checkpoint of `src` to `out` (a new directory); return its provenance record."""
    src, out = Path(src), Path(out)
    config = ModelConfig.from_dir(src)
    ckpt = Checkpoint(src)
    if ckpt.gguf is not None:
        raise CheckpointError(f"{ckpt.gguf} is a GGUF file: it runs as stored (--model FILE.gguf); quantizing it again "
                              "would add a second rounding to weights that are low-bit already")
    if ckpt.quantization is not None:
        raise CheckpointError(f"{src} is already compressed ({ckpt.quantization.spec.name}); quantize the original")
    if out.exists():
        raise FileExistsError(f"output {out} exists; remove it or choose another -o")
    chosen = set(compressed_names(ckpt, config, attention, head))
    for name in chosen:
        dtype = ckpt.torch_dtype(name)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise CheckpointError(f"{src}: {name} is {dtype}, not a float weight; cannot compress it")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        shards = _shards(ckpt)
        weight_map: dict[str, str] = {}
        manifest = QuantManifest(spec, {n: (ckpt.shape(n), _DTYPE_NAME[ckpt.torch_dtype(n)]) for n in sorted(chosen)})
        stored = original = 0
        for file, names in shards.items():
            groups: list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]] = []
            for name in names:
                original += ckpt.nbytes(name)
                if name in chosen:
                    comps = spec.components(ckpt.shape(name))
                    groups.append((name, [(f"{name}.{c}", d, s) for c, (d, s) in comps.items()]))
                else:
                    dtype = _DTYPE_NAME.get(ckpt.torch_dtype(name))
                    if dtype is None:
                        raise CheckpointError(f"{src}: {name} is {ckpt.torch_dtype(name)}, which `quantize` cannot "
                                              "copy")
                    groups.append((name, [(name, dtype, ckpt.shape(name))]))
            stored += _write_file(tmp / file, groups, lambda name: _produce(ckpt, name, chosen, spec))
            weight_map.update((n, file) for _, stored_as in groups for n, _, _ in stored_as)
            if log:
                log(f"wrote {file}")
        if (src / INDEX_FILE).is_file():
            index = {"metadata": {"total_size": stored}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / QUANT_FILE).write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
        for side in src.iterdir():
            kept = side.name not in (INDEX_FILE, PROVENANCE, QUANT_FILE)
            if side.is_file() and side.suffix != ".safetensors" and kept:
                shutil.copy2(side, tmp / side.name)
        record = {
            "tool": "specoffload quantize",
            "scheme": spec.name,
            "group_size": spec.group,
            "compressed": "+".join(["ffn"] + ["attention"] * attention + ["head"] * head),
            "compressed_tensors": len(chosen),
            "source": source_record(src),
            "bytes": {"source": original, "stored": stored},
            "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "torch_version": torch.__version__,
            QUANT_HASH: sha256_file(tmp / QUANT_FILE),
            HASHES: {p.name: sha256_file(p) for p in sorted([*tmp.glob("*.safetensors"), *tmp.glob("*.index.json")])},
        }
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        Checkpoint(tmp)  # the reader accepts what we wrote (layout checked against the manifest)
        tmp.rename(out)
    except BaseException:  # a failed build leaves nothing behind (no .partial directory to trip over)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _produce(ckpt: Checkpoint, name: str, chosen: set[str], spec: WeightFormat) -> dict[str, torch.Tensor]:
    """The tensors stored for `name`: its components if compressed (suffixed names), else itself as stored."""
    if name not in chosen:
        return {name: ckpt.get(name)}
    try:
        parts = quantize(ckpt.get(name), spec)
    except ValueError as err:  # non-finite values, a range the format cannot hold
        raise CheckpointError(f"{ckpt.path}: cannot compress {name}: {err}") from None
    return {f"{name}.{c}": t for c, t in parts.items()}


def _shards(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Source file name -> its tensors, in file order."""
    by_file: dict[str, list[tuple[int, str]]] = {}
    for name in ckpt.names():
        loc = ckpt.file_of(name)
        by_file.setdefault(Path(loc.path).name, []).append((loc.offset, name))
    return {f: [n for _, n in sorted(v)] for f, v in sorted(by_file.items())}


def _write_file(path: Path, groups: Sequence[tuple[str, Sequence[tuple[str, str, tuple[int, ...]]]]],
                produce: Callable[[str], dict[str, torch.Tensor]]) -> int:
    """Write one safetensors file: per source tensor, in order, the (name, dtype, shape) it is stored as (itself,
    or its adjacent components); the header first, then each source tensor's data (`produce(source name)`),
    checked against the header. Returns the data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", "producer": "specoffload quantize"}}
    offset = 0
    for _, stored_as in groups:
        for name, dtype, shape in stored_as:
            nbytes = _numel(shape) * _TORCH[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for source, stored_as in groups:
            tensors = produce(source)
            for name, _, _ in stored_as:
                tensor, info = tensors[name], header[name]
                assert isinstance(info, dict)
                if list(tensor.shape) != info["shape"] or _DTYPE_NAME[tensor.dtype] != info["dtype"]:
                    raise AssertionError(f"{name}: produced {tensor.dtype} {list(tensor.shape)}, header says {info}")
                f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    return offset


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- command line ---------------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write an int8 or int4 copy of a checkpoint for streaming")
    p.add_argument("--model", required=True, type=Path, help="source checkpoint directory (HF safetensors)")
    p.add_argument("--to", required=True, choices=sorted(n for n, f in FORMATS.items() if f.writable),
                   help="int8: per output channel; int8g: int8 per group of --group inputs (8.5 bits at 32, "
                        "llama.cpp's Q8_0; multiplied by the int4 kernel as two halves); int4: per group of --group "
                        "inputs (4.5 bits); int4k: int4 with its codes stored as torch's CPU int4 kernel reads them "
                        "(the fastest to stream on a CPU: no per-load permutation)")
    p.add_argument("--group", type=int, default=None,
                   help="int8g / int4 / int4k: inputs per scale (default: int8g 32, int4 / int4k 64; int8g and int4k "
                        "take 32, 64, 128 or 256)")
    p.add_argument("--attention", action="store_true",
                   help="also compress the attention projections (default: only the FFN / experts)")
    p.add_argument("--head", action="store_true",
                   help="also compress the LM head (untied heads only; the largest part at a tight budget)")
    p.add_argument("-o", "--output", type=Path, default=None, help="output directory (default: MODEL-int8 / -int4)")


def run(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    spec = weight_format(args.to, args.group)
    model = args.model.expanduser()
    suffix = spec.label
    out = args.output or model.with_name(f"{model.name}-{suffix}")
    record = quantize_checkpoint(model, out, spec, attention=args.attention, log=log, head=args.head)
    sizes = record["bytes"]
    assert isinstance(sizes, dict)
    log(f"{out}: {record['compressed_tensors']} tensors as {spec.label}; checkpoint {sizes['source'] / 2**20:.0f} "
        f"-> {sizes['stored'] / 2**20:.0f} MiB")
    return 0
