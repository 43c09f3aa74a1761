#!/usr/bin/env python
"""Baseline for scripts/bench_offload.py: transformers + accelerate disk offload.

``load_hf_disk_offload`` loads a causal LM with ``device_map="auto"``, a small ``max_memory={"cpu": ...}``
and an ``offload_folder``, and refuses a model whose ``hf_device_map`` has no ``"disk"`` entry.
``generate_hf`` runs greedy generation on token-id prompts (left-padded by hand, EOS disabled, so every
row yields exactly ``max_new_tokens`` tokens) with the page cache of the offloaded weights dropped first.

How the offload works (transformers 5.24, accelerate 1.16, a safetensors checkpoint; read from
``transformers/integrations/accelerate.py`` and ``accelerate/{big_modeling,hooks,utils/offload}.py``):

* Placement. ``infer_auto_device_map`` fills ``max_memory["cpu"]`` in module order but first reserves room
  for the largest offloaded module, ``lm_head`` (151936 x 1536, 0.93 GB in float32). Measured for the
  1.5B target in float32 (7.1 GB): 2 GiB puts ``model.embed_tokens`` and ``model.layers.0`` on "cpu" and
  the other 30 entries (layers 1-27, ``model.norm``, ``model.rotary_emb``, ``lm_head``; 326 tensors,
  2.99 GB stored) on "disk"; 3 GiB keeps layers 0-6 (24 on disk, 2.43 GB); 4 GiB layers 0-11 (19 on disk,
  1.96 GB). At 1 or 1.5 GiB not even the embedding fits beside the reserve and the map collapses to
  ``{"": "disk"}``: the whole model (3.55 GB) on disk, summarised as ``{"disk": 1}``.
* Storage. No ``.dat`` memmaps: transformers 5 always hands accelerate an offload index, so accelerate's own
  ``offload_state_dict`` (``np.memmap`` ``.dat`` files) never runs. For a safetensors checkpoint the index
  points at the checkpoint itself (``{"safetensors_file", "weight_name", "dtype"}``), so ``offload_folder``
  stays empty and the disk copy is the checkpoint's, in its stored dtype (float16 here; 2.99 GB of the
  3.55 GB file at 2 GiB). Only weights a load-time conversion changes (fused MoE experts; ``.bin``
  checkpoints) are re-saved into ``offload_folder``, one safetensors file per weight. ``disk_bytes`` is
  therefore the stored size of the disk-offloaded tensors wherever they live, not the folder's size.
* Reads. Every leaf module of a disk module gets an ``AlignDevicesHook(offload=True)``. Its ``pre_forward``
  reads each parameter through ``OffloadedWeightsLoader``: ``safe_open`` (an mmap of the whole file),
  ``get_tensor`` (a copy), ``.to(float32)`` (a second copy); ``post_forward`` puts the parameter back on
  ``meta``. So every forward (each prefill and each decode step) re-reads and re-converts all disk
  weights synchronously, module by module, with no overlap of I/O and compute.
* Page cache. The reads go through the page cache; the checkpoint (3.55 GB) fits the 24 GB of RAM many
  times over, so after the first step every read is a memory copy, not disk I/O. ``drop_page_cache``
  evicts the backing files (``posix_fadvise(DONTNEED)``; accelerate keeps no mapping between reads, and a
  float16 -> float32 load copies the cpu-placed weights, so nothing of ours pins the file) before each
  ``generate()``; with ``cold_every_step=True`` it also drops them before every forward, so each step pays
  the disk read. Neither fadvise nor ``/proc/sys/vm/drop_caches`` can evict pages that a live mmap maps:
  if another process (or our engine in the same process) maps the checkpoint, they stay cached.
  ``HFOffloadRun.cached_bytes_after_drop`` records what was still resident, so a warm "cold" run shows.
* EOS. ``generate(eos_token_id=None)`` does not disable EOS: ``None`` kwargs are filled from
  ``model.generation_config``; so ``generate_hf`` sets ``model.generation_config.eos_token_id = None``
  for the call (as bench_generate.py does; ``min_new_tokens`` would mask EOS and change greedy tokens).

Measured (2 shared cores, other jobs running, so timings are noisy): 2 GiB, float32, 4 HumanEval prompts
(80-118 tokens) x 8 new tokens at batch 4: 0.38-0.78 tok/s (41-84 s, of which the cold first forward
10-19 s, then 3-10 s per warm decode step, i.e. re-reading and converting ~3 GB per step); batch 1:
0.19-0.24 tok/s; load 3.4 s with a warm page cache, 14 s cold; peak RSS 5.1 GB (1.5 GB resident after the
load). Greedy tokens equal those of the same model loaded fully in RAM and are the same at batch 1 and 4.

CLI smoke check (offload folder under /tmp, removed at the end)::

    python -m scripts.hf_disk_offload --max-memory 2GiB --batch 4 --max-new-tokens 8 --prompts 4 [--check-ram]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from accelerate.utils import convert_file_size_to_int
from accelerate.utils.offload import OffloadedWeightsLoader
from transformers import AutoModelForCausalLM, PreTrainedModel

from scripts.common import drop_caches

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFOffloadRun:
    """Result of one ``generate_hf`` call over all prompts."""

    tokens: list[list[int]]  # generated ids per prompt (new tokens only)
    generated_tokens: int
    seconds: float  # wall time of the generate() calls (model already loaded), prefill included
    load_seconds: float  # from_pretrained time, as recorded by load_hf_disk_offload (0.0 if unknown)
    device_map_summary: dict[str, int]  # {"cpu": n_modules, "disk": n_modules}
    disk_bytes: int  # stored bytes of the disk-offloaded weights
    batch_size: int
    # Largest page-cache residency (bytes) of the offloaded files right after a drop; None if not dropped or
    # unmeasurable. Non-zero means something maps the file (another process, or a model in this process loaded
    # from the same checkpoint without a dtype conversion): fadvise cannot evict mapped pages.
    cached_bytes_after_drop: int | None = None

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of generate() wall time."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("nan")


# ---- loading -----------------------------------------------------------------------------------
def load_hf_disk_offload(
    model_dir: str | Path,
    max_memory_bytes: int,
    offload_folder: str | Path,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Load ``model_dir`` with accelerate's big-model dispatch: at most ``max_memory_bytes`` on "cpu", the rest on disk.

    Raises ``RuntimeError`` (with the device map) if no module was placed on disk. The load time is stored on
    the model as ``hf_load_seconds``.
    """
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=dtype,  # transformers 5 name (torch_dtype is deprecated)
        device_map="auto",
        max_memory={"cpu": int(max_memory_bytes)},
        offload_folder=str(offload_folder),  # offload_state_dict is gone in transformers 5 (silently dropped)
    ).eval()
    model.hf_load_seconds = time.perf_counter() - t0
    device_map = getattr(model, "hf_device_map", None) or {}
    if "disk" not in device_map.values():
        raise RuntimeError(f"max_memory={max_memory_bytes} B put no module on disk; hf_device_map={device_map}")
    return model


