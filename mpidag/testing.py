"""Helpers for tests of mpidag programs (and of mpidag itself).

Example::

    from mpidag import testing
    with testing.delayed_control_messages(max_delay=0.01, seed=rank):
        ...  # RRef protocol messages now arrive late and out of order
    testing.quiesce()   # collective: every rank here, nothing in flight
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import random
import threading
import time
from collections.abc import Iterator

from mpidag.rpc.api import current_agent
from mpidag.rpc.messages import Kind

__all__ = ["quiesce", "delayed_control_messages"]


def quiesce(timeout: float = 60.0) -> None:
    """Collective: return when every rank called this and no message is in flight."""
    current_agent().wait_quiescent(timeout)


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
    """Delay every CONTROL message (RRef protocol steps) sent by this rank by a random time
    up to ``max_delay`` seconds, so they arrive late and reordered. Leaving the block
    sends whatever is still held back."""
    transport = current_agent().transport
    sender = _DelayedSender(transport, max_delay, seed)
    transport.send_hook = sender.hook
    try:
        yield sender
    finally:
        transport.send_hook = None
        sender.stop()
