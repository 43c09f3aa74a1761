#!/usr/bin/env bash
# Build llama.cpp's Python binding (llama-cpp-python, from its PyPI source distribution, compiled for this CPU) into a
# virtual environment of its own, outside the repository, for scripts/bench_peers.py. Not part of the two README
# commands: an optional peer. Idempotent. Usage: scripts/setup_llamacpp.sh   (prints the venv's python)
# $SPECOFFLOAD_PEERS moves the venv (default ~/.cache/specoffload/peers); $LLAMACPP_VERSION pins another release.
set -euo pipefail
peers="${SPECOFFLOAD_PEERS:-$HOME/.cache/specoffload/peers}"
version="${LLAMACPP_VERSION:-0.3.36}"
venv="$peers/llamacpp-$version"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q numpy
  # -DGGML_NATIVE=ON: the build uses this CPU's instruction set (AVX-512, BF16, ...), as llama.cpp users build it
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-binary :all: \
    "llama-cpp-python==$version" >&2
fi
echo "$venv/bin/python"
