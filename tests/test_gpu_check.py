"""scripts/gpu_check.py on a machine without a GPU: one line and exit status 2; its CPU dry run of the realistic
part runs end to end (the oracle draft's forced acceptance holds, the summary has the issue's ratios)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_it_stops_with_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "g.json")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "sees no CUDA GPU" in lines[0], run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "g.json").exists()


def test_cpu_dry_run_of_the_realistic_part(tmp_path, single_thread):
    from scripts import gpu_check

    out = tmp_path / "g.json"
    rc = gpu_check.main(["--device", "cpu", "--skip-correctness", "--skip-hf", "--layers", "2", "--new-tokens", "12",
                         "--prompt-len", "24", "--accept", "0.8", "--batches", "4", "--draft-cases", "4:3",
                         "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    runs = {r["system"]: r for r in report["realistic"]["runs"]}
    assert set(runs) == {"no draft b=4", "draft b=4 k=3"}
    # per-token acceptance 0.8 over k = 3 drafts: accepted / drafted = (0.8 + 0.64 + 0.512) / 3 = 0.65 in
    # expectation (rows near their end draft fewer); a failed oracle (wrong reference) would sit near 0
    assert 0.4 < runs["draft b=4 k=3"]["acceptance"] < 0.9
    assert runs["draft b=4 k=3"]["tokens_per_row_pass"] > 1.5
    summary = report["summary"]
    assert summary["nodraft_io_over_compute"] >= 0  # (on the CPU the ram tier's copies are the io thread's)
    for key in ("nodraft_best_tok_s", "draft_over_nodraft", "nodraft_overlap_efficiency"):
        assert summary[key] > 0, key
