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

    After :data:`PARK_AFTER` checks in a row that found a leader and no new vacancy it
    sleeps until the next lazy vacancy (:meth:`note_vacancy_locked`): an idle rank does not
    wake it 1,000 times a second.

    The engine starts it on a thread of its own::

        sentinel = Sentinel(engine_lock, interval=1e-3)
        threading.Thread(target=sentinel.run, args=(engine,), daemon=True).start()
    """

    #: park after this many checks in a row found a leader and no vacancy
    PARK_AFTER = 20

    def __init__(self, lock: threading.Lock, interval: float) -> None:
        self.interval = interval
        self._cv = threading.Condition(lock)
        self._parked = False  # sleeps until the next lazy vacancy
        self._vacancy_epoch = 0  # counts lazy vacancies

    @property
    def parked(self) -> bool:
        """Whether it sleeps until the next lazy vacancy (read with the engine's lock)."""
        return self._parked

    def note_vacancy_locked(self) -> None:
        """A leader vacated lazily (nobody was woken to lead): count it, wake a parked
        sentinel (call with the engine's lock held)."""
        self._vacancy_epoch += 1
        if self._parked:
            self._parked = False
            self._cv.notify()

    def wake_locked(self) -> None:
        """The engine stops: end a park (call with the engine's lock held)."""
        self._cv.notify_all()

    def run(self, engine: ProgressEngine) -> None:
        """The sentinel thread's loop, until the engine stops."""
        if engine.thread_started is not None:
            engine.thread_started()
        seen_vacant_epoch = -1
        quiet_checks = 0  # checks in a row that found a leader and no new vacancy
        last_epoch = -1
        while True:
            time.sleep(self.interval)
            lead = False
            with self._cv:
                if engine._stopping:
                    return
                if engine._leadership_held_locked():
                    seen_vacant_epoch = -1
                    quiet_checks = quiet_checks + 1 if self._vacancy_epoch == last_epoch else 0
                    last_epoch = self._vacancy_epoch
                    if quiet_checks >= self.PARK_AFTER:
                        # nothing happened for a while: sleep until the next lazy vacancy
                        # instead of waking every interval (an idle rank's CPU use)
                        quiet_checks = 0
                        self._parked = True
                        while self._parked and not engine._stopping:
                            self._cv.wait()
                    continue
                if seen_vacant_epoch == self._vacancy_epoch:
                    seen_vacant_epoch = -1
                    lead = engine._fill_vacancy_locked()
                else:
                    seen_vacant_epoch = self._vacancy_epoch
            if lead:
                engine._lead_for_sentinel()
