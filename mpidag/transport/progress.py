"""Progress engine: Leader/Followers over one transport, with lazy promotion.

Exactly one thread at a time *leads*: it polls the transport and dispatches what arrives.

* A user thread that waits for a reply (``rpc_sync``, ``Future.wait``) leads itself while
  it waits, so its reply costs no thread hand-off. Requests it receives go to the pool.
* Otherwise a pool thread leads. When it receives a request it vacates the leadership and
  runs the request inline (no hand-off for the common short call). A *sentinel* thread
  watches each vacancy that nobody was handed: if the leadership stays vacant for a whole
  ``sentinel_interval`` while a request runs, it wakes an idle pool thread to lead, so a
  long or blocking user function never stalls the receipt of messages. It looks once per
  interval while vacancies happen and parks, until the next one, after a look that finds
  a leader and no vacancy begun since the look before: neither an idle rank nor a
  training loop wakes it 1,000 times a second (see :mod:`mpidag.transport.sentinel`).
* A pool leader that finds nothing yields for ``spin`` seconds (``MPIDAG_POLL_SPIN_S``,
  50 ms), then sleeps with an exponential backoff up to ``max_sleep``
  (``MPIDAG_BACKOFF_MAX``), which bounds the idle CPU cost. The yielding phase covers the
  gaps of a pipeline (a rank waits while its peer computes for a few ms): with 200 us of
  it, a rank woken after such a gap slept up to 1 ms per message (measured: 3 of the 16 ms
  of a distributed forward + backward of 1,000 small ops; a pipeline stage of 20 ms needs
  more than 10 ms). A user thread waiting for its own reply yields as long before it
  sleeps: if both ends of a call sleep, each message waits for the other's sleep to end
  (3.8 ms round trips measured).
  Short waits yield (``os.sched_yield``, 0.5 us) instead of sleeping: the shortest
  ``time.sleep`` measured 25-85 us on the VMs this was tuned on.
* While another thread of the process may compute (a work item: a remote function, a
  backward step; or the main thread, unless it waits inside mpidag), a polling
  thread sleeps instead of yielding, and wakes when that ends: with one core per rank, a
  spinning poller halved the speed of the computing thread (a 2.9 ms backward step took
  5.8 ms) and made a 10 us send take 340 us (GIL hand-offs).

Work items are plain callables; the dispatcher decides what is work and what is handled
inline (completing a future).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from mpidag._backoff import PURE_SPIN, Backoff
from mpidag.transport.doorbell import Doorbell
from mpidag.transport.frames import Envelope
from mpidag.transport.growth import PoolGrowth
from mpidag.transport.naps import MainThreadCPU, Naps
from mpidag.transport.parking import Parking
from mpidag.transport.sentinel import Sentinel

__all__ = ["EngineSnapshot", "MainThreadCPU", "ProgressEngine"]

log = logging.getLogger(__name__)

Work = Callable[[], None]

class _WorkFlag(threading.local):
    #: true in a pool thread: only a work item it runs ever waits in ``wait_until`` (its
    #: steps as the leader complete futures with mpidag's own callbacks, which never wait),
    #: so the flag is set once per thread, not around every work item (0.25 us a message)
    active = False


_in_work = _WorkFlag()
#: the longest wait of one ``poll_wait`` call of a leader that would spin, seconds (its
#: Python checks run between windows: a stop or a condition set by another thread without
#: an interrupt is seen within this)
WAIT_WINDOW = 20e-6
#: a user thread that waits while another leads first yields the core this many times
#: (0.5 us each: the leader hands over within microseconds), then sleeps on the doorbell
USER_SPINS = 50
#: and sleeps at most this long at a time before it looks again (seconds)
USER_WAIT = 0.05


def _nothing() -> None:
    pass


#: after a long silence a leader's sleeps may grow to this many times ``max_sleep`` (see
#: :data:`mpidag._backoff.LONG_IDLE_SHARE`)
LONG_SLEEP_FACTOR = 10


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """A progress engine's state as tools see it (:meth:`ProgressEngine.snapshot`)."""

    leader_busy: bool
    waiting_user_threads: int
    idle_pool_threads: int
    queued_requests: int
    running_requests: int
    pool_threads: int
    #: the sentinel sleeps until the next vacancy (a leader or a waiter holds the lead)
    sentinel_parked: bool = False
    #: idle pool threads still parked: the others were woken and have not yet looked for
    #: work (``idle_pool_threads - parked_pool_threads`` are on their way)
    parked_pool_threads: int = 0
    #: the sentinel's looks at the leadership so far (how often it woke)
    sentinel_looks: int = 0


