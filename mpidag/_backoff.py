"""The one backoff every wait loop of mpidag uses.

A loop that waits for something another thread or rank will do (a message, a reply, a
nonblocking collective, a send to complete) calls :meth:`Backoff.idle` after each empty
look and :meth:`Backoff.reset` after progress. Idle time goes through three phases:

1. *spin* for :data:`PURE_SPIN` (50 us): a normal round trip arrives within it;
2. *yield* (``os.sched_yield``, 0.5 us here; it releases the GIL and the core) until
   ``spin`` seconds of idleness: covers the gaps of a pipeline, where a peer computes for
   a few ms, without sleeping through the answer;
3. *sleep*, from ``min_sleep`` doubling to ``max_sleep``: bounds the idle CPU use;
4. after :data:`LONG_IDLE` seconds of idleness, sleeps may grow to ``long_sleep`` (a rank
   that has had nothing to do for a quarter of a second wakes 250 instead of 1,000 times
   a second: each wakeup of a sleeping thread costs 30-100 us of CPU on the VMs measured,
   so 1 ms sleeps cost 3-5 % of a core; the price is up to ``long_sleep`` of latency for
   the first message after such a silence).

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

__all__ = ["LONG_IDLE", "PURE_SPIN", "Backoff"]

#: seconds of idleness polled in a tight loop before yielding: covers a normal round trip
PURE_SPIN = 50e-6
#: seconds of idleness after which sleeps may grow to ``long_sleep``
LONG_IDLE = 0.25


class Backoff:
    """Spin, then yield until ``spin`` seconds of idleness, then sleep ``min_sleep`` doubling
    to ``max_sleep``.

    Example::

        >>> backoff = Backoff(spin=1e-3, min_sleep=50e-6, max_sleep=1e-3)
        >>> while not done():
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
        self._sleep = min(self._sleep * 2,
                          self.long_sleep if idle_for > LONG_IDLE else self.max_sleep)

    def idle_seconds(self) -> float:
        """How long the current idle period has lasted (0 right after progress)."""
        return time.perf_counter() - self._since if self._since else 0.0
