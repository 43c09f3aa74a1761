"""Calibration text and the dense pass that feeds the builders.

The text is the Python standard library's own source (real code, already on every machine, and not the
HumanEval prompts we evaluate on). `ffn_inputs` runs the dense model over it layer by layer (the whole batch
through layer i before layer i+1, each layer's weights dropped after use) and yields, per layer, the FFN's
input: the post-attention RMSNorm output, which is exactly what a router placed there sees.
"""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specoffload.runtime.models import layers
from specoffload.runtime.models.linear import linear
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.models.weights import ExpertWeights, PartKey

from .errors import MoEBuildError
from .shards import sha256_file

Tensor = torch.Tensor

#: stdlib modules (relative to the stdlib directory) used when no --calibration files are given: long-lived,
#: code-heavy files that exist as single files in every CPython since 3.8
DEFAULT_STDLIB_FILES = (
    "argparse.py",
    "ast.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "tokenize.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
    "email/message.py",
    "http/client.py",
    "copy.py",
)


def stdlib_files(names: Sequence[str] = DEFAULT_STDLIB_FILES) -> list[Path]:
    """The default calibration files present in this interpreter's stdlib (missing ones are skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / name for name in names if (root / name).is_file()]


@dataclass(frozen=True)
class Calibration:
    """Token windows cut from source files: `windows_per_file` windows of `seq_len` tokens from each file."""

    files: tuple[Path, ...]
    token_ids: Tensor  # [sequences, seq_len] long

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    def record(self) -> dict[str, object]:
        """For provenance.json: each file with its SHA-256, and the window shape."""
        return {
            "files": [{"path": str(f), "sha256": sha256_file(f)} for f in self.files],
            "sequences": self.token_ids.shape[0],
            "seq_len": self.token_ids.shape[1],
        }


def load_calibration(
    files: Sequence[Path], encode: Callable[[str], list[int]], seq_len: int = 256, windows_per_file: int = 1
) -> Calibration:
    """Tokenise each file and cut `windows_per_file` consecutive windows of `seq_len` tokens from its start.

    Files too short for one window are skipped; a missing or unreadable file is an error.
    """
    if seq_len < 2 or windows_per_file < 1:
        raise MoEBuildError(f"bad calibration shape: seq_len {seq_len}, windows per file {windows_per_file}")
    rows, used = [], []
    for file in files:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MoEBuildError(f"cannot read calibration file {file}: {exc}") from exc
        ids = encode(text[: 16 * seq_len * windows_per_file])  # a token is rarely over 16 characters
        windows = min(windows_per_file, len(ids) // seq_len)
        rows += [ids[w * seq_len : (w + 1) * seq_len] for w in range(windows)]
        if windows:
            used.append(Path(file))
    if not rows:
        raise MoEBuildError(f"no calibration file has {seq_len} tokens ({len(files)} files given)")
    return Calibration(tuple(used), torch.tensor(rows, dtype=torch.long))


def tokenizer_encoder(model_dir: Path) -> Callable[[str], list[int]]:
    """The dense checkpoint's tokenizer as `text -> ids` (no special tokens)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a missing tokenizer
        raise MoEBuildError(f"no usable tokenizer in {model_dir}: {exc}") from exc
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class FFNInput:
    """What one dense layer's FFN sees on the calibration tokens, and that FFN."""

    layer: int
    x: Tensor  # [tokens, hidden]: post-attention RMSNorm output
    mlp: ExpertWeights  # the dense FFN, gate/up [intermediate, hidden], down [hidden, intermediate]
    act: str  # activation name

    @functools.cached_property
    def activations(self) -> Tensor:
        """a [tokens, intermediate] = act(gate x) * (up x): neuron n's output is a[:, n] times down[:, n].

        Computed on first use and reused by the dense pass for the layer's output.
        """
        with torch.inference_mode():
            return layers.activation(self.act)(linear(self.x, self.mlp.gate)) * linear(self.x, self.mlp.up)

    def output(self) -> Tensor:
        """FFN(x) [tokens, hidden], from the activations if a consumer already computed them."""
        with torch.inference_mode():
            if "activations" in self.__dict__:
                return linear(self.activations, self.mlp.down)
            return layers.gated_mlp(self.x, self.mlp, self.act)


def ffn_inputs(model: Transformer, token_ids: Tensor) -> Iterator[FFNInput]:
    """Run the dense `model` on token_ids [B, T] layer-major; yield each layer's FFN input (N = B * T tokens).

    Each layer's weights are loaded for its turn and dropped after, so peak memory is one layer's weights plus
    the activations; the consumer may keep what it needs from each `FFNInput`.
    """
    cfg = model.config
    if cfg.is_moe:
        raise MoEBuildError(f"the source must be a dense model; {cfg.path} is {cfg.architecture}")
    batch, steps = token_ids.shape
    cache = model.new_cache(batch, steps)
    with torch.inference_mode():
        hidden = model.embed(token_ids)  # [B, T, H]
    model.resident.pop(PartKey("embedding"), None)
    for layer in range(cfg.num_layers):
        with torch.inference_mode():
            hidden = model.attention(layer, hidden, cache)  # [B, T, H]
            w = model.loader.dense_mlp(layer)
            x = layers.rms_norm(hidden, w.post_norm, cfg.rms_norm_eps).reshape(-1, cfg.hidden_size)  # [N, H]
        model.resident.pop(PartKey("attention", layer), None)
        item = FFNInput(layer, x, w.mlp, cfg.hidden_act)
        yield item
        with torch.inference_mode():
            hidden = hidden + item.output().view(hidden.shape)  # [B, T, H]
