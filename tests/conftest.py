"""Shared fixtures. Multi-rank tests run under ``mpirun -n N python -m pytest --with-mpi``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_job(tmp_path: Path, source: str, nprocs: int = 2, timeout: float = 120,
            env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    """Run ``source`` as a script on ``nprocs`` ranks with the launcher (``launcher``: its
    extra options, e.g. ``("--ft",)``); never hangs."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mpidag.run", *launcher, "-n", str(nprocs), str(script)],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(tmp_path),
    )


def profiled_names(fn) -> set[str]:
    """Run ``fn`` under ``torch.profiler`` (every thread: RPCs are served by pool threads)
    while every rank does the same; a collective before stopping lets the calls of the other
    ranks be served meanwhile. Returns the names of the recorded ranges."""
    import torch

    from mpidag import testing

    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=every_thread) as prof:
        testing.quiesce()  # every rank records before any rank calls
        fn()
        testing.quiesce()
    return {e.key for e in prof.key_averages()}


@pytest.fixture
def job(tmp_path):
    """``job(source, nprocs=2, timeout=120)`` runs a script on several ranks."""
    return lambda source, **kw: run_job(tmp_path, source, **kw)
