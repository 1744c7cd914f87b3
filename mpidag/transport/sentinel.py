"""The progress engine's sentinel: no message waits because the leadership stays vacant."""

from __future__ import annotations

import threading
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

    It looks once per interval, and only while vacancies happen. Every vacancy that nobody
    is handed (:meth:`note_vacancy_locked`, called by the engine) is counted, and wakes a
    parked sentinel, which looks an interval later. A look that finds a leader (or a user
    thread about to lead) parks it again unless another vacancy began since its previous
    look; a look that finds the same vacancy as the one before (vacant both times, none
    begun between) fills it: a vacancy is filled one to two intervals after it began, one
    if it woke the sentinel. So a rank whose threads lead in turn every few milliseconds (a
    training loop) wakes it about twice per vacancy, an idle rank not at all, and a rank
    that serves a stream of short calls (a vacancy each) once per interval. (It used to
    look every interval until 20 looks in a row found a leader and no new vacancy, which a
    training loop never gives: with the 1 ms interval of then, 1,000 looks a second, each a
    thread woken on a core a rank computes on, a distributed forward and backward 8-10 %
    slower on the 2-core VM; see docs/design.md.)

    The engine starts it on a thread of its own::

        sentinel = Sentinel(engine_lock, interval=5e-3)
        threading.Thread(target=sentinel.run, args=(engine,), daemon=True).start()
    """

    def __init__(self, lock: threading.Lock, interval: float) -> None:
        self.interval = interval
        self._cv = threading.Condition(lock)
        self._parked = False  # sleeps until the next vacancy
        #: vacancies noted so far; the first is the start: nobody leads before the pool
        #: threads run. A count, not a time: the note is on every call's path (a clock
        #: read there cost the no-op round trip a few per cent)
        self._vacancies = 1
        #: looks at the leadership so far (how often it woke; in the engine's snapshot)
        self.looks = 0

    @property
    def parked(self) -> bool:
        """Whether it sleeps until the next vacancy (read with the engine's lock)."""
        return self._parked

    def note_vacancy_locked(self) -> None:
        """The leadership is vacant and nobody was handed it (call with the engine's lock
        held)."""
        self._vacancies += 1
        if self._parked:
            self._parked = False
            self._cv.notify()

    def wake_locked(self) -> None:
        """The engine stops: end a park or a wait (call with the engine's lock held)."""
        self._cv.notify_all()

    def run(self, engine: ProgressEngine) -> None:
        """The sentinel thread's loop, until the engine stops."""
        if engine.thread_started is not None:
            engine.thread_started()
        cv = self._cv
        seen = 0  # the vacancies counted at the previous look
        vacant_seen = -1  # the count when the lead was last seen vacant (-1: held since)
        park = False
        while True:
            lead = False
            with cv:
                if engine._stopping:
                    return
                if park and seen == self._vacancies:
                    # until the next vacancy; it began when it woke the sentinel, so a look
                    # an interval later that finds it still vacant (no other since) fills it
                    self._parked = True
                    while self._parked and not engine._stopping:
                        cv.wait()
                    self._parked = park = False
                    seen = vacant_seen = self._vacancies
                    wait = self.interval
                else:  # (a vacancy noted since the look that chose to park: look)
                    park = False
                    self.looks += 1
                    count = self._vacancies
                    wait = self.interval
                    if engine._leadership_held_locked():
                        vacant_seen = -1
                        park = seen == count  # none began since the previous look
                        if park:
                            wait = 0.0
                    elif vacant_seen == count:  # the same vacancy a whole interval on
                        vacant_seen = -1
                        lead = engine._fill_vacancy_locked()
                    else:
                        vacant_seen = count
                    seen = count
                if not lead and wait > 0 and not engine._stopping:
                    cv.wait(wait)  # notes do not cut it short, only the engine's stop
            if lead:
                engine._lead_for_sentinel()
