"""pytest fixtures for multi-rank tests of mpidag programs (a ``pytest11`` plugin).

Installed with mpidag, so any pytest run where mpidag is importable has them::

    # test_mine.py — run with: python -m mpidag.run -n 2 -m pytest --with-mpi test_mine.py
    import pytest, torch, mpidag.rpc as rpc

    pytestmark = pytest.mark.mpi(min_size=2)

    def test_add(rpc_world):
        out = rpc.rpc_sync(rpc_world.next, torch.add, args=(torch.ones(2), 1), timeout=10)
        assert torch.equal(out, torch.full((2,), 2.0))

``rpc_world`` calls ``init_rpc()`` once per test session and, at its end, checks that no
RRef, pending fork, call or distributed autograd context is left on any rank
(:func:`mpidag.testing.assert_no_leaks`), then shuts RPC down. For a leak check after every
module instead (RPC restarted per module), set the scope in the pytest configuration::

    [tool.pytest.ini_options]          # pyproject.toml; or pytest.ini / setup.cfg [tool:pytest]
    mpidag_rpc_scope = "module"        # "session" (default), "package" or "module"

or on the command line: ``--mpidag-rpc-scope=module``.

A failing test does not end the run. In a multi-rank run (``--with-mpi`` on 2 or more
ranks) the ranks agree after every test on which of them failed it (a non-blocking
allgather on a communicator of the plugin's own), then all go on to the next test; every
rank's final summary lists each test that failed on any rank, with those ranks, and every
rank exits non-zero when any did. A rank whose test failed waits at most
``mpidag_failure_grace`` seconds (default 60; ``--mpidag-failure-grace``) for the other
ranks to finish that test: a rank still in it then is taken as hung (waiting for the failed
rank in a collective call, say), and the job is aborted with a message that names the test
and the ranks, rather than left to hang. ``-x`` / ``--maxfail`` count the tests that failed
on any rank and stop every rank after the same test.
"""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from mpidag._backoff import Backoff

__all__ = ["RpcWorld", "rpc_world"]

_SCOPES = ("session", "package", "module")


def pytest_addoption(parser: pytest.Parser) -> None:
    """The scope of ``rpc_world``: ini ``mpidag_rpc_scope``, or ``--mpidag-rpc-scope``."""
    parser.addini("mpidag_rpc_scope", f"scope of the rpc_world fixture: one of {_SCOPES}",
                  default="session")
    parser.getgroup("mpidag").addoption(
        "--mpidag-rpc-scope", choices=_SCOPES, default=None,
        help="scope of the rpc_world fixture (overrides the mpidag_rpc_scope ini value)")
    parser.addini("mpidag_failure_grace", "seconds a rank whose test failed waits for the "
                  "other ranks to finish that test before it aborts the job (default 60)",
                  default="60")
    parser.getgroup("mpidag").addoption(
        "--mpidag-failure-grace", type=float, default=None, metavar="SECONDS",
        help="seconds a rank whose test failed waits for the other ranks to finish that "
             "test before it aborts the MPI job (overrides the mpidag_failure_grace ini "
             "value)")


def _rpc_scope(fixture_name: str, config: pytest.Config) -> str:
    scope = config.getoption("--mpidag-rpc-scope") or config.getini("mpidag_rpc_scope")
    if scope not in _SCOPES:
        raise pytest.UsageError(f"mpidag_rpc_scope = {scope!r}: use one of {_SCOPES}")
    return scope


@dataclass(frozen=True)
class RpcWorld:
    """This rank's place in the job: ``rank``, ``size``, its ``name`` and neighbours.

    Example::

        >>> rpc_world = RpcWorld(rank=0, size=2)     # the fixture, in a test on rank 0 of 2
        >>> rpc_world.name, rpc_world.next, rpc_world.prev
        ('worker0', 'worker1', 'worker1')
    """

    rank: int
    size: int

    @property
    def name(self) -> str:
        """This worker's name (``worker{rank}``, as ``init_rpc()`` names it)."""
        return self.worker(self.rank)

    @property
    def next(self) -> str:
        """The next worker around the ring (``worker{rank+1 mod size}``)."""
        return self.worker(self.rank + 1)

    @property
    def prev(self) -> str:
        """The previous worker around the ring."""
        return self.worker(self.rank - 1)

    def worker(self, rank: int) -> str:
        """The name of the worker of ``rank``, taken around the ring (``rank mod size``)."""
        from mpidag.rpc import get_worker_info

        return get_worker_info(rank % self.size).name


@pytest.fixture(scope=_rpc_scope)
def rpc_world() -> Iterator[RpcWorld]:
    """RPC started for the session's tests (or each module's: ``mpidag_rpc_scope``), an
    :class:`RpcWorld` as its value, and a leak check on every rank at the end
    (:func:`mpidag.testing.assert_no_leaks`) before ``shutdown()``.

    Example::

        pytestmark = pytest.mark.mpi(min_size=2)

        def test_echo(rpc_world):
            assert rpc.rpc_sync(rpc_world.next, len, args=("abc",)) == 3
    """
    import mpidag.rpc as rpc
    from mpidag import _runtime, testing

    rpc.init_rpc()
    agent = _runtime.current().agent
    try:
        yield RpcWorld(agent.rank, agent.world_size)
        testing.assert_no_leaks()
    finally:
        rpc.shutdown()


