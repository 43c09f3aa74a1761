#!/usr/bin/env bash
# Install everything into ./.venv (idempotent) and run the linter and the test suite on the CPU.
# Extra arguments go to pytest, e.g. scripts/test.sh -k verify
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_venv.sh" dev models
venv="${SPECOFFLOAD_VENV:-$root/.venv}"
cd "$root"
"$venv/bin/ruff" check actors runtime planner tests scripts
exec "$venv/bin/python" -m pytest "$@"