def _run(work: Work) -> None:
    """Run a work item that the caller counted in ``_running_work`` (and uncounts)."""
    try:
        work()
    except BaseException:  # SystemExit too: a pool thread must never die of its work
        log.exception("work item failed")


def _dispatch_safely(dispatch: Callable[[Envelope], Work | None], env: Envelope
                     ) -> Work | None:
    """``dispatch(env)``; an error is logged, never fatal to the leader."""
    try:
        return dispatch(env)
    except Exception:
        log.exception("dispatch of a message of kind %d from rank %d failed",
                      env.kind, env.src)
        return None


class ProgressEngine:
    """Leader/Followers progress with ``num_threads`` pool threads and a sentinel.

    Args:
        poll: receive one message or return ``None`` at once (the transport's ``poll``).
        dispatch: handle a message; return a work item to run on a thread, or ``None``.
        on_idle: called by the leader after every poll (cheap: timers, deadlines).
        num_threads: pool threads that run requests and lead when no user thread waits.

    Example::

        >>> engine = runtime.agent.engine  # ProgressEngine(transport.poll, agent.dispatch, ...)
        >>> future = runtime.agent.call(1, torch.add, (torch.ones(1), 1), {}, timeout=10)
        >>> engine.wait_until(future.done, deadline=None)   # leads until the future is done
        True
    """

    def __init__(
        self,
        poll: Callable[[], Envelope | None],
        dispatch: Callable[[Envelope], Work | None],
        on_idle: Callable[[], None],
        num_threads: int,
        *,
        spin: float = 50e-3,
        min_sleep: float = 50e-6,
        max_sleep: float = 1e-3,
        sentinel_interval: float = 5e-3,
        name: str = "mpidag",
        poll_wait: Callable[[float], Envelope | None] | None = None,
        interrupt: Callable[[], None] | None = None,
        doorbell: Doorbell | None = None,
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {num_threads!r}")
        self._poll = poll
        #: ``poll_wait(seconds)``: a poll that waits up to ``seconds`` outside Python, without
        #: the GIL (the compiled MPI path); a leader that would spin polls through it in
        #: windows of :data:`WAIT_WINDOW`, and ``interrupt()`` ends a window early (a user
        #: thread wants to lead, a waiter's condition changed, the engine stops)
        self._poll_wait = poll_wait
        self._window = WAIT_WINDOW if poll_wait is not None else 0.0
        self._interrupt = interrupt if interrupt is not None else _nothing
        self._dispatch = dispatch
        self._on_idle = on_idle
        #: a leader's step: poll, hook, dispatch (see set_step)
        self._step: Callable[[float], Work | None | bool] = self._python_step
        self._spin = spin
        self._min_sleep = min_sleep
        self._max_sleep = max_sleep
        self._lock = threading.Lock()
        #: idle pool threads, woken newest first (their memory is warm: parking.py)
        self._pool_cv = Parking(self._lock)
        #: where user threads wait while another thread leads (see doorbell.py): rung by
        #: completions, a vacant leadership and stop; the agent gives the C one
        self._doorbell = doorbell if doorbell is not None else Doorbell()
        self._leader_busy = False
        #: user threads that want to lead (parked in wait_until); with the Python doorbell
        #: the compiled call path reads it after a completion and calls wake_waiters only
        #: when it is not 0 (the C doorbell it rings itself, which costs less than the read)
        self.waiting_users = 0
        self._idle = 0  # pool threads parked
        self._work: collections.deque[Work] = collections.deque()
        self._running_work = 0
        self._blocked_work = 0  # of those, work items waiting in wait_until (not computing)
        self._naps = Naps(self._lock)
        self._sentinel = Sentinel(self._lock, sentinel_interval)
        self._stopping = False
        self._name = name
        #: called first on every thread this engine starts (pool threads, the sentinel):
        #: the runtime binds its threads to itself there (several runtimes in one process)
        self.thread_started: Callable[[], None] | None = None
        #: the pool grows past ``num_threads`` only while every pool thread waits for a
        #: nested call and a request is queued (see _grow_if_starved_locked)
        self._growth = PoolGrowth(num_threads, name)
        sentinel = threading.Thread(target=self._sentinel.run, args=(self,),
                                    name=f"{name}-sentinel", daemon=True)
        #: the pool threads, then the sentinel; grows by pool threads (under the lock)
        self._threads = [
            threading.Thread(target=self._pool_main, name=f"{name}-pool-{i}", daemon=True)
            for i in range(num_threads)
        ] + [sentinel]

    def set_step(self, step: Callable[[float], Work | None | bool]) -> None:
        """Replace the leader's step (before :meth:`start`: the agent gives its compiled one
        once its parts exist). ``step(wait)`` does what :meth:`_python_step` does: poll once
        (``wait``: through ``poll_wait``, up to that many seconds), run the after-poll hook
        and dispatch what arrived; it returns ``False`` when nothing arrived, ``None`` when
        the message was handled, else the work item to run. An error it raises is logged
        and the leader goes on (the compiled step runs the hook before its poll, so a
        failing hook loses no message; a failing dispatch names the message it lost).

        Example::

            >>> engine = ProgressEngine(lambda: None, lambda env: None, lambda: None, 1)
            >>> engine.set_step(lambda wait: False)  # nothing ever arrives (the agent: Core.step)
        """
        self._step = step

    @property
    def pool_size(self) -> int:
        """How many pool threads this rank has (``num_threads``, more if it grew)."""
        return len(self._threads) - 1  # (the sentinel)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        with self._lock:  # a copy: a started thread may grow the pool meanwhile
            threads = list(self._threads)
        for thread in threads:
            thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop all threads; running work items finish first (up to ``timeout``)."""
        with self._lock:
            self._stopping = True
            self._interrupt()
            self._pool_cv.notify_all()
            self._doorbell.ring()
            self._sentinel.wake_locked()
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for thread in self._threads:
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive() and t is not me]
        if alive:
            log.warning("progress threads still running user code at shutdown: %s", alive)

    def snapshot(self) -> EngineSnapshot:
        """The engine's state for tools (a consistent copy, taken under its lock).

        Example::

            >>> engine = runtime.agent.engine
            >>> engine.snapshot().pool_threads == runtime.options.num_worker_threads
            True
        """
        with self._lock:
            return EngineSnapshot(self._leader_busy, self.waiting_users, self._idle,
                                  len(self._work), self._running_work, self.pool_size,
                                  self._sentinel.parked, len(self._pool_cv),
                                  self._sentinel.looks)

    @property
    def busy(self) -> bool:
        """Whether work is queued or running."""
        return bool(self._work) or self._running_work > 0

    # ------------------------------------------------------------------- pool
    def _pool_main(self) -> None:
        if self.thread_started is not None:
            self.thread_started()
        _in_work.active = True
        lock = self._lock
        finished = False  # this thread just ran a work item (counted in _running_work)
        backoff = self._new_backoff()  # this thread's, reset at each leadership
        while True:
            with lock:
                if finished:
                    finished = False
                    self._running_work -= 1
                    self._naps.wake_locked()
                while True:
                    if self._stopping and not self._work:
                        return
                    if self._work:  # queued requests first: nobody else may run them
                        work = self._work.popleft()
                        self._running_work += 1
                        break
                    if not self._leader_busy and self.waiting_users == 0 and not self._stopping:
                        self._leader_busy = True
                        work = None
                        break
                    self._idle += 1
                    self._pool_cv.wait()
                    self._idle -= 1
            if work is None:
                work = self._lead_as_pool(backoff=backoff)  # work counted in _running_work
                if work is None:
                    continue
            _run(work)
            finished = True
            # drop the request (and its tensors) now, not when the next one is received:
            # large received tensors return their buffers to the receive cache on release
            del work

    def _lead_as_pool(self, sentinel: bool = False, backoff: Backoff | None = None
                      ) -> Work | None:
        """Lead until a request arrives (returned, leadership vacated) or a user waits.

        ``sentinel``: the sentinel leads because every pool thread is busy: it runs no
        request itself (it queues them) and hands over as soon as a pool thread is idle.
        ``backoff``: the pool thread's own, reset here (as a new one: 0.3 us less each
        request a pool leader serves), else a new one.
        """
        if backoff is None:
            backoff = self._new_backoff()
        else:
            backoff.reset()
        step = self._step
        wait = 0.0  # a window of poll_wait while the backoff would spin
        while True:
            if self.waiting_users or self._stopping or (sentinel and self._idle):
                with self._lock:
                    self._vacate_locked()
                return None
            if self._work and not sentinel:  # queued by a user thread's leadership
                with self._lock:
                    work = self._work.popleft() if self._work else None
                    if work is not None:
                        self._running_work += 1
                        self._vacate_locked(lazy=True)
                if work is not None:
                    return work
            try:
                work = step(wait)
            except Exception:
                work = self._step_failed()
            if work is False:
                computing = self._computing()
                backoff.idle(computing)
                # the spinning phase in poll_wait's windows (the yielding one stays here)
                wait = self._window if not computing and \
                    backoff.idle_seconds() < PURE_SPIN else 0.0
                continue
            backoff.reset()
            if work is None:
                continue
            if sentinel:
                self.submit(work)
                work = None
                continue
            with self._lock:
                self._running_work += 1
                self._vacate_locked(lazy=True)
            return work

    def _python_step(self, wait: float) -> Work | None | bool:
        """The leader's step in Python (see :meth:`set_step`): poll, hook, dispatch."""
        env = self._poll_step(wait)
        if env is None:
            return False
        return _dispatch_safely(self._dispatch, env)

    def _step_failed(self) -> bool:
        """Log the error a step raised (its hook runs again: it may not have run); as if
        nothing arrived."""
        log.exception("the progress leader's step failed")
        try:
            self._on_idle()
        except Exception:
            log.exception("the leader's after-poll hook failed")
        return False

    def _poll_step(self, wait: float = 0.0) -> Envelope | None:
        """One step of a leader, whoever leads (a pool thread, the sentinel, a waiting user
        thread): poll the transport once (``wait``: through ``poll_wait``, up to that many
        seconds), then run the after-poll hook. An error of either is logged, never fatal:
        a dead leader receives nothing."""
        try:
            env = self._poll_wait(wait) if wait else self._poll()
        except Exception:
            log.exception("transport poll failed")
            env = None
        try:
            self._on_idle()
        except Exception:
            log.exception("the leader's after-poll hook failed")
        return env

    def _new_backoff(self, user: bool = False) -> Backoff:
        """The backoff of a leader's idle polls (see :mod:`mpidag._backoff`); ``user``: a
        waiting user thread's, which naps even while other user threads wait (it leads for
        them all and never hands over to them: skipping its naps for them made it spin at
        a full core beside a computing work item)."""
        nap = self._nap_as_user if user else self._nap
        return Backoff(self._spin, self._min_sleep, self._max_sleep, nap,
                       self._max_sleep * LONG_SLEEP_FACTOR)

    def _computing(self) -> bool:
        """Whether some thread of this process may be computing (see :class:`Naps`)."""
        return self._naps.computing(self._running_work, self._blocked_work)

    def _nap(self, seconds: float) -> None:
        """The leader's sleep (see :meth:`Naps.nap`): none while a thread wants to lead."""
        self._naps.nap(seconds, self._nap_skip)

    def _nap_skip(self) -> bool:
        return bool(self.waiting_users or self._stopping)

    def _nap_as_user(self, seconds: float) -> None:
        self._naps.nap(seconds, self._stopping_now)

    def _stopping_now(self) -> bool:
        return self._stopping

    def parked(self) -> contextlib.AbstractContextManager[None]:
        """Mark this thread as waiting (not computing) while inside the block.

        Example::

            >>> with runtime.agent.engine.parked():   # this thread waits: it computes nothing
            ...     time.sleep(0.01)
        """
        return self._naps.parked()

    def _vacate_locked(self, lazy: bool = False) -> None:
        """Give up the leadership: to a waiting user thread, else to a pool thread.

        ``lazy``: wake no pool thread now; the next thread that wants to lead takes it, and
        the sentinel wakes a pool thread if it stays vacant for a whole interval. The
        sentinel also watches a vacancy that no idle pool thread was there to take.
        """
        self._leader_busy = False
        if self.waiting_users:
            self._doorbell.ring()
        elif lazy or not self._idle:
            self._sentinel.note_vacancy_locked()
        else:
            self._pool_cv.notify()

    def _pass_on_vacancy_locked(self) -> None:
        """A waiting user thread leaves without leading (its condition came true first).

        A leader that saw it waiting handed it the leadership and parked, and the sentinel
        may be parked too (a waiter counts as holding the lead): a vacant lead goes to
        another waiter, else an idle pool thread, else the sentinel is told. Without this
        nobody polled until one of the rank's own threads waited again."""
        if not (self._leader_busy or self._stopping):
            self._vacate_locked(lazy=not self._idle)

    # ----------------------------------------------------- for the Sentinel
    def _leadership_held_locked(self) -> bool:
        """A thread leads, or a user thread is about to."""
        return self._leader_busy or bool(self.waiting_users)

    def _fill_vacancy_locked(self) -> bool:
        """The leadership stayed vacant a whole interval: wake an idle pool thread to lead,
        or, with none idle, claim it for the sentinel (returns True: call
        :meth:`_lead_for_sentinel`)."""
        if self._idle:
            self._pool_cv.notify()
            return False
        self._leader_busy = True
        return True

    def _lead_for_sentinel(self) -> None:
        self._lead_as_pool(sentinel=True)

    def submit(self, work: Work) -> None:
        """Queue ``work`` for a pool thread."""
        with self._lock:
            self._work.append(work)
            if self._idle:
                self._pool_cv.notify()
            else:
                self._grow_if_starved_locked()

    def _grow_if_starved_locked(self) -> None:
        """Start one more pool thread if :class:`PoolGrowth` says so (under the lock)."""
        if not self._growth.wanted(queued=len(self._work), idle=self._idle,
                                   stopping=self._stopping, running=self._running_work,
                                   blocked=self._blocked_work, pool_size=self.pool_size):
            return
        thread = threading.Thread(target=self._pool_main,
                                  name=f"{self._name}-pool-{self.pool_size}", daemon=True)
        self._threads.insert(-1, thread)  # before the sentinel
        thread.start()

    # ------------------------------------------------------------- user waits
    @property
    def interrupt(self) -> Callable[[], None]:
        """What ends a leader's ``poll_wait`` window early (the transport's
        ``interrupt_wait``): :meth:`wake_waiters` calls it first.

        Example::

            >>> runtime.agent.engine.interrupt()   # a window under way ends now
        """
        return self._interrupt

    @property
    def doorbell(self) -> Doorbell:
        """Where user threads wait while another thread leads (see
        :mod:`mpidag.transport.doorbell`): the compiled completion path rings it in C.

        Example::

            >>> bell = runtime.agent.engine.doorbell
            >>> seen = bell.generation; bell.ring(); bell.generation == seen + 1
            True
        """
        return self._doorbell

    def wake_waiters(self) -> None:
        """Tell user threads parked in :meth:`wait_until` to look at their condition again
        (and the leader, which may wait in ``poll_wait`` for one of them)."""
        self._interrupt()
        if self.waiting_users:
            self._doorbell.ring()

    def wait_until(self, done: Callable[[], bool], deadline: float | None) -> bool:
        """Drive progress in this thread until ``done()`` or ``time.monotonic() >= deadline``.

        Returns ``done()``. Requests that arrive meanwhile go to the pool threads.
        """
        if done():
            return True
        lock = self._lock
        blocked = _in_work.active  # a work item that waits: not computing
        naps = self._naps
        main = naps.on_main_thread()
        with lock:
            lead = not self._leader_busy and not self._stopping
            self._blocked_work += blocked
            naps.main_parked += main
            if blocked and self._work:
                self._grow_if_starved_locked()
            if lead:  # the common case: nobody leads (a pool leader vacated lazily)
                self._leader_busy = True
            else:
                self.waiting_users += 1  # from now on pool leaders hand over to this thread
                naps.wake_locked()
                self._interrupt()
        if lead:
            try:
                return self._lead_as_user(done, deadline)
            finally:
                with lock:
                    self._blocked_work -= blocked
                    naps.main_parked -= main
                    self._vacate_locked(lazy=True)
        bell = self._doorbell
        # the current leader hands over within microseconds: yield before sleeping while
        # this wait is younger than PURE_SPIN (a ring for another thread's call ends a wait)
        spin_until = time.perf_counter() + PURE_SPIN
        registered = True
        try:
            while True:
                seen = bell.generation  # before every look: a ring after it is not lost
                with lock:
                    if self._stopping:
                        return done()
                    lead = not self._leader_busy
                    if lead:
                        self._leader_busy = True
                        self.waiting_users -= 1
                        registered = False
                if lead:
                    try:
                        return self._lead_as_user(done, deadline)
                    finally:
                        with lock:
                            # lazy: a thread that calls again soon leads again at no cost
                            self._vacate_locked(lazy=True)
                if done():
                    return True
                if deadline is None:
                    wait = USER_WAIT
                else:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        return False
                # yield the core first, then sleep until rung (a completion, a vacancy,
                # stop) or USER_WAIT passes; the C doorbell does both without the GIL
                bell.wait(seen, min(wait, USER_WAIT),
                          USER_SPINS if time.perf_counter() < spin_until else 0)
        finally:
            with lock:
                self._blocked_work -= blocked
                naps.main_parked -= main
                if registered:
                    self.waiting_users -= 1
                    self._pass_on_vacancy_locked()

    def _lead_as_user(self, done: Callable[[], bool], deadline: float | None) -> bool:
        step = self._step
        # a reply mostly arrives within PURE_SPIN: until then poll in a tight loop, and make
        # the Backoff (0.5 us) only for a longer wait
        backoff: Backoff | None = None
        spin_until = 0.0
        wait = 0.0  # windows of poll_wait while spinning
        while not done():
            try:
                work = step(wait)
            except Exception:
                work = self._step_failed()
            if work is False:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                if self._stopping:
                    return done()
                computing = self._computing()
                if backoff is None:
                    if not computing:
                        now = time.perf_counter()
                        if not spin_until:
                            spin_until = now + PURE_SPIN
                            wait = self._window
                            continue
                        if now < spin_until:
                            continue
                    wait = 0.0
                    backoff = self._new_backoff(user=True)
                backoff.idle(computing)
                continue
            spin_until = 0.0
            wait = 0.0
            if backoff is not None:
                backoff.reset()
            if work is not None:
                self.submit(work)
                work = None
        return True
