"""An in-process transport: the ranks of a job as threads of one process.

Same interface and same framing as the MPI transport (:class:`~.base.FramedTransport`
encodes and decodes every message, allocates received tensors and copies them), with
queues in place of MPI. It lets the agent, RRef and autograd protocols be unit-tested in
one process, in milliseconds and without ``mpirun``, as dask's ``inproc`` comm does; the
MPI transport remains the product and keeps its multi-rank tests.

Example::

    >>> from mpidag.transport.frames import Envelope
    >>> world = InProcWorld(2)
    >>> t0, t1 = world.transports
    >>> t0.send(1, Envelope(kind=1, payload=b"hi"), [])
    >>> bytes(t1.poll().payload)
    b'hi'
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mpidag._backoff import Backoff
from mpidag.errors import RPCError
from mpidag.transport.base import FramedTransport
from mpidag.transport.frames import Envelope

__all__ = ["InProcAbort", "InProcTransport", "InProcWorld"]

#: how long a collective waits for the other ranks before it fails (a test would hang)
COLLECTIVE_TIMEOUT = 60.0


class InProcAbort(RPCError):
    """``abort()`` of an in-process rank: the whole in-process world is ended."""


class InProcWorld:
    """``size`` in-process ranks sharing queues; ``transports[r]`` is rank ``r``'s.

    Example::

        >>> world = InProcWorld(3)
        >>> [t.rank for t in world.transports]
        [0, 1, 2]
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an in-process world needs at least 1 rank, got {size!r}")
        self.size = size
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        #: frame 0 of each message, per destination: (source, frame0)
        self.inboxes: list[collections.deque[tuple[int, bytearray]]] = [
            collections.deque() for _ in range(size)]
        #: frames after frame 0: (destination, source, tag) -> queue of byte strings
        self.frames: dict[tuple[int, int, int], collections.deque[bytes]] = \
            collections.defaultdict(collections.deque)
        #: collective number -> {rank: contribution}
        self.rounds: dict[int, dict[int, Any]] = collections.defaultdict(dict)
        self.readers: dict[int, int] = collections.defaultdict(int)
        self.aborted: int | None = None
        self.transports = [InProcTransport(self, rank) for rank in range(size)]

    def deliver_all(self, dispatch: list[Callable[[Envelope], Callable[[], None] | None]]
                    ) -> int:
        """Deliver every queued message in the calling thread, highest rank first, until
        none is left: ``dispatch[r]`` is rank ``r``'s dispatcher (its agent's), and a work
        item it returns runs at once. Returns how many messages were delivered. For
        harnesses that carry calls through the real agents with no engine threads
        (``benchmarks/inproc_cost.py``, ``tests/test_fastpath.py``).

        Example::

            >>> world = InProcWorld(1)
            >>> world.deliver_all([print])      # nothing queued: returns at once
            0
        """
        delivered = 0
        progressed = True
        while progressed:
            progressed = False
            for transport in self.transports[::-1]:
                env = transport.poll()
                if env is not None:
                    progressed = True
                    delivered += 1
                    work = dispatch[transport.rank](env)
                    if work is not None:
                        work()
        return delivered

    def contribute(self, number: int, rank: int, value: Any) -> None:
        with self.changed:
            self.rounds[number][rank] = value
            self.changed.notify_all()

    def complete(self, number: int) -> bool:
        return len(self.rounds.get(number, ())) == self.size

    def result(self, number: int) -> list[Any]:
        """Every rank's contribution to collective ``number`` (once it is complete)."""
        with self.lock:
            values = self.rounds[number]
            out = [values[r] for r in range(self.size)]
            self.readers[number] += 1
            if self.readers[number] == self.size:
                del self.rounds[number], self.readers[number]
            return out


class InProcTransport(FramedTransport):
    """Rank ``rank`` of an :class:`InProcWorld`."""

    def __init__(self, world: InProcWorld, rank: int, recv_cache_bytes: int = 0) -> None:
        super().__init__(rank, world.size, (1 << 20) - 1, recv_cache_bytes)
        self.world = world
        self._collectives = 0
        self.probe_frame0 = self._probe_now  # (lock-free: a deque per rank)

    def _check(self) -> None:
        if self.world.aborted is not None:
            raise InProcAbort(f"the in-process world was aborted with code "
                              f"{self.world.aborted}")

    # ------------------------------------------------------- moving bytes
    def send_frame0(self, dst: int, frame0: bytes | bytearray) -> None:
        self._check()
        self.world.inboxes[dst].append((self.rank, bytearray(frame0)))

    def _send_frame(self, dst: int, tag: int, buffer: Any) -> None:
        data = buffer.cpu().numpy().tobytes() if isinstance(buffer, torch.Tensor) \
            else bytes(buffer)
        with self.world.lock:
            self.world.frames[(dst, self.rank, tag)].append(data)

    def _probe(self) -> tuple[int, bytearray] | None:
        inbox = self.world.inboxes[self.rank]
        if not inbox:  # (an empty poll, the common one, raises nothing)
            return None
        try:
            return inbox.popleft()
        except IndexError:  # another thread took the last one meanwhile
            return None

    def _probe_now(self, seconds: float) -> tuple[int, bytearray] | None:
        """:attr:`probe_frame0`: never waits (this transport has no ``poll_wait``, so a
        leader asks for no wait)."""
        return self._probe()

    def _recv_frame(self, src: int, tag: int, buffer: Any) -> None:
        key = (self.rank, src, tag)
        frames = self.world.frames
        backoff = Backoff(spin=1e-3, min_sleep=20e-6, max_sleep=1e-3)
        while True:  # the sender queues frame 0 first, then the rest
            with self.world.lock:
                queue = frames.get(key)
                if queue:
                    data = queue.popleft()
                    if not queue:
                        del frames[key]
                    break
            self._check()
            backoff.idle()
        if len(data) != len(buffer):
            raise RuntimeError(f"in-process frame of {len(data)} bytes for a buffer of "
                               f"{len(buffer)}")
        if isinstance(buffer, memoryview):
            buffer[:] = data
        else:
            np.copyto(np.asarray(buffer), np.frombuffer(data, dtype=np.uint8))

    # ------------------------------------------------------------- collectives
    def _next_collective(self, value: Any) -> int:
        number = self._collectives
        self._collectives += 1
        self.world.contribute(number, self.rank, value)
        return number

    def allgather(self, obj: Any) -> list[Any]:
        number = self._next_collective(obj)
        world = self.world
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT
        with world.changed:
            while not world.complete(number):
                self._check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"in-process rank {self.rank}: allgather {number} "
                                       f"incomplete after {COLLECTIVE_TIMEOUT} s")
                world.changed.wait(0.05)
        return world.result(number)

    def allreduce_sum(self, values: list[int], wait: Callable[[Callable[[], bool]], None]
                      ) -> list[int]:
        number = self._next_collective(list(values))
        world = self.world

        def done() -> bool:
            self._check()
            return world.complete(number)

        wait(done)
        return [sum(column) for column in zip(*world.result(number), strict=True)]

    def abort(self, code: int = 1) -> None:
        with self.world.changed:
            self.world.aborted = code
            self.world.changed.notify_all()
        raise InProcAbort(f"rank {self.rank} aborted the in-process world with code {code}")
