"""The RPC agent of one rank: a facade over its parts, one concern each.

Data flow of ``rpc_sync(to, f, args)``::

    caller thread: calls.OutgoingCalls.call_sync -> encoding.CallCodec.encode
                   -> sending.Sender.send(CALL, request_id)
                   -> lead the progress engine until the call record is done
    callee leader: transport.poll -> RpcAgent.dispatch -> work item (run by a pool thread)
                   -> serving.Server.serve_call: f(*args) -> Sender: RESULT or ERROR
    caller leader: transport.poll -> RpcAgent.dispatch -> OutgoingCalls.complete: the call
                   record gets the value and is done (rpc_async: its future's result is set)

The parts, each in its module:

* :class:`~mpidag.agent.peers.Peers`: the workers, and which ranks failed or left;
* :class:`~mpidag.agent.sending.Sender`: pickling for a destination, device maps, sends
  and the per-peer message counters;
* :class:`~mpidag.agent.encoding.CallCodec`: how a call travels (handler names, function
  references, pickles);
* :class:`~mpidag.agent.calls.OutgoingCalls`: calls waiting for answers, deadlines, futures;
* :class:`~mpidag.agent.serving.Server`: running incoming calls and answering them;
* :class:`~mpidag.agent.quiescence.Quiescence`: the shutdown's termination test;
* :class:`~mpidag.agent.handlers.Plugins`: what the layers above plug in (handlers, the
  call observer, hooks, failure listeners).

The layers above plug into the agent through five small interfaces:
:meth:`RpcAgent.register_handler`, :attr:`RpcAgent.codecs` (pickling rules for their types),
:meth:`RpcAgent.set_observer`, :meth:`RpcAgent.add_hooks` and
:meth:`RpcAgent.add_failure_listener`. Tools read :meth:`RpcAgent.snapshot`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mpidag._config import Config
from mpidag._remote_profiling import install as install_rpc_profiling
from mpidag._remote_profiling import serve_profiled
from mpidag.agent.calls import OutgoingCalls, PendingCallView
from mpidag.agent.compiled import make_core
from mpidag.agent.encoding import CallCodec
from mpidag.agent.fastpath import new_doorbell
from mpidag.agent.futures import RpcFuture
from mpidag.agent.handlers import (
    CallObserver,
    Handler,
    Plugins,
    describe,
    detaches_parameters,
)
from mpidag.agent.messages import CALL, CONTROL, ERROR, NOTIFY, RESULT
from mpidag.agent.options import MPIRpcBackendOptions, WorkerInfo
from mpidag.agent.peers import Peers
from mpidag.agent.quiescence import Quiescence
from mpidag.agent.sending import DeviceMaps, Sender
from mpidag.agent.serving import Server
from mpidag.errors import WorkerFailedError
from mpidag.transport.base import PEER_FAILED, Transport
from mpidag.transport.frames import Codecs, Envelope
from mpidag.transport.progress import EngineSnapshot, ProgressEngine

__all__ = ["AgentSnapshot", "CallObserver", "Handler", "RpcAgent", "RpcFuture", "describe",
           "detaches_parameters"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentSnapshot:
    """One rank's agent as tools see it (``mpidag._debug``, ``inspect``, debug info)."""

    calls: list[PendingCallView]
    messages_sent: int
    messages_processed: int
    failed: list[int]
    engine: EngineSnapshot