def device_map_summary(model: PreTrainedModel) -> dict[str, int]:
    """Number of ``hf_device_map`` entries per device, e.g. ``{"cpu": 2, "disk": 30}`` (``{}`` without a map).

    A whole model on one device is one entry, ``{"": "disk"}`` -> ``{"disk": 1}``.
    """
    counts = Counter(str(d) for d in (getattr(model, "hf_device_map", None) or {}).values())
    return dict(sorted(counts.items()))


def _offload_loaders(model: torch.nn.Module) -> list[OffloadedWeightsLoader]:
    """The distinct ``OffloadedWeightsLoader`` behind the model's offload hooks (unwrapping ``PrefixedDataset``)."""
    loaders: dict[int, OffloadedWeightsLoader] = {}
    for module in model.modules():
        weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        loader = getattr(weights_map, "dataset", weights_map)
        if isinstance(loader, OffloadedWeightsLoader):
            loaders[id(loader)] = loader
    return list(loaders.values())


def _safetensors_nbytes(path: str | Path) -> dict[str, int]:
    """Stored byte size of every tensor in a safetensors file, from its header (no tensor is read)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _disk_entries(model: torch.nn.Module) -> Iterator[tuple[str, Path]]:
    """(weight name, file holding it) for every disk-offloaded weight: a safetensors file or a ``.dat`` memmap."""
    for loader in _offload_loaders(model):
        for name, info in loader.index.items():
            if info.get("safetensors_file") is not None:
                yield info.get("weight_name", name), Path(info["safetensors_file"])
            elif loader.save_folder is not None:
                yield name, Path(loader.save_folder) / f"{name}.dat"


def offloaded_files(model: torch.nn.Module) -> list[Path]:
    """Files the disk-offloaded weights are read from during forward (the checkpoint itself for safetensors)."""
    return sorted({path for _, path in _disk_entries(model)})


def disk_bytes(model: torch.nn.Module) -> int:
    """Stored bytes of the disk-offloaded weights (in the file's dtype, float16 for our checkpoint)."""
    headers: dict[Path, dict[str, int]] = {}
    total = 0
    for name, path in _disk_entries(model):
        if path.suffix == ".safetensors":
            if path not in headers:
                headers[path] = _safetensors_nbytes(path)
            total += headers[path][name]
        else:
            total += path.stat().st_size
    return total


# ---- page cache --------------------------------------------------------------------------------
def _files_under(paths: Iterable[str | Path]) -> Iterator[Path]:
    """Every regular file named in ``paths`` or below a directory named in it."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from (f for f in sorted(p.rglob("*")) if f.is_file())
        elif p.is_file():
            yield p


def drop_page_cache(paths: Iterable[str | Path], *, global_drop: bool = False) -> None:
    """Evict the page cache of every file under ``paths`` so the next reads come from disk.

    Per file: ``fdatasync`` (dirty pages cannot be dropped) then ``posix_fadvise(POSIX_FADV_DONTNEED)``. Pages
    still mapped by a live mmap (in any process) stay cached. ``global_drop=True`` also writes 1 to
    ``/proc/sys/vm/drop_caches`` when writable (root; ``common.drop_caches``) - off by default because it evicts
    every process's cache on a shared machine; failures are ignored.
    """
    _evict(paths, global_drop)


def _evict(paths: Iterable[str | Path], global_drop: bool = False) -> None:
    """``drop_page_cache`` under a name that ``generate_hf``'s ``drop_page_cache`` flag does not shadow."""
    for path in _files_under(paths):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    if global_drop:
        drop_caches()


def resident_bytes(path: str | Path) -> int | None:
    """Bytes of ``path`` currently in the page cache (util-linux ``fincore``), or None if it is unavailable."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


# ---- generation --------------------------------------------------------------------------------
def left_pad(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``[batch, max_len]`` int64, prompts right-aligned (left padding)."""
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)  # [batch, max_len]
    attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)  # [batch, max_len]
    for row, ids in enumerate(prompt_ids):
        if ids:
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


