"""GGUF files (llama.cpp's format) run as they are stored: `--model FILE.gguf`, or a directory holding one.

No converted copy of the weights is written. A GGUF runs through a small *companion directory* in the cache
(`companion_dir`): config.json, generation_config.json and the tokenizer files (chat template included), derived
once from the GGUF's metadata by transformers' GGUF reader, plus `gguf.json`, which names the file (its real path,
size and mtime: a changed file gets a new companion). `resolve_model(path)` turns a GGUF path into that directory,
so config, tokenizer, sampling defaults and everything else read a checkpoint directory as usual, and
`Checkpoint` (checkpoint.py) opens the GGUF's tensors in place through `GGUFTable`:

- a block-quantized tensor (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4) is a compressed weight in its GGML format
  (runtime/formats/ggml.py): the streamer reads its bytes from the GGUF with direct reads and the format
  dequantizes them (or, Q4_0 / Q4_K, packs them for the int4 kernel) in the slot;
- an F16 matrix is a weight in the `f16` format (runtime/formats/ggml.py): read as stored into its slot for ggml.c,
  or converted there without the kernel; an F32 / BF16 tensor and an F16 vector are plain tensors;
- names are mapped from llama.cpp's (`blk.N.ffn_gate_exps.weight`, ...) to Hugging Face's; an MoE layer's experts
  stay fused, `[experts, out, in]` (`mlp.experts.gate_proj` / `up_proj` / `down_proj`), one row per expert.

Architectures: llama (Llama, Mistral and their fine-tunes), qwen2, qwen2moe, qwen3, qwen3moe; the others are refused
in one line. llama.cpp stores a llama's q / k rows permuted for its interleaved RoPE (pairs (x0, x1), (x2, x3), ...
rotate together): the weights are used as stored and the attention rotates pairs (`rope_interleave` in the companion
config, runtime/models/layers.py `_rope_pairs`), whose output is transformers' rotate-half layout exactly. Llama 3's
frequency factors (the `rope_freqs.weight` tensor) divide the RoPE frequencies as llama.cpp applies them
(`rope_freq_factors` in the companion config).
Every tensor is checked at open time (known type, whole blocks per row, byte range inside the file, shape as the
name implies), so a damaged file fails with the tensor named.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..formats import FORMATS, WeightFormat, weight_format
from ..json_bounds import JsonBounds, loads_bounded
from .errors import CheckpointError, UnsupportedModelError

GGUF_POINTER = "gguf.json"  # in a companion directory: which GGUF it stands for
POINTER_FORMAT = "specoffload.gguf"
#: the companion's tensor table semantics; part of the companion directory's name, so a table made by an older
#: reader is made again (2: a Qwen2-MoE's shared-expert gate read as [1, H])
POINTER_VERSION = 2
#: GGUF general.architecture -> the transformers architecture it becomes (runtime/models/config.py runs these)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
#: architectures whose q / k rows llama.cpp's converter permutes for its interleaved RoPE (module docstring)
_INTERLEAVED_ROPE = ("llama",)
#: llama.cpp's per-frequency RoPE divisors (Llama 3): a [head_dim / 2] float32 tensor, read into the config
ROPE_FREQS = "rope_freqs.weight"
MAX_ROPE_FREQS = 1 << 12
#: plain (unquantized) GGML types -> safetensors dtype strings
PLAIN_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}
#: GGML block types -> the format that reads them (runtime/formats/ggml.py)
BLOCK_TYPES = {f.gguf_type: name for name, f in FORMATS.items() if getattr(f, "gguf_type", "")}
MAX_TENSORS = 1 << 20

#: llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}  # fmt: skip
#: Hugging Face weights (by name ending) of shape [1, H] that llama.cpp's converter stores as vectors of H
ROW_VECTORS = (".mlp.shared_expert_gate.weight",)
#: GGUF metadata (after "ARCH.") -> config field, set from the file where transformers' GGUF reader does not
_CONFIG_KEYS = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size",
                "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF under its Hugging Face name: shape (outermost first), GGML type, where its bytes lie."""

    name: str
    kind: str  # GGML type name: "F32", "Q4_K", ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    length: int

    @property
    def fmt(self) -> WeightFormat | None:
        """The block format of a block-quantized tensor or an F16 matrix (runtime/formats/ggml.py), None for a plain
        one (F32, BF16, an F16 vector)."""
        if self.kind not in BLOCK_TYPES or (self.kind in PLAIN_TYPES and len(self.shape) < 2):
            return None
        return weight_format(BLOCK_TYPES[self.kind])

    @property
    def dtype(self) -> str:
        """safetensors dtype string of the stored data: the plain type, "U8" for blocks."""
        return PLAIN_TYPES.get(self.kind, "U8")

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The stored shape: the tensor's for a plain one, rows of whole blocks (uint8) for a block one."""
        fmt = self.fmt
        if fmt is None:
            return self.shape
        return (*self.shape[:-1], self.shape[-1] // fmt.group * fmt.block_bytes)  # type: ignore[attr-defined]

    def expected_length(self) -> int:
        """Bytes the type and shape imply; raises CheckpointError / UnsupportedModelError for a tensor this engine
        cannot read."""
        if self.kind in PLAIN_TYPES:
            return math.prod(self.shape) * {"F32": 4, "F16": 2, "BF16": 2}[self.kind]
        fmt = self.fmt
        if fmt is None:
            raise UnsupportedModelError(
                f"GGUF tensor {self.name!r} is {self.kind}, which this engine cannot read (it reads "
                f"{', '.join([*PLAIN_TYPES, *BLOCK_TYPES])}); use a GGUF quantized to those (Q4_K_M is)")
        if len(self.shape) < 2 or self.shape[-1] % fmt.group:
            raise CheckpointError(f"GGUF tensor {self.name!r} is {self.kind} of shape {list(self.shape)}, not rows "
                                  f"of whole {fmt.group}-input blocks")
        return math.prod(self.shape) // fmt.group * fmt.block_bytes  # type: ignore[attr-defined]


def gguf_file_in(path: str | Path) -> Path | None:
    """The GGUF `path` names: the file itself, or the one .gguf file of a directory without a config.json; None
    for anything else (a checkpoint directory). A directory of several GGUF files is an error (which one?)."""
    p = Path(path)
    if p.suffix == ".gguf" and not p.is_dir():
        if not p.is_file():
            raise CheckpointError(f"GGUF file not found: {p}")
        return p
    if not p.is_dir() or (p / "config.json").is_file() or (p / GGUF_POINTER).is_file():
        return None
    files = sorted(p.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(f"{p} holds {len(files)} GGUF files ({files[0].name}, {files[1].name}, ...): "
                              "name the one to run")
    return files[0] if files else None


def resolve_model(path: str | Path, cache: Path | None = None) -> Path:
    """A model path as a checkpoint directory: a GGUF (file, or directory holding one) -> its companion directory
    (made on first use: a few seconds of metadata parsing), anything else unchanged."""
    gguf = gguf_file_in(path)
    if gguf is None:
        return Path(path)
    return ensure_companion(gguf, cache)


def companion_root() -> Path:
    """Where companion directories live: $SPECOFFLOAD_GGUF_CACHE, else ~/.cache/specoffload/gguf."""
    env = os.environ.get("SPECOFFLOAD_GGUF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specoffload" / "gguf"


def _identity(gguf: Path) -> dict[str, object]:
    real = gguf.resolve()
    stat = real.stat()
    return {"file": str(real), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def companion_dir(gguf: Path, cache: Path | None = None) -> Path:
    ident = _identity(gguf) | {"version": POINTER_VERSION}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return (cache or companion_root()) / f"{gguf.stem}-{key}"


def ensure_companion(gguf: Path, cache: Path | None = None) -> Path:
    """The companion directory of `gguf` (module docstring), made if missing (written aside, then renamed)."""
    dest = companion_dir(gguf, cache)
    if (dest / GGUF_POINTER).is_file():
        return dest
    table = GGUFTable.read(gguf)  # checks the tensors before anything is written
    print(f"reading the metadata of {gguf.name} (once: config, tokenizer and chat template into {dest})",
          file=sys.stderr, flush=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _write_companion(gguf, table, tmp)
        (tmp / GGUF_POINTER).write_text(json.dumps({"format": POINTER_FORMAT, "version": POINTER_VERSION,
                                                    **_identity(gguf), **table.to_json()}))
        try:
            os.replace(tmp, dest)
        except OSError:  # another process made it first
            if not (dest / GGUF_POINTER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_companion(gguf: Path, table: GGUFTable, out: Path) -> None:
    """config.json (+ architectures, the dtype bfloat16 the CPU computes GGUF weights in, tie_word_embeddings as
    the file stores the head), generation_config.json and the tokenizer files, through transformers."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    has_tokenizer = "tokenizer.ggml.model" in table.metadata
    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name) if has_tokenizer else None
    except Exception as exc:  # transformers raises many types for metadata it cannot read
        raise CheckpointError(f"cannot read the metadata of {gguf}: {exc}") from exc
    arch = table.architecture
    for key, field in _CONFIG_KEYS.items():  # what transformers' GGUF mapping leaves out for these families
        if f"{arch}.{key}" in table.metadata and hasattr(config, field):
            setattr(config, field, int(table.metadata[f"{arch}.{key}"]))  # type: ignore[call-overload]
    config.architectures = [ARCHITECTURES[arch]]
    if arch in _INTERLEAVED_ROPE:
        config.rope_interleave = True
    if arch == "llama":  # (transformers' reader leaves attention_bias unset; a llama with q/k/v/o biases has them)
        config.attention_bias = "model.layers.0.self_attn.q_proj.bias" in table.tensors
    if table.rope_freqs is not None:
        config.rope_freq_factors = table.rope_freqs
    config.tie_word_embeddings = "lm_head.weight" not in table.tensors
    config.dtype = "bfloat16"
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    if tokenizer is not None:  # (a GGUF without a vocabulary: token ids in and out only)
        tokenizer.save_pretrained(str(out))


def read_pointer(directory: Path) -> GGUFTable | None:
    """The tensor table of the GGUF a companion directory stands for (the file checked: same size and mtime as when
    the companion was made), or None for a directory without `gguf.json`."""
    pointer = directory / GGUF_POINTER
    if not pointer.is_file():
        return None
    try:
        raw = loads_bounded(pointer.read_bytes(), JsonBounds(max_depth=5, max_digits=24, max_items=MAX_TENSORS * 8))
        file = Path(raw["file"])
        ok = raw.get("format") == POINTER_FORMAT and raw.get("version") == POINTER_VERSION
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"corrupt {pointer}; delete {directory} and run the GGUF again") from None
    if not ok:
        raise CheckpointError(f"{pointer} is not a specoffload GGUF pointer (version {POINTER_VERSION})")
    if not file.is_file():
        raise CheckpointError(f"the GGUF {file} that {directory} stands for is gone")
    if _identity(file) != {k: raw.get(k) for k in ("file", "size", "mtime_ns")}:
        raise CheckpointError(f"{file} changed since {directory} was made from it; run the GGUF file itself")
    try:
        return GGUFTable.from_json(file, raw)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointError(f"corrupt {pointer}; delete {directory} and run the GGUF again") from None


class GGUFTable:
    """The tensors of a GGUF file under Hugging Face names (`tensors`), checked: readable types, byte ranges inside
    the file and overlapping no other tensor. `read` parses the file (seconds: its metadata holds the whole
    vocabulary); a companion directory keeps the table in its `gguf.json` (`to_json` / `from_json`)."""

    def __init__(self, file: Path, architecture: str, tensors: list[GGUFTensor],
                 metadata: dict[str, object] | None = None, rope_freqs: list[float] | None = None) -> None:
        self.file = Path(file)
        #: the file's scalar metadata (`read` only: a table from `gguf.json` has none)
        self.metadata = metadata or {}
        #: the values of its `rope_freqs.weight` (`read` only), None without one
        self.rope_freqs = rope_freqs
        if architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {architecture!r} of {self.file} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}")
        self.architecture = architecture
        if len(tensors) > MAX_TENSORS:
            raise CheckpointError(f"{self.file} lists {len(tensors)} tensors (> {MAX_TENSORS})")
        size = self.file.stat().st_size
        self.tensors: dict[str, GGUFTensor] = {}
        for t in tensors:
            try:
                length = t.expected_length()
            except CheckpointError as exc:
                raise CheckpointError(f"corrupt GGUF {self.file}: {exc}") from None
            except UnsupportedModelError as exc:
                raise UnsupportedModelError(f"{self.file}: {exc}") from None
            if t.length != length or t.offset < 0 or t.offset + length > size:
                raise CheckpointError(f"corrupt or truncated GGUF {self.file}: {t.name} ({t.kind} {list(t.shape)}, "
                                      f"{length} bytes) claims bytes {t.offset}..{t.offset + t.length} of a "
                                      f"{size}-byte file")
            if t.name in self.tensors:
                raise CheckpointError(f"corrupt GGUF {self.file}: two tensors named {t.name!r}")
            self.tensors[t.name] = t
        spans = sorted((t.offset, t.offset + t.length, t.name) for t in self.tensors.values())
        for (_, end, before), (begin, _, name) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(f"corrupt GGUF {self.file}: tensors {before!r} and {name!r} overlap")

    @classmethod
    def read(cls, file: Path) -> GGUFTable:
        """Parse a GGUF file's header with the gguf package (tensor data is not read)."""
        from gguf import GGUFReader

        try:
            reader = GGUFReader(str(file), "r")
        except Exception as exc:  # the reader raises ValueError, struct errors, numpy errors on a bad file
            raise CheckpointError(f"corrupt or unreadable GGUF {file}: {exc}") from exc
        field = reader.fields.get("general.architecture")
        arch = str(field.contents()) if field is not None else "(none)"
        if arch not in ARCHITECTURES:
            cls(file, arch, [])  # raises: unsupported
        tensors, rope_freqs = [], None
        for t in reader.tensors:
            if str(t.name) == ROPE_FREQS:
                if t.tensor_type.name != "F32" or not 0 < t.n_elements <= MAX_ROPE_FREQS:
                    raise CheckpointError(f"corrupt GGUF {file}: {ROPE_FREQS} is {t.tensor_type.name} of "
                                          f"{t.n_elements} values (expected F32, one per RoPE frequency)")
                rope_freqs = [float(x) for x in t.data.reshape(-1)]
                if not all(math.isfinite(x) and x > 0 for x in rope_freqs):
                    raise CheckpointError(f"corrupt GGUF {file}: {ROPE_FREQS} holds a value that is not a positive "
                                          "finite number")
                continue
            name = hf_name(str(t.name))
            if name is None:
                raise UnsupportedModelError(f"GGUF tensor {t.name!r} of {file} has no counterpart in this engine's "
                                            f"{arch} model")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the innermost dimension first
            if name.endswith(ROW_VECTORS) and len(shape) == 1:  # llama.cpp's converter writes a [1, H] weight as [H]
                shape = (1, *shape)
            tensors.append(GGUFTensor(name, t.tensor_type.name, shape, int(t.data_offset), int(t.n_bytes)))
        metadata = {k: f.contents() for k, f in reader.fields.items() if len(f.types) == 1 and f.types[0].name not in
                    ("ARRAY", "STRING") or k in ("tokenizer.ggml.model", "general.name")}
        return cls(file, arch, tensors, metadata, rope_freqs)

    def to_json(self) -> dict[str, object]:
        return {"architecture": self.architecture,
                "tensors": [[t.name, t.kind, list(t.shape), t.offset, t.length] for t in self.tensors.values()]}

    @classmethod
    def from_json(cls, file: Path, raw: dict[str, object]) -> GGUFTable:
        rows = raw["tensors"]
        if not isinstance(rows, list):
            raise TypeError("tensors is not a list")
        tensors = [GGUFTensor(str(n), str(k), tuple(int(d) for d in shape), int(o), int(n_bytes))
                   for n, k, shape, o, n_bytes in rows]
        return cls(file, str(raw["architecture"]), tensors)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None if this engine has none for it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    return None
