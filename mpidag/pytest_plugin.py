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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

__all__ = ["RpcWorld", "rpc_world"]

_SCOPES = ("session", "package", "module")


def pytest_addoption(parser: pytest.Parser) -> None:
    """The scope of ``rpc_world``: ini ``mpidag_rpc_scope``, or ``--mpidag-rpc-scope``."""
    parser.addini("mpidag_rpc_scope", f"scope of the rpc_world fixture: one of {_SCOPES}",
                  default="session")
    parser.getgroup("mpidag").addoption(
        "--mpidag-rpc-scope", choices=_SCOPES, default=None,
        help="scope of the rpc_world fixture (overrides the mpidag_rpc_scope ini value)")


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
