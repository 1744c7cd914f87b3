"""The ``rpc_world`` fixture and leak check, as a user's own pytest-mpi tests see them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_user_tests(tmp_path, source: str, *more: str, files: dict[str, str] | None = None
                   ) -> subprocess.CompletedProcess:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(source))
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    return subprocess.run(
        [sys.executable, "-m", "mpidag.run", "-n", "2", "-m", "pytest", "-q",
         "-p", "no:cacheprovider", "--with-mpi", *more, "test_user.py", *(files or {})],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


USER_PRELUDE = """
import pytest, torch
import mpidag._runtime
import mpidag.rpc as rpc

pytestmark = pytest.mark.mpi(min_size=2)

def add(a, b):
    return a + b
"""


def test_user_tests_get_a_world_and_pass(tmp_path):
    result = run_user_tests(tmp_path, USER_PRELUDE + """
def test_ring(rpc_world):
    assert rpc_world.size == 2 and rpc_world.name == f"worker{rpc_world.rank}"
    out = rpc.rpc_sync(rpc_world.next, add, args=(torch.ones(2), 1), timeout=10)
    assert torch.equal(out, torch.full((2,), 2.0))

def test_rref_cleaned_up(rpc_world):
    rref = rpc.remote(rpc_world.prev, add, args=(1, 2))
    assert rref.to_here(timeout=10) == 3
""")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert out.count("2 passed") == 2


def test_leaked_rref_fails_the_module_teardown_on_every_rank(tmp_path):
    result = run_user_tests(tmp_path, USER_PRELUDE + """
KEEP = []

def test_leaks(rpc_world):
    KEEP.append(rpc.remote(rpc_world.next, add, args=(1, 2)))
""")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert out.count("mpidag left RRefs, calls or autograd contexts alive") >= 2, out
    assert "num_user_rrefs" in out and "num_owner_rrefs" in out


def test_one_world_per_session_by_default_or_per_module_when_asked(tmp_path):
    first = USER_PRELUDE + """
import builtins

def test_remember(rpc_world):
    builtins.mpidag_seen_agent = mpidag._runtime.current()
"""
    second = """
import builtins, pytest
import mpidag._runtime
import mpidag.rpc as rpc

pytestmark = pytest.mark.mpi(min_size=2)

def test_compare(rpc_world):
    same = mpidag._runtime.current() is builtins.mpidag_seen_agent
    print(f"SAME-AGENT={same}")
"""
    for extra, expected in (((), "SAME-AGENT=True"),
                            (("--mpidag-rpc-scope=module",), "SAME-AGENT=False")):
        result = run_user_tests(tmp_path, first, "-s", *extra,
                                files={"test_second.py": second})
        out = result.stdout + result.stderr
        assert result.returncode == 0, out
        assert out.count(expected) == 2, out
    result = run_user_tests(tmp_path, first, "--mpidag-rpc-scope=never")
    assert result.returncode != 0 and "invalid choice" in result.stdout + result.stderr


def test_every_failure_is_reported_and_the_run_goes_on(tmp_path):
    """Two failing tests (one on rank 0 alone, one on both ranks) around a passing one: the
    job is not aborted, every rank runs every test, every rank's summary lists both."""
    result = run_user_tests(tmp_path, USER_PRELUDE + """
def test_fails_on_rank0(rpc_world):
    assert rpc.rpc_sync(rpc_world.next, add, args=(1, 2), timeout=10) == 3
    assert rpc_world.rank != 0, "rank 0 fails this one"

def test_passes(rpc_world):
    assert rpc.rpc_sync(rpc_world.next, add, args=(2, 2), timeout=10) == 4
    print(f"PASSING-TEST-RAN on rank {rpc_world.rank}")

def test_fails_everywhere(rpc_world):
    assert rpc_world.size == 3, "every rank fails this one"
""", "-s", "--color=no")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "aborting" not in out and "MPI_ABORT" not in out, out
    assert out.count("PASSING-TEST-RAN on rank") == 2, out
    assert out.count("FAILED test_user.py::test_fails_on_rank0 on rank(s) 0\n") == 2, out
    assert out.count("FAILED test_user.py::test_fails_everywhere on rank(s) 0, 1\n") == 2, out
    assert "2 failed, 1 passed" in out and "1 failed, 2 passed" in out, out
    assert "test_user.py::test_fails_on_rank0 passed here but FAILED on rank(s) [0]" in out
    assert "rank 0 fails this one" in out and "every rank fails this one" in out


def test_a_rank_left_waiting_by_a_failure_ends_the_job_not_hangs(tmp_path):
    """Rank 0 fails while rank 1 waits for it in a collective call: after the grace, the job
    is aborted with a message naming the test and the failures before it. (The grace also
    bounds how late rank 0 may reach the first test's agreement: with 2 s, a CI run whose
    other worker ran torch's suites once saw rank 0 come later and the job end a test early.)"""
    result = run_user_tests(tmp_path, USER_PRELUDE + """
from mpidag import testing

def test_first_failure(rpc_world):
    assert rpc_world.rank != 1, "rank 1 fails first"

def test_leaves_rank1_waiting(rpc_world):
    if rpc_world.rank == 0:
        raise RuntimeError("rank 0 fails before the collective")
    testing.quiesce(timeout=120)   # rank 0 never comes

def test_never_reached(rpc_world):
    print("NEVER-REACHED")
""", "-s", "--mpidag-failure-grace=6")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert ("test_user.py::test_leaves_rank1_waiting FAILED here, and the other ranks have "
            "not finished it after 6 s (mpidag_failure_grace)") in out, out
    assert "Failed before it: test_user.py::test_first_failure (rank(s) 1)" in out, out
    assert "NEVER-REACHED" not in out


def test_maxfail_stops_every_rank_at_the_same_test(tmp_path):
    result = run_user_tests(tmp_path, USER_PRELUDE + """
def test_fails_on_rank1(rpc_world):
    assert rpc_world.rank != 1

def test_after(rpc_world):
    print("AFTER-RAN")
""", "-s", "-x", "--color=no")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "AFTER-RAN" not in out, out
    assert out.count("FAILED test_user.py::test_fails_on_rank1 on rank(s) 1\n") == 2, out
    assert out.count("stopping after 1 failures on any rank") == 2, out


def test_failure_grace_must_be_a_positive_number(tmp_path):
    result = run_user_tests(tmp_path, USER_PRELUDE, "--mpidag-failure-grace=0")
    assert result.returncode != 0
    assert "give a positive number of seconds" in result.stdout + result.stderr
