"""Memory flat per job (issue 39, case 4): a finished row leaves counters behind, not objects, so a job of 100k tiny
rows peaks within 50 MB of a 1k-row job (each run in a process of its own, peak RSS). Before, every finished
Request stayed in the pipeline's `done` list and every row's chunk state in the local backend's index: ~3.8 KB a
row, 380 MB at 100k rows.
"""

from __future__ import annotations

import json
import subprocess
import sys

PEAK = """
import resource, sys
from specoffload.runtime.cli import main
try:
    code = main(sys.argv[1:])
finally:
    print("peak_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def _peak_mb(model, rows: int, tmp_path) -> float:  # noqa: ANN001
    prompts = tmp_path / f"rows{rows}.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [1, 5 + i % 100]}) + "\n" for i in range(rows)))
    out = tmp_path / f"out{rows}.jsonl"
    done = subprocess.run([sys.executable, "-c", PEAK, "generate", "--model", str(model), "--prompts", str(prompts),
                           "-o", str(out), "--batch-size", "256", "--max-tokens", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sum(1 for _ in out.open()) == rows
    peak = [line for line in done.stderr.splitlines() if line.startswith("peak_kb")]
    return int(peak[-1].split()[1]) / 1024


def test_a_100k_row_job_peaks_within_50_mb_of_a_1k_row_job(tiny_models, tmp_path) -> None:
    small = _peak_mb(tiny_models["llama"], 1_000, tmp_path)
    large = _peak_mb(tiny_models["llama"], 100_000, tmp_path)
    assert large - small < 50, f"peak {large:.0f} MB at 100k rows vs {small:.0f} MB at 1k rows"