@contextlib.contextmanager
def _eos_disabled(model: PreTrainedModel) -> Iterator[None]:
    """Temporarily set ``model.generation_config.eos_token_id = None`` (a None kwarg would be refilled from it)."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def generate_hf(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    pad_token_id: int,
    drop_page_cache: bool = True,
    *,
    cold_every_step: bool = False,
) -> HFOffloadRun:
    """Greedy ``generate()`` on ``prompt_ids`` in chunks of ``batch_size``; every row yields ``max_new_tokens``.

    With ``drop_page_cache`` the files behind the disk-offloaded weights are evicted before each generate() call
    (outside the timed region); ``cold_every_step`` also evicts them before every forward (inside it), so every
    step reads its weights from disk rather than the page cache.
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    files = offloaded_files(model)
    hook = model.register_forward_pre_hook(lambda *_: _evict(files)) if cold_every_step and files else None
    tokens: list[list[int]] = []
    seconds = 0.0
    cached: int | None = None
    try:
        with _eos_disabled(model), torch.inference_mode():
            for start in range(0, len(prompt_ids), batch_size):
                input_ids, attention_mask = left_pad(prompt_ids[start:start + batch_size], pad_token_id)
                if drop_page_cache:
                    _evict(files)
                    cached = _max_or_none(cached, _total_resident(files))
                t0 = time.perf_counter()
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                     max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
                seconds += time.perf_counter() - t0
                tokens.extend(out[:, input_ids.shape[1]:].tolist())  # [batch, max_new_tokens]
    finally:
        if hook is not None:
            hook.remove()
    if any(len(t) != max_new_tokens for t in tokens):
        raise RuntimeError(f"generate() stopped early: lengths {[len(t) for t in tokens]} != {max_new_tokens}")
    return HFOffloadRun(
        tokens=tokens,
        generated_tokens=sum(len(t) for t in tokens),
        seconds=seconds,
        load_seconds=float(getattr(model, "hf_load_seconds", 0.0)),
        device_map_summary=device_map_summary(model),
        disk_bytes=disk_bytes(model),
        batch_size=batch_size,
        cached_bytes_after_drop=cached,
    )


