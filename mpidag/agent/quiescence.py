"""The shutdown's termination test: every rank is here and no message is in flight."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mpidag._backoff import Backoff
from mpidag.agent.calls import OutgoingCalls
from mpidag.agent.handlers import Plugins
from mpidag.agent.peers import Peers
from mpidag.agent.sending import Sender
from mpidag.errors import RPCTimeoutError
from mpidag.transport.base import Transport
from mpidag.transport.progress import ProgressEngine

__all__ = ["Quiescence"]

log = logging.getLogger(__name__)

#: seconds between the progress lines of a long wait for the other ranks
REPORT_EVERY = 30.0


class Quiescence:
    """The four-counter termination test over the transport's nonblocking all-reduce.

    Example::

        >>> sent, processed, busy = runtime.agent.quiescence.counters()  # of this rank
        >>> busy                        # nothing queued or running here
        0

    ``quiescence.wait(timeout)`` is collective: it returns on every rank together.
    """

    def __init__(self, transport: Transport, peers: Peers, sender: Sender,
                 calls: OutgoingCalls, plugins: Plugins, engine: ProgressEngine) -> None:
        self.transport = transport
        self.peers = peers
        self.sender = sender
        self.calls = calls
        self.plugins = plugins
        self.engine = engine

    def counters(self) -> tuple[int, int, int]:
        """``(sent, processed, busy)`` of this rank, the failed ranks' messages left out."""
        busy = int(self.engine.busy or bool(len(self.calls)) or self.plugins.any_busy())
        sent, processed = self.sender.totals()
        return sent, processed, busy

    def wait(self, timeout: float) -> None:
        """Return when every rank is here and no message is in flight anywhere.

        Repeats a nonblocking all-reduce of (sent, processed, busy) until two rounds in a
        row show equal totals, nothing busy and no change. Pool threads keep serving
        requests meanwhile.
        """
        wait_collective = self.collective_waiter(
            timeout, "some rank did not call shutdown() or still has calls in flight")
        previous: list[int] | None = None
        while True:
            sent, processed, busy = self.counters()
            totals = self.transport.allreduce_sum([sent, processed, busy], wait_collective)
            if totals[0] == totals[1] and totals[2] == 0 and totals == previous:
                return
            previous = totals

    def collective_waiter(self, timeout: float, hint: str
                          ) -> Callable[[Callable[[], bool]], None]:
        """A ``wait(done)`` for nonblocking collectives of this rank's main thread.

        It sleeps with a short backoff (the pool threads keep serving meanwhile), logs a
        progress line every 30 s, and raises ``RPCTimeoutError`` (naming ``hint``) after
        ``timeout`` seconds (0: no limit).
        """
        start = time.monotonic()
        deadline = start + timeout if timeout > 0 else None
        where = self.peers.where()
        next_report = [start + REPORT_EVERY]

        def wait(done: Callable[[], bool]) -> None:
            with self.engine.parked():
                backoff = Backoff(spin=0.0, min_sleep=20e-6, max_sleep=10e-3)
                while not done():
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        raise RPCTimeoutError(
                            f"{where} timed out after {timeout} s waiting for the other "
                            f"ranks; {hint}")
                    if now >= next_report[0]:
                        log.warning("%s: waiting %.0f s for all ranks to finish (%s)",
                                    where, now - start, hint)
                        next_report[0] = now + REPORT_EVERY
                    backoff.idle()

        return wait
