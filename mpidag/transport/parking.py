"""Where idle pool threads wait: woken last-in, first-out.

``threading.Condition`` wakes the thread that has waited longest, so a rank whose work
items come one at a time hands each to a different pool thread in turn: every pool thread
touches every handler's memory (its glibc arena, its caches). Waking the thread that parked
last keeps that work on the few threads the load needs, whose memory is warm; the others
stay parked. Measured on a parameter server (one trainer, 2 ranks): the server's handler
work went from 13 threads to a few, and the page faults of its 5 MiB gradient fell (see
``docs/design.md``, "The parameter server against its floor").
"""

from __future__ import annotations

import threading

__all__ = ["Parking"]


class Parking:
    """Idle threads parked under ``lock`` (held by callers, as with a condition), woken
    newest first.

    Example::

        >>> lock = threading.Lock()
        >>> parking = Parking(lock)
        >>> with lock:
        ...     parking.notify()          # nobody parked: nothing happens
        >>> len(parking)
        0
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        #: one gate per parked thread, the newest last; a thread waits to acquire its gate
        self._gates: list[threading.Lock] = []
        self._own = threading.local()

    def __len__(self) -> int:
        return len(self._gates)

    def wait(self) -> None:
        """Park the calling thread until :meth:`notify` or :meth:`notify_all` picks it
        (call with the lock held; it is released while parked and held again after)."""
        gate = getattr(self._own, "gate", None)
        if gate is None:
            gate = self._own.gate = threading.Lock()
        gate.acquire()
        self._gates.append(gate)
        self._lock.release()
        try:
            gate.acquire()  # released by notify
        finally:
            gate.release()
            self._lock.acquire()

    def notify(self) -> None:
        """Wake the thread that parked last, if any (with the lock held)."""
        if self._gates:
            self._gates.pop().release()

    def notify_all(self) -> None:
        """Wake every parked thread (with the lock held)."""
        while self._gates:
            self._gates.pop().release()
