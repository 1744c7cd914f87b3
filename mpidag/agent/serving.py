"""Serving: run the calls and notifications other ranks send here, and answer them."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler import record_function

from mpidag._profiling import profiling
from mpidag._remote_profiling import (
    measure_gil_wait,
    observing,
    serve_profiled,
    server_profiling,
)
from mpidag.agent.encoding import CallCodec
from mpidag.agent.futures import RpcFuture
from mpidag.agent.handlers import Handler, Plugins, describe, is_asynchronous
from mpidag.agent.messages import CONTROL, ERROR, FLAG_PLAIN, RESULT
from mpidag.agent.peers import Peers
from mpidag.agent.sending import Sender
from mpidag.errors import (
    SerializationError,
    WorkerFailedError,
    async_result_error,
    future_error,
    operator_error,
    pack_exception,
)
from mpidag.transport.frames import Envelope, is_plain, loads
from mpidag.transport.progress import ProgressEngine

__all__ = ["Server"]

#: the callee's log of failed calls (torch prints them on the callee too); the agent's name
#: is kept so that existing logging configurations still apply
log = logging.getLogger("mpidag.agent.agent")


class Server:
    """Runs incoming CALLs (answered with the result or the error, with its type) and
    NOTIFY/CONTROL messages (no answer), on the threads the progress engine gives them.

    Example::

        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))  # worker1's Server
        tensor([2.])
    """

    def __init__(self, peers: Peers, sender: Sender, codec: CallCodec, plugins: Plugins,
                 engine: ProgressEngine) -> None:
        self.peers = peers
        self.sender = sender
        self.codec = codec
        self.plugins = plugins
        self.engine = engine
        #: (sync, async) handlers that run a call under the callee's profile
        self.profiled: tuple[Handler, Handler] | None = None
        #: ``answer(env, value, (func, args))``: how an answer made after the function
        #: returned (an asynchronous handler's future) is sent: :meth:`reply_value`, or the
        #: compiled path's ``Core.reply``, which sends plain values in C
        self.answer = self.reply_value

    # --------------------------------------------------------------- arguments
    def _load_arguments(self, payload: bytes | memoryview, env: Envelope) -> Any:
        """``loads`` of a call's arguments; with an arguments hook (see
        :meth:`Plugins.add_hooks`), the serving thread then waits, driving progress, for
        what the arguments need before the function may run (RRefs confirmed by their
        owner, as torch does). A control message runs on the leader and never waits."""
        watch = self.plugins.arguments_hook
        if watch is None or env.kind == CONTROL:
            return loads(payload, env.tensors, self.sender.codecs)
        begin, end = watch
        begin()
        try:
            value = loads(payload, env.tensors, self.sender.codecs)
        finally:
            ready = end()
        if ready is not None:
            self.engine.wait_until(ready, None)
        return value

    def _unpack(self, env: Envelope) -> tuple[Callable, tuple, dict]:
        return self.codec.decode(env, self._load_arguments)

    # ------------------------------------------------------------------- calls
    def accept_call(self, env: Envelope) -> Callable[[], None]:
        """The work item of an incoming CALL, made by the leader in arrival order.

        A call in an autograd context is recorded in it here, before any later message is
        dispatched: a later message of the same sender about it (SMART mode's question
        whether its recv function can still fire) then always finds the context and the
        recv function, even when it is served first by another pool thread (recorded in
        the pool thread, such a question once found the recv function missing and the
        backward pass stopped). An error of the recording is the call's answer.
        """
        if not env.context_id:
            return lambda: self.serve_call(env)
        src = env.src
        try:
            received: tuple[Any, BaseException | None] = (self.plugins.observer.received(
                env, lambda: self.arguments_from(src)), None)
        except BaseException as exc:  # noqa: BLE001 - answered by the work item
            received = (None, exc)
        return lambda: self.serve_call(env, received)

    def serve_call(self, env: Envelope,
                   received: tuple[Any, BaseException | None] | None = None) -> None:
        """Run an incoming CALL and answer it; a profiler range while a profiler runs.
        ``received``: the autograd context state :meth:`accept_call` recorded (or its error).

        Any exception of the function, ``SystemExit`` and other ``BaseException`` types
        included, is the answer (with its type); the serving thread goes on serving.
        """
        if env.context_id or observing():
            self._serve_observed_call(env, received=received)
            return
        func = None
        try:  # the common case: no autograd context, no profiler, a synchronous function
            func, args, kwargs = self._unpack(env)
            if is_asynchronous(func) and type(func) is not Handler:
                self._serve_observed_call(env, (func, args, kwargs))
                return
            result = func(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the caller gets it, with its type
            self.fail_call(env, func, exc)
            return
        if type(func) is Handler and func.asynchronous and isinstance(result, torch._C.Future):
            self.answer_when_done(env, result, (func, args))
            return
        self.reply_value(env, result, (func, args))

    def answer_when_done(self, env: Envelope, fut: torch.futures.Future,
                         call: tuple) -> None:
        """Answer with ``fut``'s value or error once it completes (at once if it has); the
        compiled path calls this for a handler's future that has not completed."""
        add = fut.add_internal_callback if isinstance(fut, RpcFuture) \
            else fut.add_done_callback  # (the reply is short: on any thread)
        add(lambda done: self._reply_future(env, done, call))

    def _serve_observed_call(self, env: Envelope,
                             unpacked: tuple[Callable, tuple, dict] | None = None,
                             received: tuple[Any, BaseException | None] | None = None
                             ) -> None:
        """:meth:`serve_call` in an autograd context, under a profiler (a server-wide one
        profiles ``func``; GIL profiling measures the wait for the GIL first), or of an
        ``@async_execution`` function (``unpacked``: the call, if already unpickled;
        ``received``: its autograd context, recorded at dispatch)."""
        state = None
        span = None
        func = None
        asynchronous = False
        observer = self.plugins.observer
        src_name = self.peers.name(env.src)
        rank = self.peers.rank
        try:
            if received is not None:  # (every call in a context: see accept_call)
                state, error = received
                if error is not None:
                    raise error
            func, args, kwargs = unpacked or self._unpack(env)
            if profiling():
                span = record_function(f"mpidag.rpc.serve#{describe(func, args)}"
                                       f"({src_name} -> {self.peers.info.name})")
                span.__enter__()
            asynchronous = is_asynchronous(func)
            run = func
            profiled = self.profiled
            if server_profiling() and (profiled is None or (
                    func is not profiled[0] and func is not profiled[1])):  # (not twice)
                def run(*a: Any, _f: Callable = func, **k: Any) -> Any:  # a server-wide
                    return serve_profiled(rank, None, _f, a, k, asynchronous)  # profile
            measure_gil_wait()
            if state is None:
                result = run(*args, **kwargs)
            else:
                token = observer.serving(state, env.message_id,
                                         lambda: self.arguments_served(func, args, env.src))
                try:
                    result = run(*args, **kwargs)
                finally:
                    observer.served(token)
        except BaseException as exc:  # noqa: BLE001 - the caller gets it, with its type
            self._log_failure(exc)
            self._reply_error(env, operator_error(func, exc))
            if span is not None:
                span.__exit__(None, None, None)
            return
        if asynchronous and (type(func) is not Handler or isinstance(result, torch._C.Future)):
            if not isinstance(result, torch._C.Future):
                self._reply_error(env, async_result_error(describe(func), result))
            else:
                self.answer_when_done(env, result, (func, args))
                if span is not None:  # the range ends when the function's future does
                    span._call_end_callbacks_on_future(result)
                    return
        else:
            self.reply_value(env, result, (func, args))
        if span is not None:
            span.__exit__(None, None, None)

    def fail_call(self, env: Envelope, func: Callable | None, exc: BaseException) -> None:
        """The call ``env`` of ``func`` raised ``exc``: log it (as torch does) and answer
        with it, its type kept (the compiled path calls this too)."""
        self._log_failure(exc)
        self._reply_error(env, operator_error(func, exc))

    def _log_failure(self, exc: BaseException) -> None:
        """Log a served function's exception on the callee, as torch's ``_run_function``
        prints it (``On <WorkerInfo>:``, its repr and traceback; one record per failed
        call, at ERROR on the ``mpidag.agent.agent`` logger: with no logging set up it
        reaches ``sys.stderr`` as in torch). The caller gets the exception as well. The
        exception is text: a record that a handler keeps must not keep it, its frames and
        the RRefs and tensors in them alive."""
        if log.isEnabledFor(logging.ERROR):
            log.error("On %s:\n%s\n%s", self.peers.info, repr(exc),
                      "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))

    # ----------------------------------------------------------------- answers
    def _reply_future(self, env: Envelope, fut: torch.futures.Future, call: tuple) -> None:
        error = future_error(fut)
        if error is not None:
            self._reply_error(env, error)
            return
        self.answer(env, fut.value(), call)

    def reply_value(self, env: Envelope, value: Any, call: tuple | None = None) -> None:
        """Answer the call ``env`` with ``value`` (``call``: its ``(func, args)``, for how
        parameters travel and for error messages); the compiled path calls this for a
        value it does not send itself."""
        observer = self.plugins.observer
        try:
            payload, tensors = self.sender.dumps_for(env.src, value, call)
            message_id = 0
            if env.context_id and tensors:
                message_id = observer.replying(
                    env.context_id, env.src, tensors, lambda: self.result_sent(call, env.src))
            reply = Envelope(kind=RESULT, request_id=env.request_id,
                             flags=0 if tensors or not is_plain(value) else FLAG_PLAIN,
                             payload=payload, tensors=tensors,
                             context_id=env.context_id if message_id else 0,
                             message_id=message_id)
            devices = self.sender.devices_for(env.src, tensors, reply=True)
        except Exception as exc:
            self.reply_unsendable(env, value, exc)
            return
        if not self.sender.send_answer(env, reply, devices):
            log.debug("the answer to rank %d is dropped: it failed", env.src)
            return
        if message_id:
            observer.sent(env.context_id, message_id)

    def reply_unsendable(self, env: Envelope, value: Any, exc: Exception) -> None:
        """Answer the call ``env`` with the error that its return value ``value`` could
        not be sent (``exc`` says why); the compiled path calls this too.

        Example (what the caller then raises):

        .. code-block:: python

            server.reply_unsendable(env, lock, TypeError("cannot pickle '_thread.lock'"))
            # SerializationError: the return value (lock) could not be sent back from
            # worker1 (rank 1 of 2): cannot pickle '_thread.lock' object
        """
        self._reply_error(env, SerializationError(
            f"the return value ({type(value).__name__}) could not be sent back from "
            f"{self.peers.where()}: {exc}"))

    # ------------------------------------------------- names of recorded messages
    def arguments_from(self, src: int) -> str:
        """The name of a received call's arguments before they are unpickled.

        Example::

            >>> runtime.agent.server.arguments_from(1)
            'the arguments of a call from worker1'
        """
        return f"the arguments of a call from {self.peers.names[src]}"

    def arguments_served(self, func: Callable, args: tuple, src: int) -> str:
        """The name of a served call's arguments (a recv function's, once unpickled).

        Example::

            >>> runtime.agent.server.arguments_served(torch.add, (), 1)
            'the arguments of torch.add from worker1'
        """
        return f"the arguments of {describe(func, args)} from {self.peers.names[src]}"

    def result_sent(self, call: tuple | None, dst: int) -> str:
        """The name of a call's result sent back to ``dst`` (``call``: its ``(func, args)``).

        Example::

            >>> runtime.agent.server.result_sent((torch.add, ()), 0)
            'the result of torch.add sent to worker0'
        """
        return f"the result of {describe(*call) if call else 'a call'} sent to " \
               f"{self.peers.names[dst]}"

    def _reply_error(self, env: Envelope, exc: BaseException) -> None:
        payload = pack_exception(exc, self.peers.where())
        try:
            self.sender.send(env.src, Envelope(kind=ERROR, request_id=env.request_id,
                                               payload=payload), reply=True)
        except WorkerFailedError:  # the caller died meanwhile: nobody to answer
            log.debug("the error answer to rank %d is dropped: it failed", env.src)
        finally:
            self.sender.mark_processed(env.src)

    # ----------------------------------------------------------- notifications
    def serve_notify(self, env: Envelope) -> None:
        """Run a NOTIFY (on a pool thread) or CONTROL (on the leader) message: no answer;
        an error is logged and serving goes on."""
        try:
            func, args, kwargs = self._unpack(env)
            func(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - nobody to answer: log it, go on serving
            self.notify_failed(env, exc)
        finally:
            self.sender.mark_processed(env.src)

    def notify_failed(self, env: Envelope, exc: BaseException) -> None:
        """Log that the notification ``env`` failed with ``exc`` (nobody to answer; the
        compiled path calls this too).

        Example (the record, at ERROR on the ``mpidag.agent.agent`` logger, with the
        traceback):

        .. code-block:: python

            server.notify_failed(env, ValueError("refused"))
            # notification from rank 0 failed on worker1 (rank 1 of 2)
            # Traceback (most recent call last): ... ValueError: refused
        """
        log.error("notification from rank %d failed on %s", env.src, self.peers.where(),
                  exc_info=(type(exc), exc, exc.__traceback__))
