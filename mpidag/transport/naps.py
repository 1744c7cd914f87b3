"""Courtesy to computing threads: a polling leader naps while another thread of the
process may compute, and is woken when that ends or a thread wants to lead.

With one core per rank, a spinning poller halved the speed of the computing thread (a
2.9 ms backward step took 5.8 ms) and made a 10 us send take 340 us (GIL hand-offs).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["MainThreadCPU", "Naps"]

_MAIN = threading.main_thread()
_MAIN_IDENT = _MAIN.ident
_get_ident = threading.get_ident


class MainThreadCPU:
    """Whether the main thread used the CPU lately, from the kernel's count of its on-CPU
    time (``/proc/self/task/<tid>/schedstat``, read at most every ``interval`` seconds).

    A main thread that waits outside mpidag (``torch.futures.wait_all`` on RPC futures, a
    lock, a C++ call) is not computing, and the leader should poll for its answer instead
    of napping: measured, one ``rpc_async`` at a time waited with ``wait_all`` took 365 us
    per call with naps, 89-91 us with this check, and 40-53 us with ``Future.wait()``,
    which marks the thread as waiting. A main thread that computes keeps its core: the
    leader naps. Where the kernel does not tell (no such file), the main thread always
    counts as busy, as before.

    Example (``busy()`` is True while the main thread computes, which a loaded machine may
    not let it do; a main thread that sleeps is never busy)::

        >>> cpu = MainThreadCPU(interval=0.0)
        >>> time.sleep(0.05)     # the main thread (this one) waits
        >>> cpu.busy()
        False
    """

    __slots__ = ("_fd", "_interval_ns", "_checked_at", "_cpu_ns", "_busy")

    #: the main thread counts as busy when it was on a CPU for this share of the interval
    BUSY_SHARE = 0.5

    def __init__(self, interval: float = 1e-4) -> None:
        self._interval_ns = int(interval * 1e9)
        self._busy = True
        try:
            self._fd: int | None = os.open(
                f"/proc/self/task/{_MAIN.native_id}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._checked_at = time.perf_counter_ns()
        self._cpu_ns = self._read()

    def _read(self) -> int:
        if self._fd is None:
            return 0
        try:
            return int(os.pread(self._fd, 64, 0).split()[0])
        except (OSError, ValueError, IndexError):
            self._fd = None
            return 0

    def busy(self) -> bool:
        if self._fd is None:
            return True
        now = time.perf_counter_ns()
        elapsed = now - self._checked_at
        if elapsed < self._interval_ns:
            return self._busy
        cpu = self._read()
        self._busy = (cpu - self._cpu_ns) > self.BUSY_SHARE * elapsed
        self._checked_at, self._cpu_ns = now, cpu
        return self._busy


class Naps:
    """Who may be computing, and the naps of a leader meanwhile.

    ``lock``: the progress engine's lock; the counts change under it (``*_locked``), so a
    thread that starts to wait and a leader that starts a nap never miss each other.

    Example::

        >>> naps = Naps(threading.Lock())
        >>> naps.computing(running_work=1, blocked_work=0)   # a work item computes
        True
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.main_parked = 0  # the main thread waits inside mpidag (is not computing)
        self.nappers = 0  # leaders napping in nap() (woken when computing ends)
        self._nap_lock = threading.Lock()  # held; a waker releases it to end a nap
        self._nap_lock.acquire()
        self._main_cpu = MainThreadCPU()

    def computing(self, running_work: int, blocked_work: int) -> bool:
        """Whether some thread of this process may be computing: a work item that is not
        waiting, or the main thread while it is not waiting inside mpidag and used the CPU
        lately (other threads of the program are not counted: idle timers and monitors are
        common)."""
        if running_work > blocked_work:
            return True
        return not self.main_parked and _MAIN.is_alive() and self._main_cpu.busy()

    def nap(self, seconds: float, skip: Callable[[], bool]) -> None:
        """The leader's sleep: ends early when a computation ends or a thread wants to
        lead (both call :meth:`wake_locked`); none if ``skip()`` (checked under the lock).
        A timed acquire of a held lock, which the waker releases: 62 us of CPU per wakeup
        here, a ``Condition.wait`` 90 us."""
        with self._lock:
            if skip():
                return
            self.nappers += 1
        try:
            self._nap_lock.acquire(timeout=seconds)  # released by a waker: keep it held
        finally:
            with self._lock:
                self.nappers -= 1

    def wake_locked(self) -> None:
        """End the naps in progress (call with the lock held)."""
        if self.nappers:
            with contextlib.suppress(RuntimeError):  # already released: a nap ends anyway
                self._nap_lock.release()

    @staticmethod
    def on_main_thread() -> bool:
        """Whether the calling thread is the main thread."""
        return _get_ident() == _MAIN_IDENT

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        """Mark this thread as waiting (not computing) while inside the block."""
        main = self.on_main_thread()
        with self._lock:
            self.main_parked += main
            self.wake_locked()
        try:
            yield
        finally:
            with self._lock:
                self.main_parked -= main
