"""The contract suite's harness: one test body, run by every rank, on two transports.

A contract test is a function of ``world`` (this rank's :class:`World`: ``rank``, ``size``,
``name``, ``next``, ``prev``, ``worker(r)``, ``transport``) that every rank of a job runs at
the same time, using only the public API (``mpidag.rpc``, ``.autograd``, ``.optim``,
``.nn``, ``mpidag.testing`` for collectives such as ``quiesce``). ``tests/contract/
conftest.py`` turns each into pytest items:

* ``[inproc2]``, ``[inproc3]``: a world of 2 (3) ranks as threads of the pytest process
  (:class:`InProcGroup`, over :class:`mpidag.transport.inproc.InProcWorld`), each thread
  bound to its rank's runtime (:func:`mpidag._runtime.bind_thread`); plain ``pytest``.
* ``[mpi]``: marked ``mpi``, run by every rank of ``python -m mpidag.run -n N -m pytest
  --with-mpi`` with the ``rpc_world`` fixture's session.

Example::

    # tests/contract/test_mine.py
    import torch, mpidag.rpc as rpc

    def test_add(world):
        out = rpc.rpc_sync(world.next, torch.add, args=(torch.ones(2), world.rank))
        assert out.tolist() == [1.0 + world.rank] * 2
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mpidag import _runtime
from mpidag.pytest_plugin import RpcWorld

__all__ = ["World", "InProcGroup", "bound", "python_encodes", "serial", "rank_state"]

#: seconds an in-process test may run on its ranks before the harness reports the ranks
#: that did not finish (their stacks) and starts a fresh world for the next test
RANK_TIMEOUT = 240.0
#: seconds the other ranks may go on after one failed, before the world is aborted
FAILURE_GRACE = 5.0


@dataclass(frozen=True)
class World(RpcWorld):
    """This rank's place in a contract test's job, and the transport it runs on.

    Example::

        >>> world                                   # rank 1 of an in-process world of 3
        World(rank=1, size=3, transport='inproc')
        >>> world.name, world.next, world.prev
        ('worker1', 'worker2', 'worker0')
    """

    transport: str = "mpi"

    @property
    def inproc(self) -> bool:
        """Whether the ranks are threads of one process (``False``: MPI processes)."""
        return self.transport == "inproc"


class InProcGroup:
    """The runtimes of an in-process world of ``size`` ranks, started for a test module.

    Example::

        >>> group = InProcGroup(2)
        >>> group.run(lambda world: world.name, {})      # every rank runs it
        >>> group.close()
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.runtimes: list = []
        self.world: Any = None
        self.broken = False
        self._start()

    def _start(self) -> None:
        from mpidag._config import Config
        from mpidag._runtime import Runtime
        from mpidag.agent.options import MPIRpcBackendOptions
        from mpidag.rpc.rref import RRef
        from mpidag.transport.inproc import InProcWorld

        self.world = InProcWorld(self.size)
        # init_rpc()'s defaults (as the rpc_world fixture); no gc.freeze and short spins:
        # the ranks share this process and its cores
        config = Config(gc_freeze=False, poll_spin=2e-3)
        with concurrent.futures.ThreadPoolExecutor(self.size) as pool:
            self.runtimes = list(pool.map(lambda r: Runtime.connect(
                self.world.transports[r], options=MPIRpcBackendOptions(), config=config,
                rref_type=RRef), range(self.size), timeout=60))
        for runtime in self.runtimes:
            runtime.serve()
        # as init_rpc does (MPIDAG_GC_FREEZE): the collections of testing.settle() and of the
        # RRef tests then scan only what the tests made, not pytest's and torch's heap
        # (undone by close())
        gc.collect()
        gc.freeze()
        self.broken = False

    def run(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        """Run ``fn(**kwargs, world=...)`` on every rank, each in a thread bound to its
        rank's runtime; raise the failure of the rank that failed first, the rank in a note.

        When a rank fails, the others get :data:`FAILURE_GRACE` seconds to finish what
        they are doing (its pool still serves them); then the in-process world is aborted,
        so ranks waiting for it in a collective fail at once, and the group starts a fresh
        world before its next test.
        """
        if self.broken:
            self._restart()
        errors: dict[int, BaseException] = {}  # in the order the ranks failed
        failed = threading.Event()
        finished = threading.Semaphore(0)

        def body(rank: int) -> None:
            _runtime.bind_thread(self.runtimes[rank])
            try:
                fn(**{**kwargs, "world": World(rank, self.size, "inproc")})
            except BaseException as exc:  # noqa: BLE001 - raised by the test's thread
                errors[rank] = exc
                self.broken = True
                failed.set()
            finally:
                _runtime.bind_thread(None)
                finished.release()

        threads = [threading.Thread(target=body, args=(r,), daemon=True,
                                    name=f"contract-rank{r}") for r in range(self.size)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + RANK_TIMEOUT
        grace_end = None
        for _ in threads:
            while not finished.acquire(timeout=0.05):
                now = time.monotonic()
                if failed.is_set() and grace_end is None:
                    grace_end = now + FAILURE_GRACE
                if grace_end is not None and now > grace_end:
                    self._abort()
                if now > deadline:
                    break
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            self.broken = True
            frames = sys._current_frames()
            stacks = "\n".join(
                f"rank {r}:\n" + "".join(traceback.format_stack(frames[threads[r].ident]))
                for r in hung if threads[r].ident in frames)
            # what the runtimes' own threads do, and their engines' state: a hang's cause
            engines = "\n".join(f"engine of rank {r}: {rt.agent.engine.snapshot()}"
                                 for r, rt in enumerate(self.runtimes))
            others = "\n".join(
                f"thread {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident])[-5:])
                for t in threading.enumerate()
                if t.ident in frames and t not in threads and t is not threading.current_thread())
            stacks = f"{stacks}\n{engines}\n{others}"
            raise AssertionError(f"in-process ranks {hung} of {self.size} did not finish "
                                 f"within {RANK_TIMEOUT:.0f} s; failures: "
                                 f"{ {r: repr(e) for r, e in errors.items()} }\n{stacks}")
        if errors:
            from mpidag.transport.inproc import InProcAbort

            # the rank that failed first, not one that failed because the world was aborted
            causes = [r for r, e in errors.items() if not isinstance(e, InProcAbort)]
            first = (causes or list(errors))[0]
            exc = errors[first]
            exc.add_note(f"[contract] failed on rank {first} of {self.size} (in-process)")
            for rank in errors:
                if rank != first:
                    exc.add_note(f"[contract] rank {rank} also failed: {errors[rank]!r}")
            raise exc

    def _abort(self) -> None:
        with self.world.changed:
            if self.world.aborted is None:
                self.world.aborted = 1
            self.world.changed.notify_all()

    def _restart(self) -> None:
        self._stop(graceful=False)
        self._start()

    def _stop(self, graceful: bool) -> None:
        runtimes, self.runtimes = self.runtimes, []
        with concurrent.futures.ThreadPoolExecutor(max(1, len(runtimes))) as pool:
            futures = [pool.submit(rt.shutdown, graceful, 60.0) for rt in runtimes]
            done = [f.exception() for f in futures]
        if graceful:
            for exc in done:
                if exc is not None:
                    raise exc

    def close(self) -> None:
        """Check on every rank that nothing leaked (as the ``rpc_world`` fixture does at
        the end of its session), then shut the world down."""
        from mpidag import testing

        try:
            if not self.broken:
                self.run(lambda world: testing.assert_no_leaks(), {})
        finally:
            try:
                self._stop(graceful=not self.broken)
            finally:
                gc.unfreeze()


def bound(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run as the calling rank in whatever thread calls it (for threads a contract
    test starts: a new thread of an in-process rank is bound to no runtime).

    Example::

        >>> threading.Thread(target=bound(lambda: rpc.rpc_sync(world.next, len, ("ab",))))
    """
    runtime = _runtime.current()

    @functools.wraps(fn)
    def as_this_rank(*args: Any, **kwargs: Any) -> Any:
        _runtime.bind_thread(runtime)
        try:
            return fn(*args, **kwargs)
        finally:
            _runtime.bind_thread(None)

    return as_this_rank


_SERIAL = threading.RLock()


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """One rank at a time in this block when the ranks share a process (process-wide state
    such as the ``warnings`` filters of ``pytest.warns``); nothing under MPI. The block
    must not wait for another rank's test thread (the other ranks' pools still serve).

    Example::

        >>> with serial(), pytest.warns(UserWarning):
        ...     dist_autograd.backward(context_id, [loss], mode="fast")
    """
    with _SERIAL:
        yield


_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STATE_LOCK = threading.Lock()


def rank_state(name: str, factory: Callable[[], Any]) -> Any:
    """State of the functions a test runs remotely, kept per rank (per runtime): module
    globals are shared by the ranks of an in-process world.

    Example::

        >>> held = rank_state("held", list)      # this rank's list, made on first use
    """
    runtime = _runtime.current()
    with _STATE_LOCK:
        per_rank = _STATE.setdefault(runtime, {})
        if name not in per_rank:
            per_rank[name] = factory()
        return per_rank[name]


def python_encodes(monkeypatch: Any) -> list[str]:
    """Collective: from now on, the names of the functions whose calls the Python encoder
    pickles (``CallCodec.encode``), for a test that checks what the compiled path carries.
    Every rank first waits for the others (the in-process ranks share the class patched
    here, so a rank still making its first calls, which take Python to make the function's
    reference, would show in another rank's list).

    Example::

        >>> rpc.rpc_sync(world.next, f, args=(1,))   # the first call: Python makes the ref
        >>> encoded = python_encodes(monkeypatch)
        >>> rpc.rpc_sync(world.next, f, args=(1,))
        >>> encoded                                 # [] where the compiled path is built
        []
    """
    from mpidag import testing
    from mpidag.agent.encoding import CallCodec

    encoded: list[str] = []
    encode = CallCodec.encode

    def logged(self: Any, dst: int, func: Any, args: tuple, kwargs: dict) -> Any:
        encoded.append(getattr(func, "name", None) or getattr(func, "__name__", ""))
        return encode(self, dst, func, args, kwargs)

    testing.quiesce()
    monkeypatch.setattr(CallCodec, "encode", logged)
    return encoded
