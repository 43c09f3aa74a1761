#!/usr/bin/env bash
# Build llama.cpp's Python binding (llama-cpp-python, from its PyPI source distribution, compiled for this CPU) into a
# virtual environment of its own, outside the repository, for scripts/bench_peers.py. Not part of the two README
# commands: an optional peer. Idempotent. Usage: scripts/setup_llamacpp.sh   (prints the venv's python)
# $SPECOFFLOAD_PEERS moves the venv (default ~/.cache/specoffload/peers); $LLAMACPP_VERSION pins another release.
set -euo pipefail
peers="${SPECOFFLOAD_PEERS:-$HOME/.cache/specoffload/peers}"
version="${LLAMACPP_VERSION:-0.3.36}"
venv="$peers/llamacpp-$version"
# a native build runs only on the CPU it was built for (another one may lack an instruction it uses: SIGILL, or a
# path that computes garbage): the build is stamped with this CPU's model and flags, and rebuilt when they differ
# No AMX: ggml's AMX kernels (compiled in wherever -march=native offers AMX) ran `tilezero` without the tile-data
# permission on the Xeon VM and died of SIGILL (its one-sequence path); the AVX-512 kernels remain
amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake_args="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$amx_off' -DCMAKE_CXX_FLAGS='$amx_off'"
cpu="$(grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo; echo "$cmake_args")"
cpu_id="$(printf '%s' "$cpu" | sha256sum | cut -c1-16)"
stamp="$venv/.built-for-cpu"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null \
    || [ "$(cat "$stamp" 2>/dev/null)" != "$cpu_id" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q numpy
  # -DGGML_NATIVE=ON: the build uses this CPU's instruction set (AVX-512, BF16, ...), as llama.cpp users build it;
  # --no-cache-dir: pip's wheel cache would hand back a wheel compiled on another CPU
  CMAKE_ARGS="$cmake_args" "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-cache-dir --no-binary :all: \
    "llama-cpp-python==$version" >&2
  echo "$cpu_id" > "$stamp"
fi
echo "$venv/bin/python"
