"""Outgoing calls: the table of calls waiting for an answer, their deadlines and futures.

A call's timeout is resolved once (:meth:`OutgoingCalls.deadline_after`: torch's rule, a
``time.monotonic()`` deadline or ``None``) and expired in one place
(:meth:`OutgoingCalls.expire`), whether the leader's scan (:meth:`OutgoingCalls.expire_due`)
or a waiting thread found it late.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.autograd.profiler import record_function

from mpidag._ids import IdGenerator
from mpidag._remote_profiling import (
    call_profiling,
    function_name,
    legacy_profiling,
    profiled_call,
    rpc_profiling_key,
)
from mpidag.agent.encoding import CallCodec
from mpidag.agent.futures import RpcFuture
from mpidag.agent.handlers import Handler, Plugins, describe, is_asynchronous
from mpidag.agent.messages import CALL, CONTROL, NOTIFY, RESULT
from mpidag.agent.peers import Peers
from mpidag.agent.sending import Sender
from mpidag.errors import (
    RPCError,
    RPCTimeoutError,
    SerializationError,
    WorkerDiedError,
    WorkerFailedError,
    storable,
    unpack_exception,
)
from mpidag.transport.frames import Envelope, loads
from mpidag.transport.progress import ProgressEngine

__all__ = ["EXPIRY_SCAN_INTERVAL", "FULL_SCAN_INTERVAL", "OutgoingCalls", "PendingCall",
           "PendingCallView"]

log = logging.getLogger(__name__)

#: how often the leader looks for expired deadlines, seconds; it scans the table only when
#: :attr:`OutgoingCalls.earliest_deadline` has passed (or every :data:`FULL_SCAN_INTERVAL`)
EXPIRY_SCAN_INTERVAL = 5e-3
#: a scan of the whole table at least this often, seconds, whatever ``earliest_deadline``
#: says: should an update of it ever be lost to a race of threads, a call expires this much
#: later at most
FULL_SCAN_INTERVAL = 0.25


class PendingCall:
    """A call waiting for its answer: completes a future (``rpc_async``) or, for a caller
    that waits for the answer itself (``rpc_sync``, ``to_here``), holds the answer in
    ``value``/``error`` and sets ``done``: no ``torch.futures.Future`` is made for those
    (creating, completing and waiting on one costs ~2 us)."""

    __slots__ = ("request_id", "future", "dst", "deadline", "func", "seconds", "args", "done",
                 "value", "error", "started")

    def __init__(self, request_id: int, future: RpcFuture | None, dst: int, started: float,
                 deadline: float | None, func: Any, seconds: float, args: tuple) -> None:
        self.request_id = request_id
        self.future = future
        self.dst = dst
        self.started = started  # time.monotonic() when the call was made (for tools)
        self.deadline = deadline  # time.monotonic() deadline, None for none
        self.func = func  # for error messages
        self.seconds = seconds  # the timeout, for error messages
        self.args = args
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def is_done(self) -> bool:
        return self.done

    def set_result(self, value: Any) -> None:
        if self.future is not None:
            self.future.set_result(value)
        else:
            self.value = value
        self.done = True

    def set_exception(self, error: BaseException) -> None:
        if self.future is not None:
            self.future.set_exception(storable(error))
        else:
            self.error = error
        self.done = True

    @property
    def what(self) -> str:
        return describe(self.func, self.args)


@dataclass(frozen=True, slots=True)
class PendingCallView:
    """A call in flight as tools see it (:meth:`OutgoingCalls.snapshot`)."""

    request_id: int
    what: str
    dst: int
    started: float  # time.monotonic()
    timeout_s: float


class OutgoingCalls:
    """This rank's calls to other ranks, from sending to their answer or their end.

    Example::

        >>> calls = runtime.agent.calls
        >>> calls.call_sync(1, torch.add, (torch.ones(2), 1), {}, timeout=10)
        tensor([2., 2.])
        >>> fut = calls.call(1, torch.add, (torch.ones(2), 1), {}, timeout=10)
        >>> calls.wait(fut, 10)
        tensor([2., 2.])
    """

    def __init__(self, peers: Peers, sender: Sender, codec: CallCodec, plugins: Plugins,
                 engine: ProgressEngine, default_timeout: float, ft: bool,
                 on_peer_failed: Callable[[int], None]) -> None:
        self.peers = peers
        self.sender = sender
        self.codec = codec
        self.plugins = plugins
        self.engine = engine
        self.default_timeout = default_timeout
        self.ids = IdGenerator(peers.rank, peers.world_size)
        self.open = True
        self._ft = ft
        self._on_peer_failed = on_peer_failed
        self._pending: dict[int, PendingCall] = {}
        self._next_expiry_scan = 0.0
        self._next_full_scan = 0.0
        #: no call in the table has an earlier deadline (a lower bound; ``math.inf``: none
        #: has one): every call added lowers it (the compiled path too), each scan sets it
        #: to the earliest deadline left, so the leader scans only when one may be due
        self.earliest_deadline = math.inf
        #: (sync, async) handlers that run a call under the callee's profile
        self.profiled: tuple[Handler, Handler] | None = None
        #: the compiled path of plain calls (:mod:`mpidag.agent.fastpath`), or ``None``
        self.core: Any = None

    @property
    def table(self) -> dict[int, PendingCall]:
        """The live table of calls waiting for their answer, by request id (the compiled
        call path adds to it and completes from it; tools read :meth:`snapshot`)."""
        return self._pending

    # --------------------------------------------------------------- deadlines
    def resolve_timeout(self, timeout: float | None) -> float:
        """torch's rule: negative (unset) means the default, 0 means no timeout."""
        if timeout is None or timeout < 0:
            return self.default_timeout
        return float(timeout)

    def deadline_after(self, timeout: float | None, now: float) -> tuple[float, float | None]:
        """``(seconds, deadline)`` of ``timeout`` from ``now``: the deadline is ``None``
        when there is none (0 seconds)."""
        seconds = self.resolve_timeout(timeout)
        return seconds, (now + seconds if seconds > 0 else None)

    # ------------------------------------------------------------------ calls
    def call(self, dst: int, func: Callable, args: tuple, kwargs: dict, timeout: float,
             *, record: bool = True, exec_mode: str = "async") -> RpcFuture:
        """Send a CALL and return the future of its answer (see
        :meth:`mpidag.agent.agent.RpcAgent.call`)."""
        if self.peers.left and dst in self.peers.left:
            future = RpcFuture()
            future.set_exception(self.peers.failed_error(dst, describe(func, args)))
            return future
        if not call_profiling():
            return self.send_call(dst, func, args, kwargs, timeout, record, True).future
        if legacy_profiling():
            return self._profiled_call(dst, func, args, kwargs, timeout, record, exec_mode)
        span = record_function(f"mpidag.rpc#{describe(func, args)}"
                               f"({self.peers.info.name} -> {self.peers.name(dst)})")
        span.__enter__()
        try:
            future = self.send_call(dst, func, args, kwargs, timeout, record, True).future
        except BaseException:
            span.__exit__(None, None, None)
            raise
        span._call_end_callbacks_on_future(future)
        return future

    def call_sync(self, dst: int, func: Callable, args: tuple, kwargs: dict, timeout: float,
                  *, record: bool = True) -> Any:
        """Send a CALL and wait for its answer in this thread (see
        :meth:`mpidag.agent.agent.RpcAgent.call_sync`)."""
        if call_profiling():
            return self.wait(self.call(dst, func, args, kwargs, timeout, record=record,
                                       exec_mode="sync"), timeout)
        return self.finish(self.send_call(dst, func, args, kwargs, timeout, record, False))

    def finish(self, call: PendingCall) -> Any:
        """Wait in this thread for the answer of ``call`` (sent without a future), driving
        progress; return its value, or raise its error or an ``RPCTimeoutError``."""
        if not call.done and not self.engine.wait_until(call.is_done, call.deadline) \
                and not call.done:
            self.expire(call.request_id)
        error = call.error
        if error is not None:
            call.error = None
            try:
                raise error
            finally:
                del error, call
        return call.value

    def _profiled_call(self, dst: int, func: Callable, args: tuple, kwargs: dict,
                       timeout: float, record: bool, exec_mode: str) -> RpcFuture:
        """:meth:`call` under torch's legacy profiler: a range named by torch's key, the
        call run by a profiled handler on ``dst`` (see :mod:`mpidag._remote_profiling`)."""
        assert self.profiled is not None
        mode, name = function_name(func, args)
        key = rpc_profiling_key(mode or exec_mode, name, self.peers.info.name,
                                self.peers.name(dst))
        handler = self.profiled[is_asynchronous(func)]

        def send(options: tuple) -> RpcFuture:
            return self.send_call(dst, handler, (options, func, args, kwargs), {}, timeout,
                                   record, True).future

        return profiled_call(key, send, lambda: RpcFuture(self.engine))

    def send_call(self, dst: int, func: Callable, args: tuple, kwargs: dict, timeout: float,
                  record: bool, with_future: bool) -> PendingCall:
        """Send a CALL and return its record in the table (``with_future``: one that
        completes an ``RpcFuture``; else the answer is kept in the record, see
        :class:`PendingCall`). A plain call goes by the compiled path when there is one."""
        core = self.core
        if core is not None:
            call = core.send_call(dst, func, args, kwargs, timeout, record, with_future)
            if call is not None:
                return call
        if not self.open:
            raise RPCError("the RPC agent is shut down; call mpidag.rpc.init_rpc again first")
        if self.peers.failed and dst in self.peers.failed:
            raise self.peers.failed_error(dst, describe(func, args))
        payload, tensors, flags = self.codec.encode(dst, func, args, kwargs)
        context_id = message_id = 0
        observer = self.plugins.observer
        if record and observer.active:
            context_id, message_id = observer.outgoing(
                dst, tensors, lambda: self.arguments_sent(func, args, dst))
        request_id = self.ids.next()
        future = RpcFuture(self.engine) if with_future else None
        now = time.monotonic()
        seconds, deadline = self.deadline_after(timeout, now)
        call = self._pending[request_id] = PendingCall(request_id, future, dst, now, deadline,
                                                       func, seconds, args)
        if deadline is not None and deadline < self.earliest_deadline:
            self.earliest_deadline = deadline
        env = Envelope(CALL, request_id, flags, context_id, message_id, payload, tensors)
        try:
            self.sender.send(dst, env, reply=False)
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        if message_id:
            observer.sent(context_id, message_id)  # while the callee works
        return call

    def arguments_sent(self, func: Callable, args: tuple, dst: int) -> str:
        """The name of a call's arguments as sent (what a send function records).

        Example::

            >>> runtime.agent.calls.arguments_sent(torch.add, (), 1)
            'the arguments of torch.add sent to worker1'
        """
        return f"the arguments of {describe(func, args)} sent to {self.peers.names[dst]}"

    def notify(self, dst: int, func: Callable, args: tuple = (),
               kwargs: dict | None = None) -> None:
        """Run ``func(*args, **kwargs)`` on ``dst`` with no answer (see
        :meth:`mpidag.agent.agent.RpcAgent.notify`). A plain one goes by the compiled path
        when there is one."""
        core = self.core
        if core is not None and not kwargs and type(args) is tuple and \
                core.notify(dst, func, args):
            return
        payload, tensors, flags = self.codec.encode(dst, func, args, kwargs or {})
        kind = CONTROL if isinstance(func, Handler) and func.mode == "control" else NOTIFY
        self.sender.send(dst, Envelope(kind=kind, flags=flags, payload=payload,
                                       tensors=tensors), reply=False)

    # ----------------------------------------------------------------- waiting
    def wait(self, future: RpcFuture, timeout: float) -> Any:
        """Wait for ``future`` driving progress; raise its error or a timeout."""
        _, deadline = self.deadline_after(timeout, time.monotonic())
        if not self.engine.wait_until(future.done, deadline) and not future.done():
            for request_id, call in self._pending.copy().items():
                if call.future is future:
                    self.expire(request_id)
                    break
        return future.wait()

    def expire(self, request_id: int) -> None:
        """The call ran past its deadline: it fails with torch's timeout error (the answer,
        if it comes, is dropped)."""
        call = self._pending.pop(request_id, None)
        if call is None or call.done:
            return
        error = RPCTimeoutError(
            f"RPC ran for more than the set timeout ({call.seconds * 1000:.0f} ms) and will "
            f"now be marked with an error: the call of {call.what} to "
            f"{self.peers.name(call.dst)}; pass a larger timeout= or rpc_timeout in the "
            f"backend options"
        )
        if call.future is not None and call.future.user_callbacks:  # (see complete)
            self.engine.submit(lambda: self._settle(call, None, error))
            return
        self._settle(call, None, error)

    def expire_due(self) -> None:
        """Expire the calls past their deadline (the leader, after a poll; at most every
        :data:`EXPIRY_SCAN_INTERVAL`, and a scan of the table only once
        :attr:`earliest_deadline` has passed or :data:`FULL_SCAN_INTERVAL` after the last:
        a scan of 5,000 calls in flight costs 0.25 ms, which every 5 ms was 5 % of a core
        in an ``rpc_async`` burst).

        The table is copied with ``dict.copy()``, never iterated or listed: building a list
        of its items allocates, an allocation can run the garbage collector and a
        ``__del__`` that releases the GIL, and another thread that adds a call meanwhile
        made the scan fail with "dictionary changed size during iteration". A call added
        during the scan lowers ``earliest_deadline`` from ``math.inf`` again, and the scan
        only lowers it further.

        Example (a call of 30 s is not late: it stays and completes)::

            >>> calls = runtime.agent.calls
            >>> fut = calls.call(1, torch.add, (torch.ones(1), 1), {}, timeout=30)
            >>> calls.earliest_deadline <= time.monotonic() + 30
            True
            >>> calls.expire_due()
            >>> fut.wait()
            tensor([2.])
        """
        now = time.monotonic()
        if now < self._next_expiry_scan or not self._pending:
            return
        self._next_expiry_scan = now + EXPIRY_SCAN_INTERVAL
        if now < self.earliest_deadline and now < self._next_full_scan:
            return
        self._next_full_scan = now + FULL_SCAN_INTERVAL
        self.earliest_deadline = math.inf
        earliest = math.inf
        for request_id, call in self._pending.copy().items():
            deadline = call.deadline
            if deadline is None:
                continue
            if deadline <= now:
                self.expire(request_id)
            elif deadline < earliest:
                earliest = deadline
        if earliest < self.earliest_deadline:
            self.earliest_deadline = earliest

    # ----------------------------------------------------------------- answers
    def complete(self, env: Envelope) -> Callable[[], None] | None:
        """Complete the call that ``env`` answers. A future with callbacks of the user's
        (``then``, ``add_done_callback``) is completed by the returned work item instead,
        which a pool leader runs after giving up the leadership (or a pool thread runs):
        a callback may wait for another call (``fut.wait()``, ``rpc_sync``), whose answer
        the leader could not receive while it ran the callback (as in torch, callbacks run
        on the agent's threads)."""
        call = self._pending.pop(env.request_id, None)
        src = env.src
        try:
            if call is None:
                log.debug("late answer to request %x from rank %d dropped (timed out)",
                          env.request_id, src)
                return None
            value = error = None
            if env.kind == RESULT:
                try:
                    if env.message_id:
                        self._observe_result(env, call)
                    value = loads(env.payload, env.tensors, self.sender.codecs)
                except Exception as exc:
                    error = self._result_error(call, src, exc)
            else:
                error = unpack_exception(bytes(env.payload))
                if self._ft and isinstance(error, WorkerFailedError) and \
                        0 <= error.rank < self.peers.world_size and \
                        error.rank != self.peers.rank:
                    self._on_peer_failed(error.rank)  # another rank saw it first: so it is
            future = call.future
            if future is not None and future.user_callbacks:
                def finish(src: int = src) -> None:
                    try:
                        self._settle(call, value, error)
                    finally:
                        self.sender.mark_processed(src)  # only now: the termination test

                src = -1  # counted as processed by finish()
                return finish
            self._settle(call, value, error)
            return None
        finally:
            if src >= 0:
                self.sender.mark_processed(src)

    def result_not_recorded(self, env: Envelope, call: PendingCall, exc: Exception) -> None:
        """The compiled path's recording of ``call``'s result ``env`` (its recv function)
        raised ``exc``: the call fails with an error that says so, as :meth:`complete` fails
        it (taken from the table, the message counted as handled).

        Example (what the compiled path does when recording such a result ``env`` raises):

        .. code-block:: python

            try:
                observer.received(env, name)
            except Exception as exc:
                calls.result_not_recorded(env, call, exc)  # the call fails with exc
        """
        error = self._result_error(call, env.src, exc)
        try:
            if self._pending.pop(env.request_id, None) is not None:
                self._settle(call, None, error)
        finally:
            self.sender.mark_processed(env.src)

    def _observe_result(self, env: Envelope, call: PendingCall) -> None:
        self.plugins.observer.received(
            env, lambda: self.result_from(call.func, call.args, env.src))

    def result_from(self, func: Callable, args: tuple | None, src: int) -> str:
        """The name of a call's result as received from ``src`` (a recv function's).

        Example::

            >>> runtime.agent.calls.result_from(torch.add, (), 1)
            'the result of torch.add from worker1'
        """
        return f"the result of {describe(func, args)} from {self.peers.names[src]}"

    def _result_error(self, call: PendingCall, src: int, exc: Exception) -> SerializationError:
        return SerializationError(f"could not unpickle the result of {call.what} from "
                                  f"{self.peers.name(src)}: {exc}")

    def _settle(self, call: PendingCall, value: Any, error: BaseException | None) -> None:
        """Give ``call`` its answer (running its future's callbacks) and wake waiters."""
        if error is not None:
            call.set_exception(error)
        else:
            call.set_result(value)
        self.engine.wake_waiters()

    # ----------------------------------------------------------------- failure
    def fail_to(self, rank: int) -> None:
        """``rank`` failed: every call waiting for it fails with its WorkerFailedError."""
        for request_id, call in self._pending.copy().items():
            if call.dst == rank and self._pending.pop(request_id, None) is not None \
                    and not call.done:
                call.set_exception(self.peers.failed_error(rank, call.what))
        self.engine.wake_waiters()

    def fail_all(self, reason: str) -> None:
        """Every call still waiting fails with ``WorkerDiedError`` naming ``reason``."""
        for request_id in self._pending.copy():
            call = self._pending.pop(request_id, None)
            if call is not None and not call.done:
                call.set_exception(WorkerDiedError(
                    f"{call.what} to {self.peers.name(call.dst)} did not complete: {reason}"))

    # ----------------------------------------------------------------- views
    def __len__(self) -> int:
        """Calls waiting for their answer."""
        return len(self._pending)

    def snapshot(self) -> list[PendingCallView]:
        """The calls in flight, for tools (inspector, debug info)."""
        return [PendingCallView(request_id, call.what, call.dst, call.started, call.seconds)
                for request_id, call in self._pending.copy().items()]
