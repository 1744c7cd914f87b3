"""The progress engine's sentinel: no message waits because the leadership stays vacant."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpidag.transport.progress import ProgressEngine

__all__ = ["Sentinel"]


class Sentinel:
    """If the leadership stays vacant for a whole interval, wake an idle pool thread to
    lead; if every pool thread is busy (all of them run requests, or wait for replies or
    for their sends to complete), lead itself until one is free: progress never depends on
    the size of the pool (two ranks with one pool thread each, both sending a large reply
    that the other must receive, would otherwise wait forever).

    It looks only when there is something to look for: every vacancy that nobody is handed
    (:meth:`note_vacancy_locked`, called by the engine) starts a watch; a look that finds a
    leader, or a user thread about to lead, ends it and parks the sentinel until the next
    vacancy; a look that finds the leadership vacant for a whole interval since the latest
    vacancy fills it. So while a rank's threads lead in turn (a training loop) it wakes about
    twice per vacancy, not once per interval: at 1,000 looks a second it cost a distributed
    forward and backward 8-10 % on the 2-core VM, each look taking a core from a rank
    that computes.

    The engine starts it on a thread of its own::

        sentinel = Sentinel(engine_lock, interval=1e-3)
        threading.Thread(target=sentinel.run, args=(engine,), daemon=True).start()
    """

    def __init__(self, lock: threading.Lock, interval: float) -> None:
        self.interval = interval
        self._cv = threading.Condition(lock)
        self._parked = False  # sleeps until the next vacancy
        #: when the latest vacancy began (``time.monotonic()``); None: no vacancy to watch
        #: (the last look found a leader). Starts watching: nobody leads before the pool
        #: threads start.
        self._vacant_since: float | None = time.monotonic()
        #: looks at the leadership so far (for tests and tools: how often it woke)
        self.looks = 0

    @property
    def parked(self) -> bool:
        """Whether it sleeps until the next vacancy (read with the engine's lock)."""
        return self._parked

    def note_vacancy_locked(self) -> None:
        """The leadership is vacant and nobody was handed it: watch it from now (call with
        the engine's lock held)."""
        self._vacant_since = time.monotonic()
        if self._parked:
            self._parked = False
            self._cv.notify()

    def wake_locked(self) -> None:
        """The engine stops: end a park or a watch (call with the engine's lock held)."""
        self._cv.notify_all()

    def _look_locked(self, engine: ProgressEngine) -> float | bool | None:
        """One look: ``None`` to park (a leader holds the lead, or no vacancy to watch),
        seconds to wait before the next look, ``True`` when the sentinel must lead,
        ``False`` when it woke a pool thread to lead."""
        since = self._vacant_since
        if since is None:
            return None
        self.looks += 1
        if engine._leadership_held_locked():
            self._vacant_since = None  # taken: the next vacancy starts a new watch
            return None
        left = since + self.interval - time.monotonic()
        if left > 0:
            return left  # vacant for less than an interval: look again when it is one
        self._vacant_since = time.monotonic()  # look again: whoever was woken leads by then
        return engine._fill_vacancy_locked()

    def run(self, engine: ProgressEngine) -> None:
        """The sentinel thread's loop, until the engine stops."""
        if engine.thread_started is not None:
            engine.thread_started()
        while True:
            with self._cv:
                while True:
                    if engine._stopping:
                        return
                    look = self._look_locked(engine)
                    if look is None:  # park until the next vacancy (or the engine stops)
                        self._parked = True
                        self._cv.wait()
                        self._parked = False
                    elif look is True or look is False:
                        break
                    else:
                        self._cv.wait(look)  # only the engine's stop cuts this short
                if not look:
                    continue
            engine._lead_for_sentinel()
            with self._cv:  # it handed the lead to a pool thread: check that it took it
                self._vacant_since = time.monotonic()
