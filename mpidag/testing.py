"""Helpers for tests of mpidag programs (and of mpidag itself).

The pytest fixtures built on these are in :mod:`mpidag.pytest_plugin` (loaded by pytest
automatically where mpidag is installed). All functions here except
:func:`delayed_control_messages` are collective: every rank calls them.

Example::

    from mpidag import testing
    with testing.delayed_control_messages(max_delay=0.01, seed=rank):
        ...  # RRef protocol messages now arrive late and out of order
    testing.quiesce()          # every rank here, nothing in flight
    testing.assert_no_leaks()  # no RRef, call or autograd context left on any rank
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import random
import threading
import time
from collections.abc import Iterator

from mpidag import _runtime
from mpidag.agent.messages import Kind

__all__ = ["quiesce", "settle", "leak_report", "assert_no_leaks", "delayed_control_messages"]

#: counters of the runtime's ``debug_info()`` that must be 0 when nothing leaks
LEAK_COUNTERS = ("num_owner_rrefs", "num_user_rrefs", "num_pending_users",
                 "num_pending_children", "num_pending_requests", "num_autograd_contexts",
                 "num_current_backward_passes", "num_live_send_functions",
                 "num_live_recv_functions")


def quiesce(timeout: float = 60.0) -> None:
    """Collective: return when every rank called this and no message is in flight.

    Raises ``RPCTimeoutError`` after ``timeout`` seconds (0: no limit).

    Example::

        >>> fut = rpc.rpc_async(rpc_world.next, torch.add, args=(1, 2))
        >>> testing.quiesce()            # fut's call and reply are done on every rank
        >>> fut.done()
        True
    """
    _runtime.current().agent.wait_quiescent(timeout)


def _sum_over_ranks(values: list[int], timeout: float) -> list[int]:
    agent = _runtime.current().agent
    wait = agent.collective_waiter(timeout, "a rank did not reach the same mpidag.testing call")
    return agent.transport.allreduce_sum(values, wait)


def settle(timeout: float = 60.0, rounds: int = 10) -> None:
    """Collective: collect garbage and drain messages until no rank frees anything more.

    Garbage cycles that hold RRefs (tracebacks, frames) are only freed when the collector
    runs, and freeing them sends protocol messages; this repeats collect-and-quiesce until
    a round in which no rank's collector found anything (at most ``rounds`` rounds).

    Example::

        >>> rref = rpc.remote(rpc_world.next, torch.ones, args=(2,))
        >>> del rref
        >>> testing.settle()             # the owner has freed the value
    """
    for _ in range(rounds):
        found = gc.collect()
        quiesce(timeout)
        if _sum_over_ranks([found], timeout)[0] == 0:
            return


def leak_report(timeout: float = 60.0) -> dict[int, dict[str, int]]:
    """Collective: after :func:`settle`, the non-zero leak counters of every rank.

    Example::

        >>> testing.leak_report()
        {}
        >>> if rank == 0:                     # worker0 keeps an RRef owned by worker1
        ...     keep = rpc.remote("worker1", torch.ones, args=(2,))
        >>> testing.leak_report()             # every rank gets the same report
        {0: {'num_user_rrefs': 1}, 1: {'num_owner_rrefs': 1}}
    """
    settle(timeout)
    runtime = _runtime.current()
    agent = runtime.agent
    k = len(LEAK_COUNTERS)
    mine = runtime.debug_info()
    values = [0] * (agent.world_size * k)
    values[agent.rank * k:(agent.rank + 1) * k] = [int(mine.get(c, 0)) for c in LEAK_COUNTERS]
    totals = _sum_over_ranks(values, timeout)
    report: dict[int, dict[str, int]] = {}
    for rank in range(agent.world_size):
        row = {c: v for c, v in zip(LEAK_COUNTERS, totals[rank * k:(rank + 1) * k],
                                    strict=True) if v}
        if row:
            report[rank] = row
    quiesce(timeout)  # no rank goes on while another still counts
    return report


def assert_no_leaks(timeout: float = 60.0) -> None:
    """Collective: raise ``AssertionError`` on every rank if any rank leaks.

    The leaks are those of :func:`leak_report`: RRefs, pending forks, calls in flight,
    distributed autograd contexts or send/recv functions still alive on some rank.

    Example::

        >>> def test_no_leaks(rpc_world):
        ...     rref = rpc.remote(rpc_world.next, torch.ones, args=(2,))
        ...     assert rref.to_here().sum() == 2
        ...     del rref
        ...     testing.assert_no_leaks()    # raises on every rank if one leaks
        >>> test_no_leaks(rpc_world)         # on every rank
    """
    report = leak_report(timeout)
    if report:
        raise AssertionError(f"mpidag left RRefs, calls or autograd contexts alive: {report} "
                             f"(by rank)")


class _DelayedSender:
    """Sends hooked messages after random delays from one thread (so they reorder)."""

    def __init__(self, transport, max_delay: float, seed: int) -> None:
        self.transport = transport
        self.max_delay = max_delay
        self.random = random.Random(seed)
        self.heap: list = []
        self.order = itertools.count()
        self.cv = threading.Condition()
        self.stopping = False
        self.delayed = 0
        self.thread = threading.Thread(target=self._main, name="mpidag-delays", daemon=True)
        self.thread.start()

    def hook(self, dst, env, devices) -> bool:
        if env.kind != Kind.CONTROL:
            return False
        with self.cv:
            due = time.monotonic() + self.random.uniform(0, self.max_delay)
            heapq.heappush(self.heap, (due, next(self.order), dst, env, devices))
            self.delayed += 1
            self.cv.notify()
        return True

    def _main(self) -> None:
        while True:
            with self.cv:
                while not self.heap and not self.stopping:
                    self.cv.wait()
                if not self.heap:
                    return
                due, _, dst, env, devices = self.heap[0]
                now = time.monotonic()
                if due > now and not self.stopping:
                    self.cv.wait(due - now)
                    continue
                heapq.heappop(self.heap)
            self.transport.send_now(dst, env, devices)

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        self.thread.join()


@contextlib.contextmanager
def delayed_control_messages(max_delay: float = 0.01, seed: int = 0) -> Iterator[_DelayedSender]:
    """Delay every CONTROL message (RRef protocol steps, context releases) sent by this rank
    by a random time up to ``max_delay`` seconds, so they arrive late and reordered. Leaving
    the block sends whatever is still held back. Not collective: each rank delays what it
    sends.

    Example::

        >>> with testing.delayed_control_messages(max_delay=0.01, seed=rpc_world.rank):
        ...     rref = rpc.remote(rpc_world.next, torch.ones, args=(2,))
        ...     rpc.rpc_sync(rpc_world.prev, len, args=([rref],))   # forks, deletes: late
        ...     del rref
        1
        >>> testing.assert_no_leaks()         # collective: every rank does the same
    """
    transport = _runtime.current().transport
    sender = _DelayedSender(transport, max_delay, seed)
    transport.send_hook = sender.hook
    try:
        yield sender
    finally:
        transport.send_hook = None
        sender.stop()
