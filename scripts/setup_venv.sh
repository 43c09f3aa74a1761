#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install SpecOffload into it.
# Idempotent: a second run with nothing changed only checks that the install imports.
# Usage: scripts/setup_venv.sh [extra ...]   e.g. scripts/setup_venv.sh dev models
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPECOFFLOAD_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
extras="$(IFS=,; echo "$*")"
stamp="$venv/.specoffload-installed-${extras:-none}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# Stamp is invalidated when pyproject.toml or the constraints change.
want="$(cat "$root/pyproject.toml" "$root/scripts/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import specoffload.runtime" 2>/dev/null; then
  exit 0
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# torch first: on these machines torch==2.13.0 is a CPU build from local disk; a bare `torch`
# requirement would pull a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -c "$root/scripts/constraints.txt" -e "$root${extras:+[$extras]}"
echo "$want" > "$stamp"
