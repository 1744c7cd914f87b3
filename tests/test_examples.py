"""Every example in examples/ runs with its one command and says what it should."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def run_example(name: str, nprocs: int = 2, args: tuple[str, ...] = (), timeout: float = 300
                ) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpidag.run", "-n", str(nprocs), str(ROOT / "examples" / name),
         *args],
        capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_demo_is_the_design_document_example():
    proc = run_example("demo.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "gradient of t1: distributed | local" in out
    assert "largest difference to local autograd: 0.00e+00" in out
    assert "[worker1] shut down cleanly" in out


def test_rpc_tour():
    proc = run_example("rpc_tour.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "remote exception re-raised with its type: ZeroDivisionError" in proc.stdout


@pytest.mark.parametrize("nprocs", [2])
def test_examples_fail_loudly_on_a_bad_world(nprocs, tmp_path):
    """A sanity check of the harness itself: a failing rank makes the job fail."""
    bad = tmp_path / "bad.py"
    bad.write_text("import mpidag.rpc as rpc\nrpc.init_rpc()\nraise SystemExit(3)\n")
    proc = subprocess.run([sys.executable, "-m", "mpidag.run", "-n", str(nprocs), str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0


@pytest.mark.parametrize("nprocs", [2, 3])
def test_distributed_optimizer_example(nprocs):
    proc = run_example("dist_optim_example.py", nprocs=nprocs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(nprocs):
        assert f"[worker{rank}] the SGD step on worker{(rank + 1) % nprocs} moved each value " \
               f"by 0.0500" in proc.stdout
