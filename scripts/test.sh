#!/usr/bin/env bash
# Install everything into ./.venv (idempotent) and run the linter and the test suite on the CPU.
# Extra arguments go to pytest, e.g. scripts/test.sh -k verify (-n 0: one process, in order).
# The suite runs in min(cores, 4) pytest-xdist workers (SPECOFFLOAD_TEST_WORKERS overrides the count), a test file at
# a time, the files that use Ray as one unit, in order, on one worker (tests/conftest.py RAY_FILES).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_venv.sh" dev models
venv="${SPECOFFLOAD_VENV:-$root/.venv}"
cd "$root"
"$venv/bin/ruff" check actors runtime planner tests scripts
cores="$(nproc)"
workers="${SPECOFFLOAD_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
exec "$venv/bin/python" -m pytest -n "$workers" --dist loadfile "$@"