_FAILED, _STOP = 1, 2  # the bits of a rank's outcome of one test


def _failure_grace(config: pytest.Config) -> float:
    grace = config.getoption("--mpidag-failure-grace")
    if grace is None:
        value = config.getini("mpidag_failure_grace")
        try:
            grace = float(value)
        except ValueError:
            raise pytest.UsageError(f"mpidag_failure_grace = {value!r}: give a number of "
                                    f"seconds, e.g. 60") from None
    if not grace > 0:
        raise pytest.UsageError(f"mpidag failure grace = {grace!r}: give a positive number "
                                f"of seconds, e.g. 60")
    return grace


@dataclass(eq=False)  # hashable, as pytest needs its plugins to be
class _Agreement:
    """Per test, the ranks of a multi-rank run learn which of them failed it (see the
    module's docstring); registered by :func:`pytest_configure` as ``mpidag-agreement``."""

    grace: float
    #: pytest's ``--maxfail`` (``-x``: 1; 0: none), counted here over every rank's failures:
    #: pytest's own count would have the failing rank alone stop (and tear the session's
    #: fixtures down, collectively) while the others went on
    maxfail: int = 0
    comm: Any = None  # a duplicate of COMM_WORLD, made at the session's start
    rank: int = 0
    size: int = 1
    failed_here: bool = False
    #: nodeid -> the ranks that failed it, every test that failed on any rank
    failures: dict[str, list[int]] = field(default_factory=dict)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from mpidag.transport.mpi import start_mpi

        world = start_mpi().COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        if self.size > 1:
            self.comm = world.Dup()  # every rank starts the session: collective is safe

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.failed or self.comm is None:
            return
        self.failed_here = True
        # at once, with the rank: should the job end later, this is what is left of it
        sys.stderr.write(f"\n[rank {self.rank}] {report.nodeid} FAILED ({report.when}):\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None
                                ) -> Iterator[None]:
        self.failed_here = False
        result = yield
        if self.comm is not None:
            self._agree(item)
        return result

    def _agree(self, item: pytest.Item) -> None:
        import numpy as np

        session = item.session
        stop = bool(session.shouldstop or session.shouldfail)
        mine = np.array([_FAILED * self.failed_here + _STOP * stop,
                         zlib.crc32(item.nodeid.encode())], dtype=np.int64)
        every = np.zeros((self.size, 2), dtype=np.int64)
        request = self.comm.Iallgather(mine, every)
        deadline = time.monotonic() + self.grace if self.failed_here else None
        backoff = Backoff(spin=0.0, min_sleep=1e-4, max_sleep=0.01)
        while not request.Test():
            if deadline is not None and time.monotonic() > deadline:
                self._abort_hung(item, every)
            backoff.idle()
        if len(set(every[:, 1].tolist())) > 1:
            self._abort(f"the ranks ran different tests at the same time ({item.nodeid} "
                        f"here): every rank must collect the same tests in the same order")
        failed = [r for r in range(self.size) if every[r, 0] & _FAILED]
        if failed:
            self.failures[item.nodeid] = failed
            if not self.failed_here:
                sys.stderr.write(f"\n[rank {self.rank}] {item.nodeid} passed here but "
                                 f"FAILED on rank(s) {failed}\n")
                sys.stderr.flush()
        if any(every[:, 0] & _STOP) and not stop:
            session.shouldstop = f"another rank stopped the run after {item.nodeid}"
        if self.maxfail and len(self.failures) >= self.maxfail and not session.shouldfail:
            session.shouldfail = f"stopping after {len(self.failures)} failures on any rank"

    def _abort_hung(self, item: pytest.Item, every: Any) -> None:
        self._abort(f"{item.nodeid} FAILED here, and the other ranks have not finished it "
                    f"after {self.grace:g} s (mpidag_failure_grace): taken as waiting for "
                    f"this rank; aborting the MPI job. Failed before it: "
                    f"{self._listing() or 'none'}")

    def _abort(self, why: str) -> None:
        sys.stderr.write(f"\n[rank {self.rank}] {why}\n")
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

    def _listing(self) -> str:
        return "; ".join(f"{nodeid} (rank(s) {', '.join(map(str, ranks))})"
                         for nodeid, ranks in self.failures.items())

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.failures and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # failed on another rank

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.comm is None:
            return
        terminalreporter.section(f"mpidag: failures on any of {self.size} ranks "
                                 f"(this is rank {self.rank})")
        for nodeid, ranks in self.failures.items():
            terminalreporter.write_line(f"FAILED {nodeid} on rank(s) "
                                        f"{', '.join(map(str, ranks))}")
        if not self.failures:
            terminalreporter.write_line("none")


def pytest_configure(config: pytest.Config) -> None:
    """With ``--with-mpi`` (pytest-mpi's option), per-test agreement between the ranks."""
    if config.getoption("--with-mpi", default=False):
        agreement = _Agreement(_failure_grace(config), maxfail=config.option.maxfail or 0)
        config.option.maxfail = 0  # counted by the agreement instead (see its maxfail)
        config.pluginmanager.register(agreement, "mpidag-agreement")
