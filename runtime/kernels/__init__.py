"""Native kernels the engine builds for the machine it runs on: ggml.c, `y = x @ W^T` over llama.cpp's q4_k / q6_k
blocks and float16 rows as a GGUF stores them, the same weights dequantized into a 16-bit or float32 copy, and
float16 <-> bfloat16 conversion (runtime/cast.py: a float16 tensor streamed for bfloat16 compute) (its header says how).

The C source ships with the package and is compiled on first use by the system's C compiler (`$CC`, else `cc`) with
`-O3 -march=native -ffp-contract=off` into a shared library cached under `$SPECOFFLOAD_KERNEL_CACHE` (default
~/.cache/specoffload/kernels), in a folder named by a hash of the source, the compiler, the flags and the CPU's
model and flags: another CPU or another source gets its own build, and a build is written under a temporary name
and renamed, so processes starting together do not read a half-written library. It is loaded with ctypes (which
releases the GIL for the call: the loader thread keeps reading while a layer multiplies) and checked once on a
probe (`probe`: its products against its own dequantization, its conversion against torch's; and by
runtime/formats/ggml.py `block_kernel`, its decoding against the Python reference, before a weight is kept as
blocks); a library that fails either is not used.

No compiler, a failed build or a failed probe: `ggml_kernel()` is None, said once in the log, and the formats fall
back to what they did without it (q4_k repacked for torch's int4 kernel, q6_k dequantized into the slot).
`SPECOFFLOAD_GGML_KERNEL=off` turns the kernel off (a baseline for benchmarks); `=generic` builds the portable
path of ggml.c instead of its vector one, AVX-512 or AVX2 (tests of that path; `GGMLKernel.isa` says which).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ggml.c")
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")
NATIVE = ("-march=native",)
BUILD_TIMEOUT_S = 300
#: ggml.c's kinds, by GGML type name (lower case)
KINDS = {"q4_k": 0, "q6_k": 1, "f16": 2}
#: inputs per block of each kind (an f16 "block" is one value)
BLOCK_INPUTS = {"q4_k": 256, "q6_k": 256, "f16": 1}
#: bytes of a block of each kind, and the byte offsets of its float16 scales (runtime/formats/ggml.py's layouts)
BLOCK_LAYOUT = {"q4_k": (144, (0, 2)), "q6_k": (210, (208,)), "f16": (2, ())}
#: inputs of the probe's weights (`probe`, runtime/formats/ggml.py `block_kernel`): two k-quant blocks
PROBE_INPUTS = 512
#: ggml.c's `specoffload_ggml_vector()`: the vector path a build has
ISAS = {1: "avx512", 2: "avx2", 0: "portable"}
#: ggml.c's `round`: the dtype each decoded weight is rounded to
ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECOFFLOAD_KERNEL_CACHE", Path.home() / ".cache" / "specoffload" / "kernels"))


def mode() -> str:
    """$SPECOFFLOAD_GGML_KERNEL: "on" (default), "off" or "generic" (module docstring)."""
    value = os.environ.get("SPECOFFLOAD_GGML_KERNEL", "on").strip().lower()
    return {"0": "off", "false": "off", "no": "off", "1": "on", "true": "on", "yes": "on"}.get(value, value)


def _cpu_signature() -> str:
    """The CPU's model name and flags (what -march=native compiles for)."""
    lines = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    lines.append(line.strip())
                if len(lines) >= 3:
                    break
    except OSError:
        pass
    return "\n".join(lines) or platform.processor() or platform.machine()


