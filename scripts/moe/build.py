"""What both builders share: the output directory's life (temp dir, disk check, rename) and the layer loop.

A build writes into `.NAME.tmp-PID` beside `out` and renames it to `out` only when every shard, the index,
config.json and provenance.json are written, so a directory named `out` is always a whole checkpoint.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.config import ModelConfig

from .errors import MoEBuildError
from .formats import attention_names, global_names
from .shards import ShardedWriter, copy_side_files

Tensor = torch.Tensor
#: layer -> its MoE block's tensors (name, tensor), in the order they go into the layer's shard
LayerTensors = Callable[[int], list[tuple[str, Tensor]]]


def open_dense(dense: Path) -> tuple[ModelConfig, Checkpoint]:
    dense = Path(dense).expanduser()
    if not dense.is_dir():
        raise MoEBuildError(f"dense checkpoint directory not found: {dense}")
    return ModelConfig.from_dir(dense), Checkpoint(dense)


def check_disk(out: Path, needed: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < needed:
        raise MoEBuildError(
            f"not enough disk space in {out.parent}: the checkpoint needs {needed / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB are free"
        )


@contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A temp dir beside `out`, renamed to `out` (replacing an old one) when the block ends without error."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            stale = out.with_name(f".{out.name}.stale-{os.getpid()}")
            os.replace(out, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_checkpoint(
    tmp: Path, dense: Checkpoint, cfg: ModelConfig, moe_layer: LayerTensors, config, desc: str = "write"
) -> tuple[int, dict[str, str]]:
    """Shard 1: the global tensors; shard 2 + i: layer i's attention + norms as they are, then its MoE block.

    Writes the shards, index, config.json and the dense model's tokenizer files into `tmp`; returns the bytes
    of the shards and the SHA-256 of each shard and the index. One layer's tensors are in memory at a time.
    """
    names = dense.names()
    writer = ShardedWriter(tmp, cfg.num_layers + 1)
    writer.add([(n, dense.get(n)) for n in global_names(names)])
    for layer in tqdm(range(cfg.num_layers), desc=desc):
        writer.add([(n, dense.get(n)) for n in attention_names(names, layer)] + moe_layer(layer))
    writer.finish()
    config.save_pretrained(tmp)
    copy_side_files(Path(cfg.path), tmp)
    return writer.total_bytes, writer.sha256
