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
