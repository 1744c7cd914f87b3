"""When the progress engine starts one more pool thread, and saying so once.

A rank's pool threads run requests; a request may itself wait for a nested call. When every
pool thread runs such a request and another request is queued, those calls could wait for
each other forever (chains of ``rpc_sync`` through every rank, from every rank at once, need
more threads than ``num_worker_threads``), so the pool grows by one thread, up to a cap.
"""

from __future__ import annotations

import logging

__all__ = ["MAX_POOL_THREADS", "PoolGrowth"]

log = logging.getLogger(__name__)

#: the most pool threads a rank starts when all of them wait for nested calls
MAX_POOL_THREADS = 256


class PoolGrowth:
    """The growth rule of one engine's pool; warns the first time it grows and errs the
    first time it is at its cap.

    Example::

        >>> growth = PoolGrowth(num_threads=1, name="doc")
        >>> growth.wanted(queued=1, idle=0, stopping=False, running=1, blocked=1, pool_size=1)
        True
        >>> growth.wanted(queued=1, idle=0, stopping=False, running=1, blocked=0, pool_size=1)
        False
    """

    def __init__(self, num_threads: int, name: str) -> None:
        #: the pool grows past ``num_threads`` up to this many threads
        self.max_threads = max(MAX_POOL_THREADS, num_threads)
        self._name = name
        self._grown = self._at_max = False  # (each logged once)

    def wanted(self, *, queued: int, idle: int, stopping: bool, running: int, blocked: int,
               pool_size: int) -> bool:
        """Whether to start one more pool thread now: a request is queued, no pool thread
        is idle, and every one of them runs a request that waits (``blocked``)."""
        if (not queued or idle or stopping or blocked < running or running < pool_size):
            return False
        if pool_size >= self.max_threads:
            self._say_once("_at_max", logging.ERROR, "%s: all %d pool threads wait for nested "
                           "calls and requests are queued; no more threads will be started "
                           "(a deadlock unless a call times out)", pool_size)
            return False
        self._say_once("_grown", logging.WARNING, "%s: all %d pool threads wait for nested "
                       "calls while a request is queued; starting more threads (raise "
                       "num_worker_threads to avoid this)", pool_size)
        return True

    def _say_once(self, flag: str, level: int, message: str, pool_size: int) -> None:
        """Log ``message`` the first time only (``flag`` names the attribute that remembers)."""
        if not getattr(self, flag):
            setattr(self, flag, True)
            log.log(level, message, self._name, pool_size)
