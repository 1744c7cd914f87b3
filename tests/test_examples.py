"""Every example in examples/ runs with its one command and says what it should."""

from __future__ import annotations

import os
import re
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


def ok_line(proc: subprocess.CompletedProcess, name: str) -> str:
    """The example's one ``OK name:`` line, after checking that the job succeeded."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith(f"OK {name}:")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return lines[0]


def numbers(line: str, pattern: str) -> tuple[float, ...]:
    match = re.search(pattern, line)
    assert match, f"{pattern!r} not in {line!r}"
    return tuple(float(g) for g in match.groups())


@pytest.mark.parametrize("nprocs", [2, 3])
def test_parameter_server(nprocs):
    proc = run_example("parameter_server.py", nprocs=nprocs,
                       args=("--steps", "30", "--batch", "32"))
    line = ok_line(proc, "parameter_server")
    assert f"world_size={nprocs} trainers={nprocs - 1} steps=30 batch=32 " in line
    first, last = numbers(line, r" loss (\d+\.\d+) -> (\d+\.\d+) ")
    assert last < first
    before, after = numbers(line, r" held_out_loss (\d+\.\d+) -> (\d+\.\d+) ")
    assert after < before
    (diff,) = numbers(line, r" grad_check_max_diff=(\S+)")
    assert diff < 1e-5
    for rank in range(1, nprocs):
        assert f"[trainer_{rank}] step 1: distributed gradients match local autograd" \
            in proc.stdout
        assert f"[trainer_{rank}] step 30/30 loss " in proc.stdout


@pytest.mark.parametrize("nprocs", [2, 3])
def test_rl_agent(nprocs):
    proc = run_example("rl_agent.py", nprocs=nprocs)
    line = ok_line(proc, "rl_agent")
    assert f"world_size={nprocs} observers={nprocs - 1} episodes=40 " in line
    first, last = numbers(line, r" reward (-?\d+\.\d+) -> (-?\d+\.\d+) ")
    assert last > first
    before, after = numbers(line, r" toward_target (\d\.\d+) -> (\d\.\d+)")
    assert after > before
    assert "[agent] episode  40  last reward" in proc.stdout


@pytest.mark.parametrize("nprocs, epochs", [(2, 3), (3, 2)])
def test_pipeline(nprocs, epochs, tmp_path):
    plot = tmp_path / "loss.png"
    proc = run_example("pipeline.py", nprocs=nprocs,
                       args=("--epochs", str(epochs), "--plot", str(plot)))
    line = ok_line(proc, "pipeline")
    assert f"world_size={nprocs} epochs={epochs} " in line
    first, last = numbers(line, r" loss (\d+\.\d+) -> (\d+\.\d+) ")
    assert last < first
    first_epoch, last_epoch = numbers(line, r" epoch_loss (\d+\.\d+) -> (\d+\.\d+) ")
    assert last_epoch < first_epoch
    (diff,) = numbers(line, r" grad_check_max_diff=(\S+)")
    assert diff < 1e-5
    assert line.endswith(f"plot={plot}")
    stage1 = "worker0" if nprocs == 2 else "worker1"
    assert f"stage 1 on {stage1}, stage 2 on worker{nprocs - 1}" in proc.stdout
    # not a terminal: one finished bar per epoch, never redrawn in place
    assert "\r" not in proc.stdout
    for epoch in range(1, epochs + 1):
        assert f"epoch {epoch}/{epochs} [########################] 16/16 loss " in proc.stdout
    data = plot.read_bytes()
    assert len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")