def _compiler() -> tuple[str, str] | None:
    """(compiler path, its version line), or None when there is none."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return cc, (version.splitlines() or [""])[0]


def build(generic: bool = False, decoded: bool = False, no_dot: bool = False,
          source: bytes | None = None) -> Path | None:
    """The compiled library for this source (`source`: another ggml.c's text, e.g. an older revision's for a
    benchmark), compiler and CPU (built now if not cached), or None (logged).
    generic: without a vector path; decoded: the AVX2 path decoding every weight with float32 weights too, not
    factoring the sums (ggml.c `tile_factored`; the baseline it is measured against); no_dot: the AVX-512 path
    without AVX512-BF16's pair products for bfloat16 weights (ggml.c `tile_dot`; its baseline)."""
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler ($CC or cc): GGUF q4_k / q6_k weights are converted for torch's kernels instead")
        return None
    cc, version = compiler
    given = source is not None
    source, cpu = source if given else SOURCE.read_bytes(), _cpu_signature().encode()
    defines = (*(("-DSPECOFFLOAD_GENERIC",) if generic else ()), *(("-DSPECOFFLOAD_DECODED",) if decoded else ()),
               *(("-DSPECOFFLOAD_NO_DOT",) if no_dot else ()))
    for arch in (NATIVE, ()):  # (a compiler without -march=native: the portable flags)
        flags = (*FLAGS, *arch, *defines)
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(), cpu])).hexdigest()[:16]
        lib = cache_dir() / key / "ggml.so"
        if lib.exists():
            return lib
        lib.parent.mkdir(parents=True, exist_ok=True)
        src = SOURCE
        if given:  # (the text beside its library)
            src = lib.parent / SOURCE.name
            src.write_bytes(source)
        fd, tmp = tempfile.mkstemp(prefix=".ggml-", suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, str(src)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            done = subprocess.CompletedProcess([cc], 1, "", str(e))
        if done.returncode == 0:
            os.replace(tmp, lib)
            return lib
        Path(tmp).unlink(missing_ok=True)
        log.info("building %s with %s %s failed: %s", SOURCE.name, cc, " ".join(flags),
                 (done.stderr or "").strip().splitlines()[-1:] or "")
    return None


@dataclass(frozen=True)
class GGMLKernel:
    """The loaded ggml.c: `matmul` multiplies by a q4_k / q6_k weight's blocks or an f16 weight's rows."""

    lib: ctypes.CDLL
    path: Path

    @property
    def vector(self) -> bool:
        """The library runs a vector path, AVX-512 or AVX2 (False: the portable one)."""
        return self.isa != "portable"

    @property
    def isa(self) -> str:
        """The path the library was built with for this CPU: "avx512", "avx2" or "portable"."""
        return ISAS.get(self.lib.specoffload_ggml_vector(), "portable")

    @property
    def dot(self) -> bool:
        """q4_k / q6_k weights in bfloat16 are multiplied by pairs with AVX512-BF16's `vdpbf16ps` (ggml.c
        `tile_dot`)."""
        return hasattr(self.lib, "specoffload_ggml_dot") and bool(self.lib.specoffload_ggml_dot())

    def matmul(self, kind: str, blocks: torch.Tensor, x: torch.Tensor, threads: int | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32; W [N, K] as `kind` blocks, uint8 [N, K / block inputs * block
        bytes], each weight rounded to `dtype` (the weight `dequantize` gives in that dtype); in bfloat16 x is
        rounded to bfloat16 too (a bfloat16 GEMM's operands; the engine's activations are bfloat16 then)."""
        if x.dtype != torch.float32 or x.dim() != 2:
            raise ValueError(f"ggml matmul takes float32 x [M, K], got {x.dtype} {list(x.shape)}")
        blocks = self._blocks(blocks)
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty(m, blocks.shape[0], dtype=torch.float32)
        rc = self.lib.specoffload_ggml_matmul(KINDS[kind], blocks.data_ptr(), blocks.shape[0], k, x.data_ptr(), m,
                                              y.data_ptr(), threads or torch.get_num_threads(), ROUNDING[dtype])
        self._check(rc, kind, k)
        return y

    def dequantize(self, kind: str, blocks: torch.Tensor, inputs: int, dtype: torch.dtype,
                   threads: int | None = None) -> torch.Tensor:
        """W [N, inputs] in `dtype` (float32, bfloat16 or float16: llama.cpp's float32 values rounded once)."""
        blocks = self._blocks(blocks)
        out = torch.empty(blocks.shape[0], inputs, dtype=dtype)
        rc = self.lib.specoffload_ggml_dequantize(KINDS[kind], blocks.data_ptr(), blocks.shape[0], inputs,
                                                  out.data_ptr(), threads or torch.get_num_threads(), ROUNDING[dtype])
        self._check(rc, kind, inputs)
        return out

    def convert(self, dest: torch.Tensor, src: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """dest.copy_(src) between float16 and bfloat16 (contiguous CPU tensors of as many elements), as torch rounds
        but for NaN payloads; returns dest."""
        pair = (src.dtype, dest.dtype)
        if pair not in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)) or not (
                src.is_contiguous() and dest.is_contiguous() and src.numel() == dest.numel()):
            raise ValueError(f"convert takes contiguous float16 / bfloat16 tensors of one size, got {pair}")
        rc = self.lib.specoffload_convert_16(src.data_ptr(), dest.data_ptr(), src.numel(),
                                             int(dest.dtype == torch.bfloat16), threads or torch.get_num_threads())
        if rc == -1:
            raise ValueError(f"this build of the kernel cannot convert {src.dtype} to {dest.dtype}")
        return dest

    @staticmethod
    def _blocks(blocks: torch.Tensor) -> torch.Tensor:
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.device.type != "cpu":
            raise ValueError(f"the ggml kernel takes uint8 blocks [N, bytes] on the CPU, got {blocks.dtype} "
                             f"{list(blocks.shape)} on {blocks.device}")
        return blocks if blocks.is_contiguous() else blocks.contiguous()

    @staticmethod
    def _check(rc: int, kind: str, inputs: int) -> None:
        if rc == -3:
            raise MemoryError("the ggml kernel could not allocate x's bfloat16 copy")
        if rc == -1:
            raise ValueError(f"the ggml kernel cannot take {kind} blocks of {inputs} inputs (whole blocks of "
                             f"{BLOCK_INPUTS[kind]}) in this dtype")


def _load(path: Path) -> GGMLKernel:
    lib = ctypes.CDLL(str(path))
    lib.specoffload_ggml_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                            ctypes.c_int]
    lib.specoffload_ggml_matmul.restype = ctypes.c_int
    lib.specoffload_ggml_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.specoffload_ggml_dequantize.restype = ctypes.c_int
    lib.specoffload_convert_16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.specoffload_convert_16.restype = ctypes.c_int
    lib.specoffload_ggml_vector.restype = ctypes.c_int
    if hasattr(lib, "specoffload_ggml_dot"):  # (a build of an older ggml.c, for a benchmark, has none)
        lib.specoffload_ggml_dot.restype = ctypes.c_int
    return GGMLKernel(lib, path)


def probe(kernel: GGMLKernel) -> bool:
    """On random blocks of every kind (3 rows, 5 outputs, PROBE_INPUTS inputs) the kernel's products with weights
    rounded to each dtype equal x @ W^T for its own dequantization in that dtype (to float32 rounding), and its
    16-bit conversion of every class of value is torch's. (That its decoding is llama.cpp's is checked by
    runtime/formats/ggml.py, which holds the Python reference, before it keeps a weight as blocks.)"""
    g = torch.Generator().manual_seed(0)
    for kind in KINDS:
        blocks = random_blocks(kind, 5, PROBE_INPUTS // BLOCK_INPUTS[kind], g)  # [N, nb * bytes]
        x = torch.randn(3, PROBE_INPUTS, generator=g)
        for dtype in ROUNDING:
            w = kernel.dequantize(kind, blocks, PROBE_INPUTS, dtype, threads=2)  # [N, K]
            xq = x.to(dtype) if dtype == torch.bfloat16 else x  # (the kernel takes x in bfloat16 then)
            want = xq.double() @ w.double().T
            got = kernel.matmul(kind, blocks, x, threads=2, dtype=dtype).double()
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
                return False
    bits = torch.randint(-(1 << 15), 1 << 15, (1000,), generator=g, dtype=torch.int16)  # every class of value
    for src_dtype, dest_dtype in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        src = bits.view(src_dtype)
        want, got = src.to(dest_dtype), kernel.convert(torch.empty(1000, dtype=dest_dtype), src, threads=2)
        if not (torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])):
            return False
    return True


