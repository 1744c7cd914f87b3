"""8 ranks on this 2-core machine (oversubscribed): init, calls between every pair, a nested
chain through every rank, RRef forks to every rank, a backward pass visiting every rank, an
optimizer step over a parameter on every rank, no leaks, graceful shutdown
(``benchmarks/scale_check.py``; 16 and 32 ranks are in benchmarks/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_everything_at_8_ranks(tmp_path):
    out = tmp_path / "scale_8.json"
    run = subprocess.run([sys.executable, "-m", "mpidag.run", "-n", "8",
                          str(ROOT / "benchmarks" / "scale_check.py"), "--out", str(out),
                          "--timeout", "240"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK scale_check ranks=8" in run.stdout, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["ranks"] == 8
    assert set(report["slowest_rank_seconds"]) == {
        "init_rpc_s", "pairs_s", "nested_chain_s", "rref_forks_s", "backward_s",
        "optimizer_step_s", "shutdown_s"}
