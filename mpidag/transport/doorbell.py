"""Where user threads wait while another thread leads: a generation counter and a bell.

A user thread that waits for its call (:meth:`ProgressEngine.wait_until`) while another
thread leads reads the doorbell's ``generation``, looks at its condition, and only then
waits for the generation to move on; a completion, a vacant leadership and the engine's
stop ring the bell. Reading the generation first is what loses no wake-up: a ring between
the look and the wait makes ``wait`` return at once.

Two implementations with one interface: :class:`Doorbell` here (Python, a
``threading.Condition``), and ``_mpidag_fastpath.Doorbell`` (``doorbell.h``), which waits
with the GIL released, yields the core without taking the GIL back between yields, and
is rung by the compiled completion path with a C call, so a reply is handed from the
leader to the thread that waits for it without any Python. The agent picks the C one
with its compiled path (:func:`mpidag.agent.fastpath.new_doorbell`).

Example::

    >>> bell = Doorbell()
    >>> seen = bell.generation
    >>> bell.ring()
    >>> bell.wait(seen, timeout=1.0) == seen + 1   # rung since seen: at once
    True
"""

from __future__ import annotations

import math
import os
import threading

__all__ = ["Doorbell"]

#: the longest one :meth:`Doorbell.wait` sleeps (seconds); callers loop
MAX_WAIT = 3600.0


class Doorbell:
    """A generation counter that threads wait on (see the module's doc)."""

    __slots__ = ("generation", "_cv", "sleepers")

    def __init__(self) -> None:
        #: how many times it rang (read it before looking at the condition waited for)
        self.generation = 0
        #: threads asleep in :meth:`wait` now
        self.sleepers = 0
        self._cv = threading.Condition(threading.Lock())

    def ring(self) -> None:
        """Move the generation on and wake every thread in :meth:`wait`.

        Example::

            >>> bell = Doorbell(); bell.ring(); bell.generation
            1
        """
        with self._cv:
            self.generation += 1
            self._cv.notify_all()

    def wait(self, seen: int, timeout: float, spins: int = 0) -> int:
        """Yield the core up to ``spins`` times, then sleep up to ``timeout`` seconds, until
        the generation is not ``seen``; returns the generation then.

        Example::

            >>> Doorbell().wait(0, timeout=0.0)   # not rung, no time to wait
            0
        """
        if math.isnan(timeout):
            raise ValueError("wait(): timeout must be a number of seconds, got nan")
        for _ in range(spins):
            if self.generation != seen:
                return self.generation
            os.sched_yield()
        with self._cv:
            if self.generation == seen and timeout > 0:
                self.sleepers += 1
                try:
                    self._cv.wait_for(lambda: self.generation != seen,
                                      min(timeout, MAX_WAIT))
                finally:
                    self.sleepers -= 1
            return self.generation
