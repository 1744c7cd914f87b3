"""Shared fixtures. Multi-rank tests run under ``mpirun -n N python -m pytest --with-mpi``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


#: the modules that take longest, longest first (seconds of a serial run on the 2-core VM:
#: torch's CI part 98, lifecycle 85, examples 82, the 1-minute soak 73, Slurm 64, bad input
#: 50, FT 41, chaos 35): under ``pytest -n 2 --dist loadfile`` (scripts/test.sh) they start
#: first, so no worker is left running one of them alone at the end
LONGEST_FIRST = ("test_torch_suites.py", "test_lifecycle.py", "test_examples.py",
                 "test_soak.py", "test_slurm.py", "test_bad_input.py", "test_ft.py",
                 "test_chaos.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, put the longest modules first (a stable sort: the order within a
    module and among the others is kept); a plain run keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


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