def random_blocks(kind: str, rows: int, blocks: int, g: torch.Generator) -> torch.Tensor:
    """uint8 [rows, blocks * block bytes]: random `kind` blocks whose float16 scales are finite and small (f16:
    finite values)."""
    nbytes, scales = BLOCK_LAYOUT[kind]
    if kind == "f16":
        return (torch.randn(rows, blocks, generator=g) * 0.05).to(torch.float16).view(torch.uint8)
    raw = torch.randint(0, 256, (rows, blocks, nbytes), generator=g, dtype=torch.uint8)
    for at in scales:
        d = (torch.rand(rows, blocks, generator=g) * 0.01).to(torch.float16)
        raw[..., at : at + 2] = d.view(torch.uint8).view(rows, blocks, 2)
    return raw.view(rows, -1)


@functools.cache
def ggml_kernel() -> GGMLKernel | None:
    """The ggml.c kernel for this machine, built and probed once per process; None where it is off or cannot be
    had (module docstring)."""
    setting = mode()
    if setting == "off":
        return None
    if setting not in ("on", "generic"):
        log.warning("SPECOFFLOAD_GGML_KERNEL=%s is not on, off or generic: using on", setting)
    path = build(generic=setting == "generic")
    if path is None:
        return None
    try:
        kernel = _load(path)
    except OSError as e:
        log.info("loading %s failed (%s): the ggml kernel is off", path, e)
        return None
    if not probe(kernel):
        log.warning("%s disagrees with the Python dequantization on a probe: the ggml kernel is off", path)
        return None
    return kernel