def _total_resident(files: list[Path]) -> int | None:
    """Summed page-cache residency of ``files``; None if any is unmeasurable."""
    sizes = [resident_bytes(f) for f in files]
    return None if any(s is None for s in sizes) else sum(sizes)


def _max_or_none(a: int | None, b: int | None) -> int | None:
    """Max of two optional ints (None only if both are None)."""
    return b if a is None else a if b is None else max(a, b)


# ---- CLI smoke check ---------------------------------------------------------------------------
def _prompt_ids(model_dir: Path, n: int) -> tuple[list[list[int]], int]:
    """The first ``n`` HumanEval prompts encoded with the model's tokenizer, and its pad id."""
    from specoffload.runtime.prompts import humaneval_prompts

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return [tok(p)["input_ids"] for p in humaneval_prompts(n)], pad


def _rss_gb() -> float:
    """Resident set size of this process in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def main() -> None:
    """Load with disk offload, generate, print throughput and placement; optionally compare with an in-RAM load."""
    from scripts.get_models import model_dir as default_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=None, help="checkpoint (default: the target model)")
    ap.add_argument("--max-memory", default="2GiB", help="cpu memory budget, e.g. 2GiB or 1500MB")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--cold-every-step", action="store_true", help="drop the page cache before every forward")
    ap.add_argument("--check-ram", action="store_true",
                    help="then load the model fully in RAM (no device_map; 7.1 GB in float32, peak RSS 11 GB "
                         "with the mmapped checkpoint pages) and compare greedy tokens on 1 prompt x 8")
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    mdir = args.model_dir or default_model_dir("target")
    prompts, pad = _prompt_ids(mdir, args.prompts)
    folder = Path(tempfile.mkdtemp(prefix="hf_offload_", dir="/tmp"))
    try:
        model = load_hf_disk_offload(mdir, convert_file_size_to_int(args.max_memory), folder, DTYPES[args.dtype])
        files = offloaded_files(model)
        print(f"loaded in {model.hf_load_seconds:.1f} s; device map {device_map_summary(model)}; "
              f"cpu modules {[k for k, v in model.hf_device_map.items() if v == 'cpu']}; "
              f"disk bytes {disk_bytes(model) / 1e9:.2f} GB in {[str(f) for f in files]}; "
              f"offload folder holds {sum(f.stat().st_size for f in _files_under([folder]))} B; "
              f"RSS {_rss_gb():.2f} GB", flush=True)
        run = generate_hf(model, prompts, args.max_new_tokens, args.batch, pad, cold_every_step=args.cold_every_step)
        print(f"batch {run.batch_size}: {run.generated_tokens} tokens in {run.seconds:.1f} s = "
              f"{run.tokens_per_second:.3f} tok/s; cached after drop {run.cached_bytes_after_drop} B, "
              f"after run {[resident_bytes(f) for f in files]} B; "
              f"RSS {_rss_gb():.2f} GB", flush=True)
        if args.check_ram:
            one = generate_hf(model, prompts[:1], 8, 1, pad).tokens
            del model
            gc.collect()
            ram = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=DTYPES[args.dtype]).eval()
            ref = generate_hf(ram, prompts[:1], 8, 1, pad, drop_page_cache=False).tokens
            print(f"offloaded {one[0]}\nin RAM    {ref[0]}\nidentical: {one == ref}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