class RpcAgent:
    """Calls of one rank: pending futures, timeouts, serving requests, internal handlers.

    Example::

        >>> agent = runtime.agent   # RpcAgent(transport, workers, options, device_maps, config)
        >>> agent.wait(agent.call(1, torch.add, (torch.ones(2), 1), {}, timeout=10), 10)
        tensor([2., 2.])
    """

    def __init__(self, transport: Transport, workers: list[WorkerInfo],
                 options: MPIRpcBackendOptions, device_maps: DeviceMaps,
                 config: Config | None = None) -> None:
        config = config or Config()
        self.transport = transport
        self.config = config
        self.options = options
        self.peers = Peers(workers, transport.rank)
        self.rank, self.world_size = self.peers.rank, self.peers.world_size
        self.workers, self.info, self.by_name = workers, self.peers.info, self.peers.by_name
        #: device_maps[src_name][dst_name] = {src_device: dst_device}, for every rank
        self.device_maps = device_maps
        #: pickling rules of the layers above (RRefs); handlers travel by name
        self.codecs = Codecs()
        self.plugins = Plugins(self.peers.where())
        self.codecs.register(Handler, "handler", lambda h, scope: h.name, self.plugins.named)
        self.sender = Sender(transport, self.peers, device_maps, self.codecs, config.compiled)
        codec = CallCodec(self.sender, self.peers, self.plugins)
        max_sleep = options.max_sleep if options.max_sleep is not None else config.backoff_max
        self.engine = ProgressEngine(
            transport.poll, self.dispatch, self._tick, options.num_worker_threads,
            spin=config.poll_spin, max_sleep=max_sleep,
            sentinel_interval=config.sentinel_interval, name=f"mpidag-r{self.rank}",
            poll_wait=transport.poll_wait, interrupt=transport.interrupt_wait,
            doorbell=new_doorbell(config.compiled),
        )
        self.calls = OutgoingCalls(self.peers, self.sender, codec, self.plugins, self.engine,
                                   options.rpc_timeout, config.ft, self._peer_failed)
        self.server = Server(self.peers, self.sender, codec, self.plugins, self.engine)
        self.quiescence = Quiescence(transport, self.peers, self.sender, self.calls,
                                     self.plugins, self.engine)
        self.calls.profiled = self.server.profiled = self._register_profiled_handlers()
        #: the compiled path of plain calls (``None``: every call takes the Python path);
        #: its dispatch hands what is not plain to the Python one, :meth:`dispatch`;
        #: ``call_path`` says which path this agent takes, and why
        self.core, self.call_path = make_core(self.calls, self.server, transport,
                                              self.dispatch, config.compiled)
        if self.core is not None:
            self.calls.core = self.core
            self.server.answer = self.core.reply
            self.dispatch = self.core.dispatch  # type: ignore[method-assign]
            self.engine.set_step(self.core.step)
        #: a rank that shuts down without the others (graceful=False) says so to them
        self._left = self.register_handler("agent.left", self._peer_left, mode="control")

    # ------------------------------------------------------------ the session
    def start(self) -> None:
        """Start the progress engine's threads: from now on this rank receives and serves."""
        self.engine.start()

    @property
    def running(self) -> bool:
        """False once :meth:`stop` ran: new calls raise."""
        return self.calls.open

    def stop(self, graceful: bool) -> None:
        """End the session: without ``graceful``, tell the other ranks first; then stop the
        engine, fail what still waits and close the transport."""
        if not graceful and self.calls.open:
            self._say_goodbye()
        self.calls.open = False
        self.engine.stop()
        self.calls.fail_all("the RPC agent was shut down")
        self.transport.close(collective=graceful)

    def where(self) -> str:
        """This rank as errors and logs name it: ``'worker0 (rank 0 of 2)'``."""
        return self.peers.where()

    # -------------------------------------------------------- what layers plug in
    def register_handler(self, name: str, fn: Callable[..., Any], *, mode: str = "call",
                         asynchronous: bool = False,
                         describe: Callable[..., str] | None = None,
                         detaches: Callable[..., bool] | None = None,
                         profile_as: Callable[..., tuple[str | None, str]] | None = None
                         ) -> Handler:
        """Register ``fn`` as the handler of internal messages named ``name``.

        ``mode``: ``"call"`` (answered with its result; ``asynchronous``: it returns a
        ``torch.futures.Future`` whose value is the answer), ``"notify"`` (run on a pool
        thread, no answer) or ``"control"`` (run at once by the receiving leader, in
        arrival order: only short, non-blocking protocol steps). Returns the
        :class:`Handler` to pass to :meth:`call` or :meth:`notify` as the function.

        Example::

            >>> double = runtime.agent.register_handler("example.double", lambda x: 2 * x)
            >>> runtime.agent.call_sync(1 - rank, double, (21,), {}, timeout=10)  # every rank
            42
        """
        return self.plugins.register(name, fn, mode=mode, asynchronous=asynchronous,
                                     describe=describe, detaches=detaches,
                                     profile_as=profile_as)

    def _register_profiled_handlers(self) -> tuple[Handler, Handler]:
        """The handlers that run a call under the callee's profile when its caller profiles
        (see :mod:`mpidag._remote_profiling`): ``(options, func, args, kwargs)``."""
        install_rpc_profiling(self.rank)
        rank = self.rank
        return tuple(  # type: ignore[return-value]
            self.register_handler(
                name, lambda opts, f, a, k, _async=asynchronous: serve_profiled(
                    rank, opts, f, a, k, _async),
                asynchronous=asynchronous,
                describe=lambda opts, f, a, k: describe(f, a),
                detaches=lambda opts, f, a, k: detaches_parameters(f, a))
            for name, asynchronous in (("agent.profiled", False),
                                       ("agent.profiled_async", True)))

    @property
    def observer(self) -> CallObserver:
        """The call observer (distributed autograd's), or one that observes nothing."""
        return self.plugins.observer

    def set_observer(self, observer: CallObserver) -> None:
        """Let ``observer`` see every call, reply and received message (one observer).

        Example::

            >>> runtime.agent.set_observer(runtime.autograd.container)  # the one it has: fine
            >>> runtime.agent.observer is runtime.autograd.container
            True
        """
        self.plugins.set_observer(observer)

    def add_hooks(self, *, tick: Callable[[], None] | None = None, tick_queue: Any = None,
                  busy: Callable[[], bool] | None = None,
                  before_shutdown: Callable[[], None] | None = None,
                  arguments: tuple[Callable[[], None],
                                   Callable[[], Callable[[], bool] | None]] | None = None
                  ) -> None:
        """``tick()``: run by the leader after a poll while ``tick_queue`` (a container the
        layer fills, e.g. from ``__del__``) is not empty: a cheap test on the hot path;
        ``busy()``: true while this rank still has work the termination test must wait for;
        ``before_shutdown()``: run between the two quiescence rounds of a graceful
        shutdown; ``arguments=(begin, end)``: ``begin()`` and ``end()`` run on the serving
        thread before and after it unpickles the arguments of a call (or notification);
        ``end()`` returns ``None`` or a ``ready()`` test that the serving thread waits for
        (driving progress) before the function runs (one such pair per agent).

        Example::

            >>> queue = []    # filled by the layer, emptied by its hook on the leader
            >>> runtime.agent.add_hooks(tick=queue.clear, tick_queue=queue)
        """
        self.plugins.add_hooks(tick=tick, tick_queue=tick_queue, busy=busy,
                               before_shutdown=before_shutdown, arguments=arguments)

    def add_failure_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(rank)`` (on the leader) when a rank is found to have failed, after
        the calls pending to it failed (fault-tolerant jobs; RRefs, autograd)."""
        self.plugins.failure_listeners.append(listener)

    def run_shutdown_hooks(self) -> None:
        """Run the ``before_shutdown`` hooks (between the two rounds of a graceful shutdown)."""
        for hook in self.plugins.shutdown_hooks:
            hook()

    # ------------------------------------------------------------------ calls
    @property
    def ids(self) -> Any:
        """This rank's generator of globally unique 64-bit ids (requests, RRefs, contexts)."""
        return self.calls.ids

    @property
    def default_timeout(self) -> float:
        """The timeout of a call that sets none (``rpc_timeout`` of the options)."""
        return self.calls.default_timeout

    @default_timeout.setter
    def default_timeout(self, seconds: float) -> None:
        self.calls.default_timeout = seconds

    def resolve_timeout(self, timeout: float) -> float:
        """torch's rule: negative (unset) means the default, 0 means no timeout."""
        return self.calls.resolve_timeout(timeout)

    def call(self, dst: int, func: Callable, args: tuple, kwargs: dict, timeout: float,
             *, record: bool = True, exec_mode: str = "async") -> RpcFuture:
        """Send a CALL and return the future of its answer.

        Inside a distributed autograd context (``record``: unless an internal message) the
        call carries the context id, and a send function is recorded for its tensors that
        require grad. While ``torch.profiler`` runs, the call is a range (see
        :mod:`mpidag._profiling`) from here until its answer arrives; under torch's legacy
        profiler, as torch profiles RPCs (``exec_mode`` in the key; the callee's events).
        A call to a worker that shut down alone returns a future holding the error, as
        torch's ``rpc_async`` does (a call to a failed worker raises here, see --ft).

        Example::

            >>> runtime.agent.call(1, torch.add, (torch.ones(2), 1), {}, timeout=10).wait()
            tensor([2., 2.])
        """
        return self.calls.call(dst, func, args, kwargs, timeout, record=record,
                               exec_mode=exec_mode)

    def call_sync(self, dst: int, func: Callable, args: tuple, kwargs: dict, timeout: float,
                  *, record: bool = True) -> Any:
        """Send a CALL and wait for its answer in this thread (driving the progress
        engine meanwhile); return the value or raise the remote error (with its type) or
        an ``RPCTimeoutError``. As :meth:`call` followed by :meth:`wait`, without a
        ``torch.futures.Future``.

        Example::

            >>> runtime.agent.call_sync(1, torch.add, (torch.ones(2), 1), {}, timeout=10)
            tensor([2., 2.])
        """
        return self.calls.call_sync(dst, func, args, kwargs, timeout, record=record)

    def notify(self, dst: int, func: Callable, args: tuple = (),
               kwargs: dict | None = None) -> None:
        """Run ``func(*args, **kwargs)`` on ``dst`` with no answer; a :class:`Handler` of
        mode ``"control"`` runs on the receiving leader at once, in arrival order.

        Example::

            >>> runtime.agent.notify(1, time.sleep, (0,))   # runs on worker1; no answer
        """
        self.calls.notify(dst, func, args, kwargs)

    def wait(self, future: RpcFuture, timeout: float) -> Any:
        """Wait for ``future`` driving progress; raise its error or a timeout."""
        return self.calls.wait(future, timeout)

    def wait_for(self, future: RpcFuture) -> Any:
        """``future.wait()`` driving this agent's progress, for a future made without an
        engine (a layer's own record, completed by a message handler)."""
        if future.engine is None:
            future.engine = self.engine
        return future.wait()

    def new_future(self) -> RpcFuture:
        """A future whose ``wait()`` drives this agent's progress (for layers that complete
        their own futures, e.g. RRef fetches)."""
        return RpcFuture(self.engine)

    def dumps_for(self, dst: int, obj: Any, call: tuple[Any, tuple] | None = None,
                  prefix: bytes = b"") -> tuple[bytes | memoryview, list[torch.Tensor]]:
        """Pickle ``obj`` for rank ``dst`` (see :meth:`mpidag.agent.sending.Sender.dumps_for`)."""
        return self.sender.dumps_for(dst, obj, call, prefix)

    def devices_for(self, dst: int, tensors: list[torch.Tensor], reply: bool) -> list[str]:
        """Where each tensor lands on ``dst`` (see :meth:`Sender.devices_for`)."""
        return self.sender.devices_for(dst, tensors, reply)

    # -------------------------------------------------------------- receiving
    def dispatch(self, env: Envelope) -> Callable[[], None] | None:
        """What the progress engine's leader does with a received message: answers and
        control messages at once; calls and notifications as work items for pool threads."""
        kind = env.kind
        if kind in (RESULT, ERROR):
            return self.calls.complete(env)
        if kind == CALL:
            return self.server.accept_call(env)
        if kind == NOTIFY:
            return lambda: self.server.serve_notify(env)
        if kind == CONTROL:
            self.server.serve_notify(env)
            return None
        if kind == PEER_FAILED:
            self._peer_failed(env.src)
            return None
        log.error("dropping a message of unknown kind %r from rank %d", kind, env.src)
        self.sender.mark_processed(env.src)
        return None

    def _tick(self) -> None:
        """Called by the leader after each poll: the layers' hooks, then expired calls (the
        compiled step does the same in C: ``tick`` in ``mpidag/agent/fastpath.c``)."""
        for queue, hook in self.plugins.tick_hooks:
            if queue:
                hook()
        self.calls.expire_due()

    # ---------------------------------------------------------------- failures
    @property
    def failed(self) -> set[int]:
        """Ranks that failed (fault-tolerant jobs) or shut down alone."""
        return self.peers.failed

    @property
    def left(self) -> set[int]:
        """Ranks that shut down alone (``shutdown(graceful=False)``); also in ``failed``."""
        return self.peers.left

    def failed_error(self, rank: int, what: str = "") -> WorkerFailedError:
        """The error of a call to (or that needed) a failed rank."""
        return self.peers.failed_error(rank, what)

    def _peer_failed(self, rank: int) -> None:
        """The transport found ``rank`` dead: fail what waits for it, tell the layers."""
        if rank in self.peers.failed:
            return
        self.peers.failed.add(rank)
        log.warning("%s: worker %s (rank %d) failed; its pending calls fail, the others go "
                    "on", self.where(), self.peers.name(rank), rank)
        self.calls.fail_to(rank)
        for listener in self.plugins.failure_listeners:
            try:
                listener(rank)
            except Exception:
                log.exception("%s: a failure listener failed for rank %d", self.where(), rank)

    def _peer_left(self, rank: int) -> None:
        """``rank`` shut down on its own (``shutdown(graceful=False)``): what waits for it
        fails at once, as for a failed worker, instead of running into its timeout."""
        if 0 <= rank < self.world_size and rank != self.rank:
            self.peers.left.add(rank)
            log.info("%s: worker %s (rank %d) shut down without the others",
                     self.where(), self.peers.name(rank), rank)
            self._peer_failed(rank)

    def _say_goodbye(self) -> None:
        """Before a local shutdown: tell every other rank, so their calls to this one fail
        at once (torch's peers see the connection close)."""
        for rank in range(self.world_size):
            if rank != self.rank and rank not in self.peers.failed:
                try:
                    self.notify(rank, self._left, (self.rank,))
                except Exception:  # noqa: BLE001 - best effort: the peer may be gone too
                    log.debug("could not tell rank %d of the local shutdown", rank)

    # ---------------------------------------------------------------- shutdown
    def counters(self) -> tuple[int, int, int]:
        """``(sent, processed, busy)`` of this rank for the termination test."""
        return self.quiescence.counters()

    def wait_quiescent(self, timeout: float) -> None:
        """Return when every rank is here and no message is in flight anywhere (see
        :meth:`mpidag.agent.quiescence.Quiescence.wait`)."""
        self.quiescence.wait(timeout)

    def collective_waiter(self, timeout: float, hint: str
                          ) -> Callable[[Callable[[], bool]], None]:
        """A ``wait(done)`` for nonblocking collectives of this rank's main thread (see
        :meth:`mpidag.agent.quiescence.Quiescence.collective_waiter`)."""
        return self.quiescence.collective_waiter(timeout, hint)

    def fail_pending(self, reason: str) -> None:
        """Every call still waiting fails with ``WorkerDiedError`` naming ``reason``."""
        self.calls.fail_all(reason)

    # ------------------------------------------------------------------- views
    @property
    def sent(self) -> int:
        """Messages this rank sent."""
        return self.sender.sent

    @property
    def processed(self) -> int:
        """Messages this rank received and finished handling."""
        return self.sender.processed

    def snapshot(self) -> AgentSnapshot:
        """This agent's state for tools: calls in flight, message counts, the engine.

        Example::

            >>> fut = runtime.agent.call(1, time.sleep, (0.5,), {}, timeout=10)
            >>> [call.what for call in runtime.agent.snapshot().calls]
            ['time.sleep']
            >>> fut.wait()
        """
        return AgentSnapshot(self.calls.snapshot(), self.sender.sent, self.sender.processed,
                             sorted(self.peers.failed), self.engine.snapshot())
