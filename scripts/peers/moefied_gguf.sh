#!/usr/bin/env bash
# The moefied MoE (scripts/make_moe.py moefy) as a Q4_K_M GGUF made by llama.cpp's own tools, for the peers bench's
# budget case (scripts/bench_peers.py --budget --gguf FILE): convert_hf_to_gguf.py from the llama.cpp source that
# llama-cpp-python's PyPI source distribution vendors (bf16 GGUF), then llama.cpp's quantizer (llama_model_quantize,
# through the peer venv of scripts/setup_llamacpp.sh) to Q4_K_M with its output tensor (the untied 151936 x 1536 head)
# in Q4_K instead of the recipe's Q6_K (llama-quantize's --output-tensor-type q4_k): our engine streams a Q6_K tensor
# decoded into a 16-bit ring slot (467 MB for this head, twice in the ring), so with Q6_K its smallest budget, 1.08
# GiB, leaves no memory limit below the 1.33 GiB file for both engines; Q4_K stays packed in the slot. Idempotent;
# prints the GGUF's path.
# Usage: scripts/peers/moefied_gguf.sh [MODEL_DIR]   (default: the moefied checkpoint in the model cache)
# The moefied shared expert's gate is zero (sigmoid 0.5), and llama.cpp's qwen2moe graph computes that sigmoid as
# silu(x) / x: 0 / 0, NaN logits at every position. Its weights are set to 2^-100 in the bf16 GGUF before quantizing
# (`shared_gate`): a gate logit of about 1e-30, whose sigmoid is 0.5 exactly in float32 and bfloat16, and whose
# silu(x) / x is 0.5 too, so both engines run the zero-gate model (our engine computes the same outputs on either).
# Note: llama.cpp's qwen2moe graph weighs the top-k experts by their softmax probabilities without renormalizing them
# (the converter writes no expert_weights_norm for this architecture); our engine reads the same GGUF the same way
# (runtime/models/gguf.py: transformers' Qwen2-MoE default, norm_topk_prob false). Both run this GGUF's model, which
# differs from the safetensors checkpoint's (norm_topk_prob true).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
peers="${SPECOFFLOAD_PEERS:-$HOME/.cache/specoffload/peers}"
version="${LLAMACPP_VERSION:-0.3.36}"
model="${1:-${SPECOFFLOAD_CACHE:-$HOME/.cache/specoffload/models}/qwen2.5-coder-1.5b-moefied}"
out="$peers/gguf/$(basename "$model")-q4_k_m-q4khead-shgate.gguf"
if [ -s "$out" ]; then echo "$out"; exit 0; fi
python="$("$root/scripts/setup_llamacpp.sh" | tail -n 1)"
src="$peers/src/llama_cpp_python-$version"
if [ ! -f "$src/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  mkdir -p "$peers/src"
  "$root/.venv/bin/python" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps \
    -d "$peers/src" "llama-cpp-python==$version" >&2
  tar xzf "$peers/src/llama_cpp_python-$version.tar.gz" -C "$peers/src"
fi
mkdir -p "$peers/gguf"
bf16="$peers/gguf/$(basename "$model")-bf16.gguf"
if [ ! -s "$bf16" ]; then
  # the converter runs on the repository's venv (torch, transformers, safetensors) with the vendored gguf-py
  PYTHONPATH="$src/vendor/llama.cpp/gguf-py" "$root/.venv/bin/python" "$src/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "$model" --outtype bf16 --outfile "$bf16.part" >&2
  mv "$bf16.part" "$bf16"
fi
# shared_gate: every blk.N.ffn_gate_inp_shexp.weight that is all zeros becomes 2^-100 (in place; idempotent)
PYTHONPATH="$src/vendor/llama.cpp/gguf-py" "$root/.venv/bin/python" - "$bf16" >&2 <<'PY'
import sys

import numpy as np
from gguf import GGUFReader

reader = GGUFReader(sys.argv[1], "r+")
patched = 0
for tensor in reader.tensors:
    if tensor.name.endswith("ffn_gate_inp_shexp.weight") and not np.any(tensor.data):
        tensor.data[...] = np.float32(2.0**-100)
        patched += 1
reader.data.flush()
print(f"shared_gate: {patched} zero shared-expert gates set to 2^-100", file=sys.stderr)
PY
"$python" - "$bf16" "$out.part" >&2 <<'PY'
import ctypes
import sys

import llama_cpp

params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.output_tensor_type = llama_cpp.GGML_TYPE_Q4_K
params.nthread = 2
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) != 0:
    sys.exit("llama_model_quantize failed")
PY
mv "$out.part" "$out"
echo "$out"
