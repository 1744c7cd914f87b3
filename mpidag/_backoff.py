"""The one backoff every wait loop of mpidag uses.

A loop that waits for something another thread or rank will do (a message, a reply, a
nonblocking collective, a send to complete) calls :meth:`Backoff.idle` after each empty
look and :meth:`Backoff.reset` after progress. Idle time goes through three phases:

1. *spin* for :data:`PURE_SPIN` (50 us): a normal round trip arrives within it;
2. *yield* (``os.sched_yield``, 0.5 us here; it releases the GIL and the core) until
   ``spin`` seconds of idleness: covers the gaps of a pipeline, where a peer computes for
   a few ms, without sleeping through the answer;
3. *sleep*, from ``min_sleep`` doubling to ``max_sleep``: bounds the idle CPU use;
4. once the idleness is long, sleeps may grow past ``max_sleep`` up to ``long_sleep``, each
   at most :data:`LONG_IDLE_SHARE` (4 %) of the idleness so far: each wakeup of a sleeping
   thread costs 55-120 us of CPU on the VMs measured (sleep, wakeup, one MPI poll), so 1 ms
   sleeps cost ~5 % of a core, while the first message after ``T`` seconds of silence waits
   at most 4 % of ``T`` longer than it would have.

``time.sleep(0)`` is never used: it costs 25-85 us on the VMs this was measured on, more
than a whole round trip. A waiter that knows another thread of its process is computing
(one core per rank is common) passes ``computing=True`` and goes straight to sleeping,
through ``nap``, a sleep that may end early (when that computation ends, or when a thread
of the process wants to lead); every sleep goes through ``nap``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["LONG_IDLE_SHARE", "PURE_SPIN", "Backoff"]

#: seconds of idleness polled in a tight loop before yielding: covers a normal round trip
PURE_SPIN = 50e-6
#: past ``max_sleep``, a sleep lasts at most this share of the idleness so far (up to
#: ``long_sleep``): the first message after ``T`` seconds of silence waits at most 4 % of
#: ``T`` longer
LONG_IDLE_SHARE = 0.04


class Backoff:
    """Spin, then yield until ``spin`` seconds of idleness, then sleep ``min_sleep`` doubling
    to ``max_sleep``.

    Example::

        >>> done = threading.Event()
        >>> threading.Timer(0.01, done.set).start()     # progress, 10 ms from now
        >>> backoff = Backoff(spin=1e-3, min_sleep=50e-6, max_sleep=1e-3)
        >>> while not done.is_set():
        ...     backoff.idle()
        >>> backoff.reset()          # after progress: the next wait starts spinning again
    """

    __slots__ = ("spin", "min_sleep", "max_sleep", "long_sleep", "_since", "_sleep", "_nap")

    def __init__(self, spin: float, min_sleep: float, max_sleep: float,
                 nap: Callable[[float], None] = time.sleep,
                 long_sleep: float | None = None) -> None:
        self.spin = spin
        self.min_sleep = min_sleep
        self.max_sleep = max(max_sleep, min_sleep)
        self.long_sleep = max(long_sleep or 0.0, self.max_sleep)
        self._nap = nap
        self._since = 0.0
        self._sleep = min_sleep

    def reset(self) -> None:
        """Progress was made: the next idle period starts with spinning again."""
        self._since = 0.0

    def idle(self, computing: bool = False) -> None:
        """One empty look. ``computing``: another thread of this process runs work now, so
        spinning would take its core: sleep (``nap``) at once."""
        now = time.perf_counter()
        if not self._since:
            self._since = now
            self._sleep = self.min_sleep
            return
        if computing:
            self._nap(self._sleep)
            self._sleep = min(self._sleep * 2, self.max_sleep)
            return
        idle_for = now - self._since
        if idle_for < PURE_SPIN:
            return
        if idle_for < self.spin:
            os.sched_yield()
            return
        self._nap(self._sleep)
        cap = self.max_sleep
        if idle_for * LONG_IDLE_SHARE > cap:  # long silence: sleep a bounded share of it
            cap = min(self.long_sleep, idle_for * LONG_IDLE_SHARE)
        self._sleep = min(self._sleep * 2, cap)

    def idle_seconds(self) -> float:
        """How long the current idle period has lasted (0 right after progress)."""
        return time.perf_counter() - self._since if self._since else 0.0
