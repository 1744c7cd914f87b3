"""The RPC agent: outgoing calls and their futures, incoming requests, replies, shutdown.

Data flow of ``rpc_sync(to, f, args)``::

    caller thread: f's reference + pickle (args, kwargs), tensors out
                   -> transport.send(CALL, request_id)
                   -> lead the progress engine until the call record is done
    callee leader: transport.poll -> dispatch -> work item (run inline by a pool leader)
                   -> f(*args) -> transport.send(RESULT or ERROR, request_id)
    caller leader: transport.poll -> dispatch -> pending[request_id] gets the value and is
                   done (rpc_async: its future's result is set)

The agent owns the calls of one rank: pending calls, their futures and deadlines, the
progress engine and the message counters of graceful shutdown. The layers above it own
their own state and plug into the agent through five small interfaces:

* :meth:`RpcAgent.register_handler`: named handlers for internal messages (RRef protocol
  steps, gradients), run as calls, notifications or in-order control messages;
* :attr:`RpcAgent.codecs`: pickling rules for their types (RRefs travel by their
  protocol, rebuilt by the receiving agent's RRef layer);
* :meth:`RpcAgent.set_observer`: a :class:`CallObserver` that sees every call, reply and
  received message (distributed autograd records send/recv functions through it);
* :meth:`RpcAgent.add_hooks`: work for the leader after each poll, "still busy" checks for
  the termination test, and steps before a graceful shutdown;
* :meth:`RpcAgent.add_failure_listener`: a rank was found dead (fault-tolerant jobs), after
  the calls pending to it failed.
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.jit._builtins import _find_builtin

from mpidag._backoff import Backoff
from mpidag._config import Config
from mpidag._ids import IdGenerator
from mpidag._profiling import profiling
from mpidag._remote_profiling import (
    call_profiling,
    function_name,
    legacy_profiling,
    measure_gil_wait,
    observing,
    profiled_call,
    rpc_profiling_key,
    serve_profiled,
    server_profiling,
)
from mpidag._remote_profiling import install as install_rpc_profiling
from mpidag.agent.messages import FLAG_FUNCTION_REF, FLAG_HANDLER, REF_LENGTH, Kind
from mpidag.agent.options import MPIRpcBackendOptions, WorkerInfo
from mpidag.errors import (
    RemoteBaseException,
    RPCError,
    RPCTimeoutError,
    SerializationError,
    WorkerDiedError,
    WorkerFailedError,
    async_result_error,
    detached_copy,
    future_error,
    operator_error,
    pack_exception,
    storable,
    unpack_exception,
    wrap_error,
)
from mpidag.transport.base import PEER_FAILED, Transport
from mpidag.transport.frames import Codecs, Envelope, dumps, is_plain, loads
from mpidag.transport.progress import ProgressEngine

__all__ = ["CallObserver", "Handler", "RpcAgent", "RpcFuture"]

log = logging.getLogger(__name__)

#: how often the leader scans pending calls for expired deadlines, seconds
EXPIRY_SCAN_INTERVAL = 5e-3


class RpcFuture(torch.futures.Future):
    """A ``torch.futures.Future`` whose ``wait()`` drives the MPI progress itself.

    Its errors are raised as copies (:func:`mpidag.errors.detached_copy`), so the stored
    exception never references the frames that wait for it. A future given a callback
    with ``then`` or ``add_done_callback`` is completed off the leader (see
    ``RpcAgent._complete``): a callback may wait for another RPC.
    """

    #: a callback of the user's was added: complete this future on a pool thread
    _user_callbacks = False

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        # torch.futures.Future.then; the callback may block (waits, RPCs)
        self._user_callbacks = True
        return super().then(callback)

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        # torch.futures.Future.add_done_callback; the callback may block
        self._user_callbacks = True
        super().add_done_callback(callback)

    def add_internal_callback(self, callback: Callable[[torch.futures.Future], None]
                              ) -> None:
        """``add_done_callback`` for mpidag's own short callbacks that never block: they
        run on the thread that completes the future, the progress leader included.

        Example::

            >>> fut = agent.call(1, handler, (), {}, timeout=0)
            >>> fut.add_internal_callback(lambda f: counter.decrement())
        """
        super().add_done_callback(callback)

    def wait(self) -> Any:  # noqa: D102 - same contract as torch.futures.Future.wait
        if not self.done():
            engine = getattr(self, "_engine", None)
            if engine is not None:
                engine.wait_until(self.done, None)
        try:
            return super().wait()
        except BaseException as stored:
            if isinstance(stored, RemoteBaseException):  # SystemExit & co., with their type
                fresh = detached_copy(stored.exception)
            else:
                fresh = detached_copy(stored)
            stored.__traceback__ = None
            del stored
        try:
            raise fresh
        finally:
            del fresh  # else this frame -> fresh -> its traceback -> this frame: a cycle


class _PendingCall:
    """A call waiting for its answer: completes a future (``rpc_async``) or, for a caller
    that waits for the answer itself (``rpc_sync``, ``to_here``), holds the answer in
    ``value``/``error`` and sets ``done``: no ``torch.futures.Future`` is made for those
    (creating, completing and waiting on one costs ~2 us)."""

    __slots__ = ("request_id", "future", "dst", "deadline", "func", "seconds", "args", "done",
                 "value", "error", "started")

    def __init__(self, request_id: int, future: RpcFuture | None, dst: int, started: float,
                 deadline: float, func: Any, seconds: float, args: tuple) -> None:
        self.request_id = request_id
        self.future = future
        self.dst = dst
        self.started = started  # time.monotonic() when the call was made (for tools)
        self.deadline = deadline  # time.monotonic() deadline, 0.0 for none
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


@dataclass(slots=True, eq=False)
class Handler:
    """An internal message handler registered by a layer above the agent.

    ``fn(*args, **kwargs)`` runs on the receiving rank; for ``mode="call"`` its result (or,
    with ``asynchronous``, the value of the ``torch.futures.Future`` it returns, or any
    other value it returns, answered at once) is the answer. ``describe(*args)`` names the
    call in errors and profiles; ``detaches(*args)`` applies torch's parameter rule of the
    user's call the message carries.
    """

    name: str
    fn: Callable[..., Any]
    mode: str = "call"  # "call" (answered), "notify" (pool, no answer), "control" (leader)
    asynchronous: bool = False
    describe: Callable[..., str] | None = None
    detaches: Callable[..., bool] | None = None
    #: ``profile_as(*args)``: (exec mode or None, name) of the user's call in a profile
    profile_as: Callable[..., tuple[str | None, str]] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("call", "notify", "control"):
            raise ValueError(f"handler mode must be 'call', 'notify' or 'control', got "
                             f"{self.mode!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _is_asynchronous(func: Any) -> bool:
    """Whether ``func`` answers with a future: an asynchronous handler, or a function
    decorated with ``@rpc.functions.async_execution``."""
    if type(func) is Handler:
        return func.asynchronous
    return getattr(func, "_wrapped_async_rpc_function", None) is not None


def detaches_parameters(func: Any, args: tuple) -> bool:
    """torch's rule for the ``nn.Parameter`` objects a call carries (arguments and result).

    torch pickles the arguments and results of Python functions, and ``Parameter`` pickles
    as its detached data (a new leaf on arrival); torch builtin ops (``torch.add``) travel
    as TorchScript values, parameters attached. mpidag's internal handlers (``remote``,
    ``to_here``) apply the rule of the user's call they carry (``Handler.detaches``).

    Example::

        >>> detaches_parameters(my_python_function, ()), detaches_parameters(torch.add, ())
        (True, False)
    """
    if isinstance(func, Handler) and func.detaches is not None:
        return func.detaches(*args)
    return _find_builtin(func) is None


def describe(func: Any, args: tuple | None = None) -> str:
    """A readable name of a called function; mpidag's internal handlers (``remote``,
    ``to_here``, RRef proxies) describe the user's call they carry (``Handler.describe``)."""
    if isinstance(func, Handler):
        if func.describe is not None and args is not None:
            try:
                return func.describe(*args)
            except Exception:
                pass
        return f"mpidag:{func.name}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module and name else repr(func)


class CallObserver:
    """How a layer above sees the agent's messages (distributed autograd's interface).

    The agent calls these from the threads that send and receive; this base class observes
    nothing. ``active`` is false while the observer has nothing to record in outgoing
    requests (no context on this rank): the agent then skips :meth:`outgoing` altogether.

    Example::

        >>> agent.set_observer(container)      # a ContextContainer records send/recv
    """

    active = False

    def outgoing(self, dst: int, tensors: list[torch.Tensor],
                 what: Callable[[], str]) -> tuple[int, int]:
        """A request from this thread to ``dst`` is being sent: its header's
        ``(context_id, message_id)``, ``(0, 0)`` outside any context."""
        return 0, 0

    def replying(self, context_id: int, dst: int, tensors: list[torch.Tensor],
                 what: Callable[[], str]) -> int:
        """A reply in ``context_id`` is being sent to ``dst``: its message id (0: none)."""
        return 0

    def sent(self, context_id: int, message_id: int) -> None:
        """A message that got a message id left this rank."""

    def received(self, env: Envelope, what: Callable[[], str]) -> Any:
        """A message with a ``context_id`` arrived: record it (may replace ``env.tensors``);
        returns the state to serve its call in (see :meth:`serving`), or ``None``."""
        return None

    def serving(self, state: Any, message_id: int, what: Callable[[], str]) -> Any:
        """The call of a received message is about to run in ``state``; returns a token
        for :meth:`served`."""
        return None

    def served(self, token: Any) -> None:
        """The call that :meth:`serving` announced returned."""


_NO_OBSERVER = CallObserver()
#: the message kinds as plain ints: reading an enum member costs ~90 ns, a global ~20 ns
_CALL, _RESULT, _ERROR, _NOTIFY, _CONTROL = (int(kind) for kind in (
    Kind.CALL, Kind.RESULT, Kind.ERROR, Kind.NOTIFY, Kind.CONTROL))
#: types of callables whose calls may carry a cached reference instead of a pickle
_REF_TYPES = frozenset({types.FunctionType, types.BuiltinFunctionType, Handler})


class RpcAgent:
    """Calls of one rank: pending futures, timeouts, serving requests, internal handlers.

    Example::

        >>> agent = RpcAgent(transport, workers, options, device_maps={}, config=Config())
        >>> agent.start()
        >>> agent.wait(agent.call(1, torch.add, (torch.ones(2), 1), {}, timeout=10), 10)
        tensor([2., 2.])
    """

    def __init__(self, transport: Transport, workers: list[WorkerInfo],
                 options: MPIRpcBackendOptions,
                 device_maps: dict[str, dict[str, dict[torch.device, torch.device]]],
                 config: Config | None = None) -> None:
        config = config or Config()
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.size
        self.workers = workers
        self.info = workers[self.rank]
        self.by_name = {w.name: w for w in workers}
        self.options = options
        self.default_timeout = options.rpc_timeout
        #: device_maps[src_name][dst_name] = {src_device: dst_device}, for every rank
        self.device_maps = device_maps
        self.ids = IdGenerator(self.rank, self.world_size)
        self._pending: dict[int, _PendingCall] = {}
        self._next_expiry_scan = 0.0
        #: messages this rank sent to each rank, and received from each and finished
        #: handling (per peer, so that a failed rank's messages can be left out)
        self._sent_to = [0] * self.world_size
        self._processed_from = [0] * self.world_size
        self._count_lock = threading.Lock()
        #: ranks that failed (fault-tolerant jobs): calls to them raise WorkerFailedError
        self.failed: set[int] = set()
        #: ranks that shut down alone (graceful=False); also in ``failed``
        self.left: set[int] = set()
        self._failure_listeners: list[Callable[[int], None]] = []
        self.running = True
        self.config = config
        #: pickling rules of the layers above (RRefs); handlers travel by name
        self.codecs = Codecs()
        self._handlers: dict[str, Handler] = {}
        #: function or handler -> (payload prefix, flag) of calls of it (see _call_prefix)
        self._call_prefixes: dict[Any, tuple[bytes, int]] = {}
        #: payload prefix -> (function, its module's namespace or None, its name)
        self._call_targets: dict[bytes, tuple[Callable, dict | None, str]] = {}
        self.codecs.register(Handler, "handler", lambda h, scope: h.name, self._handler_named)
        self.observer: CallObserver = _NO_OBSERVER
        #: called as hook() before a graceful shutdown's final quiescence (RRefs)
        self._shutdown_hooks: list[Callable[[], None]] = []
        #: (queue, hook): the leader calls hook() after a poll while the queue is not empty
        self._tick_hooks: list[tuple[Any, Callable[[], None]]] = []
        #: (begin, end) around unpickling a call's arguments (add_hooks(arguments=...))
        self._arguments_hook: tuple[Callable[[], None],
                                    Callable[[], Callable[[], bool] | None]] | None = None
        #: extra "this rank is not idle" conditions for the quiescence test
        self._busy_checks: list[Callable[[], bool]] = []
        max_sleep = options.max_sleep if options.max_sleep is not None else config.backoff_max
        self.engine = ProgressEngine(
            transport.poll, self._dispatch, self._tick, options.num_worker_threads,
            spin=config.poll_spin, max_sleep=max_sleep,
            sentinel_interval=config.sentinel_interval, name=f"mpidag-r{self.rank}",
        )
        self._register_profiled_handlers()
        #: a rank that shuts down without the others (graceful=False) says so to them
        self._left = self.register_handler("agent.left", self._peer_left, mode="control")

    def start(self) -> None:
        """Start the progress engine's threads: from now on this rank receives and serves."""
        self.engine.start()

    @property
    def sent(self) -> int:
        """Messages this rank sent."""
        return sum(self._sent_to)

    @property
    def processed(self) -> int:
        """Messages this rank received and finished handling."""
        return sum(self._processed_from)

    # ------------------------------------------------------ what layers plug in
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

            >>> fetch = agent.register_handler("rref.fetch", self._fetch, asynchronous=True)
            >>> agent.wait(agent.call(owner, fetch, (rref_id,), {}, timeout), timeout)
        """
        if name in self._handlers:
            raise ValueError(f"a handler named {name!r} is already registered")
        handler = Handler(name, fn, mode, asynchronous, describe, detaches, profile_as)
        self._handlers[name] = handler
        return handler

    def _register_profiled_handlers(self) -> None:
        """The handlers that run a call under the callee's profile when its caller profiles
        (see :mod:`mpidag._remote_profiling`): ``(options, func, args, kwargs)``."""
        install_rpc_profiling(self.rank)
        rank = self.rank
        for name, asynchronous in (("agent.profiled", False), ("agent.profiled_async", True)):
            self.register_handler(
                name, lambda opts, f, a, k, _async=asynchronous: serve_profiled(
                    rank, opts, f, a, k, _async),
                asynchronous=asynchronous,
                describe=lambda opts, f, a, k: describe(f, a),
                detaches=lambda opts, f, a, k: detaches_parameters(f, a))
        self._profiled = (self._handlers["agent.profiled"],
                          self._handlers["agent.profiled_async"])

    def _handler_named(self, name: str) -> Handler:
        handler = self._handlers.get(name)
        if handler is None:
            raise RPCError(f"{self.where()} has no internal handler {name!r} (known: "
                           f"{sorted(self._handlers)}): do the ranks run different mpidag "
                           f"versions?")
        return handler

    def set_observer(self, observer: CallObserver) -> None:
        """Let ``observer`` see every call, reply and received message (one observer)."""
        if self.observer is not _NO_OBSERVER and observer is not self.observer:
            raise RuntimeError("the agent already has a call observer")
        self.observer = observer

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

            >>> agent.add_hooks(tick=self.process_releases, tick_queue=self.releases)
        """
        if tick is not None:
            if tick_queue is None:
                raise ValueError("a tick hook needs the queue that tells when it has work")
            self._tick_hooks.append((tick_queue, tick))
        if busy is not None:
            self._busy_checks.append(busy)
        if before_shutdown is not None:
            self._shutdown_hooks.append(before_shutdown)
        if arguments is not None:
            if self._arguments_hook is not None:
                raise RuntimeError("the agent already has an arguments hook")
            self._arguments_hook = arguments

    def add_failure_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(rank)`` (on the leader) when a rank is found to have failed, after
        the calls pending to it failed (fault-tolerant jobs; RRefs, autograd)."""
        self._failure_listeners.append(listener)

    def failed_error(self, rank: int, what: str = "") -> WorkerFailedError:
        """The error of a call to (or that needed) a failed rank."""
        name = self.workers[rank].name
        prefix = f"{what} to {name}" if what else f"a call to {name}"
        return WorkerFailedError(
            f"{prefix} could not complete: worker {name} (rank {rank}) failed; the other "
            f"workers go on (see mpidag.rpc.failed_workers())", rank, name)

    def _peer_failed(self, rank: int) -> None:
        """The transport found ``rank`` dead: fail what waits for it, tell the layers."""
        if rank in self.failed:
            return
        self.failed.add(rank)
        log.warning("%s: worker %s (rank %d) failed; its pending calls fail, the others go "
                    "on", self.where(), self.workers[rank].name, rank)
        for request_id, call in self._pending.copy().items():
            if call.dst == rank and self._pending.pop(request_id, None) is not None \
                    and not call.done:
                call.set_exception(self.failed_error(rank, call.what))
        self.engine.wake_waiters()
        for listener in self._failure_listeners:
            try:
                listener(rank)
            except Exception:
                log.exception("%s: a failure listener failed for rank %d", self.where(), rank)

    def _peer_left(self, rank: int) -> None:
        """``rank`` shut down on its own (``shutdown(graceful=False)``): what waits for it
        fails at once, as for a failed worker, instead of running into its timeout."""
        if 0 <= rank < self.world_size and rank != self.rank:
            self.left.add(rank)
            log.info("%s: worker %s (rank %d) shut down without the others",
                     self.where(), self.workers[rank].name, rank)
            self._peer_failed(rank)

    def _say_goodbye(self) -> None:
        """Before a local shutdown: tell every other rank, so their calls to this one fail
        at once (torch's peers see the connection close)."""
        for rank in range(self.world_size):
            if rank != self.rank and rank not in self.failed:
                try:
                    self.notify(rank, self._left, (self.rank,))
                except Exception:  # noqa: BLE001 - best effort: the peer may be gone too
                    log.debug("could not tell rank %d of the local shutdown", rank)

    def run_shutdown_hooks(self) -> None:
        """Run the ``before_shutdown`` hooks (between the two rounds of a graceful shutdown)."""
        for hook in self._shutdown_hooks:
            hook()

    # ------------------------------------------------------------- addressing
    def where(self) -> str:
        return f"{self.info.name} (rank {self.rank} of {self.world_size})"

    def devices_for(self, dst: int, tensors: list[torch.Tensor], reply: bool) -> list[str]:
        """Where each tensor lands on ``dst``: CPU stays CPU, CUDA follows the device map.

        Requests use the sender's map to ``dst``; replies use the inverse of ``dst``'s map
        to this rank (torch's rule).
        """
        if not tensors:
            return []
        out: list[str] = []
        mapping: dict[torch.device, torch.device] | None = None
        for t in tensors:
            if t.device.type == "cpu":
                out.append("cpu")
                continue
            if mapping is None:
                mapping = self._map_to(dst, reply)
            target = mapping.get(t.device)
            if target is None:
                dst_name = self.workers[dst].name
                raise ValueError(
                    f"cannot send a tensor on {t.device} to {dst_name}: no device map entry "
                    f"for {t.device} (map: {mapping or 'none'}). Call "
                    f"options.set_device_map({dst_name!r}, {{{t.device.index}: <device>}}) "
                    f"before init_rpc, or move the tensor to the CPU first."
                )
            out.append(str(target))
        return out

    def _map_to(self, dst: int, reply: bool) -> dict[torch.device, torch.device]:
        me, peer = self.info.name, self.workers[dst].name
        if not reply:
            return self.device_maps.get(me, {}).get(peer, {})
        forward = self.device_maps.get(peer, {}).get(me, {})
        return {v: k for k, v in forward.items()}

    # ---------------------------------------------------------------- sending
    def dumps_for(self, dst: int, obj: Any, call: tuple[Any, tuple] | None = None,
                  prefix: bytes = b"") -> tuple[bytes | memoryview, list[torch.Tensor]]:
        """Pickle ``obj`` for rank ``dst`` (the ``context`` the codecs' reduce functions see:
        RRefs fork for their destination). ``call``: the ``(func, args)`` whose arguments or
        result this is (how parameters travel, see :func:`detaches_parameters`).
        ``prefix``: bytes that start the payload."""
        if call is None:
            return dumps(obj, codecs=self.codecs, prefix=prefix, context=dst)
        return dumps(obj, lambda: detaches_parameters(*call), self.codecs, prefix, dst)

    def _send(self, dst: int, env: Envelope, reply: bool) -> None:
        devices = self.devices_for(dst, env.tensors, reply)
        with self._count_lock:
            self._sent_to[dst] += 1
        try:
            self.transport.send(dst, env, devices)
        except BaseException as exc:
            with self._count_lock:
                self._sent_to[dst] -= 1
            if isinstance(exc, WorkerFailedError):
                raise self.failed_error(dst) from None
            raise

    def resolve_timeout(self, timeout: float) -> float:
        """torch's rule: negative (unset) means the default, 0 means no timeout."""
        if timeout is None or timeout < 0:
            return self.default_timeout
        return float(timeout)

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
        """
        if self.left and dst in self.left:
            future = RpcFuture()
            future.set_exception(self.failed_error(dst, describe(func, args)))
            return future
        if not call_profiling():
            return self._call(dst, func, args, kwargs, timeout, record, True).future
        if legacy_profiling():
            return self._profiled_call(dst, func, args, kwargs, timeout, record, exec_mode)
        span = record_function(f"mpidag.rpc#{describe(func, args)}"
                               f"({self.info.name} -> {self.workers[dst].name})")
        span.__enter__()
        try:
            future = self._call(dst, func, args, kwargs, timeout, record, True).future
        except BaseException:
            span.__exit__(None, None, None)
            raise
        span._call_end_callbacks_on_future(future)
        return future

    def call_sync(self, dst: int, func: Callable, args: tuple, kwargs: dict, timeout: float,
                  *, record: bool = True) -> Any:
        """Send a CALL and wait for its answer in this thread (driving the progress
        engine meanwhile); return the value or raise the remote error (with its type) or
        an ``RPCTimeoutError``. As :meth:`call` followed by :meth:`wait`, without a
        ``torch.futures.Future``.

        Example::

            >>> agent.call_sync(1, torch.add, (torch.ones(2), 1), {}, timeout=10)
            tensor([2., 2.])
        """
        if call_profiling():
            return self.wait(self.call(dst, func, args, kwargs, timeout, record=record,
                                       exec_mode="sync"), timeout)
        call = self._call(dst, func, args, kwargs, timeout, record, False)
        if not call.done:
            deadline = call.deadline or None
            if not self.engine.wait_until(call.is_done, deadline) and not call.done:
                self._fail_timeout(call.request_id)
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
        mode, name = function_name(func, args)
        key = rpc_profiling_key(mode or exec_mode, name, self.info.name, self.workers[dst].name)
        handler = self._profiled[_is_asynchronous(func)]

        def send(options: tuple) -> RpcFuture:
            return self._call(dst, handler, (options, func, args, kwargs), {}, timeout,
                              record, True).future

        def new_future() -> RpcFuture:
            future = RpcFuture()
            future._engine = self.engine
            return future

        return profiled_call(key, send, new_future)

    def _encode_call(self, dst: int, func: Callable, args: tuple, kwargs: dict
                     ) -> tuple[bytes | memoryview, list[torch.Tensor], int]:
        """``(payload, tensors, flags)`` of a call of ``func``: a :class:`Handler` by name, a
        module-level function by its cached reference (see :mod:`.messages`), anything else
        (bound methods, callable objects) pickled with its arguments."""
        try:
            prefix = None
            if type(func) in _REF_TYPES:
                prefix = self._call_prefixes.get(func) or self._call_prefix(func)
            if prefix is not None:
                ref, flags = prefix
                if not kwargs and is_plain(args):
                    if not args:
                        return ref, [], flags
                    return ref + pickle.dumps((args, kwargs), pickle.HIGHEST_PROTOCOL), [], flags
                payload, tensors = self.dumps_for(dst, (args, kwargs), (func, args), ref)
                return payload, tensors, flags
            payload, tensors = self.dumps_for(dst, (func, args, kwargs), (func, args))
            return payload, tensors, 0
        except Exception as exc:
            raise SerializationError(
                f"could not pickle the call of {describe(func)} for {self.workers[dst].name}: "
                f"{exc}. Arguments and the function must be picklable (define functions at "
                f"module level; no lambdas, locks, open files or generators)."
            ) from exc

    def _call_prefix(self, func: Any) -> tuple[bytes, int] | None:
        """The payload prefix of calls of ``func`` and its flag, or ``None`` when ``func``
        must travel pickled with each call (kept in a table by function)."""
        if isinstance(func, Handler):
            ref, flag = func.name.encode(), FLAG_HANDLER
        else:
            owner = getattr(func, "__self__", None)  # builtins: a module, or a bound object
            if "<" in func.__qualname__ or not (
                    owner is None or isinstance(owner, types.ModuleType | type)):
                return None  # lambdas, local functions, methods of objects
            try:
                ref = pickle.dumps(func, pickle.HIGHEST_PROTOCOL)
            except Exception:
                return None  # the full pickle raises the error the user sees
            flag = FLAG_FUNCTION_REF
        prefix = (REF_LENGTH.pack(len(ref)) + ref, flag)
        self._call_prefixes[func] = prefix
        return prefix

    def _resolve_ref(self, prefix: bytes, flags: int) -> Callable:
        """The function or handler a call's payload prefix names (a table lookup after the
        first call; a module-level name is checked against its module on every call, so a
        function replaced in its module is found again)."""
        entry = self._call_targets.get(prefix)
        if entry is not None:
            func, namespace, name = entry
            if namespace is None or namespace.get(name) is func:
                return func
        if flags & FLAG_HANDLER:
            func, namespace, name = self._handler_named(prefix[2:].decode()), None, ""
        else:
            func = pickle.loads(prefix[2:])
            module = sys.modules.get(getattr(func, "__module__", None) or "")
            name = getattr(func, "__qualname__", "")
            namespace = vars(module) if module is not None and "." not in name else None
            if namespace is not None and namespace.get(name) is not func:
                namespace = None
        self._call_targets[prefix] = (func, namespace, name)
        return func

    def _call(self, dst: int, func: Callable, args: tuple, kwargs: dict, timeout: float,
              record: bool, with_future: bool) -> _PendingCall:
        if not self.running:
            raise RPCError("the RPC agent is shut down; call mpidag.rpc.init_rpc again first")
        if self.failed and dst in self.failed:
            raise self.failed_error(dst, describe(func, args))
        payload, tensors, flags = self._encode_call(dst, func, args, kwargs)
        context_id = message_id = 0
        if record and self.observer.active:
            context_id, message_id = self.observer.outgoing(
                dst, tensors, lambda: f"the arguments of {describe(func, args)} sent to "
                                      f"{self.workers[dst].name}")
        request_id = self.ids.next()
        if with_future:
            future = RpcFuture()
            future._engine = self.engine
        else:
            future = None
        seconds = self.resolve_timeout(timeout)
        now = time.monotonic()
        deadline = now + seconds if seconds > 0 else 0.0
        call = self._pending[request_id] = _PendingCall(request_id, future, dst, now, deadline,
                                                        func, seconds, args)
        env = Envelope(_CALL, request_id, flags, context_id, message_id, payload, tensors)
        try:
            self._send(dst, env, reply=False)
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        if message_id:
            self.observer.sent(context_id, message_id)  # while the callee works
        return call

    def notify(self, dst: int, func: Callable, args: tuple = (),
               kwargs: dict | None = None) -> None:
        """Run ``func(*args, **kwargs)`` on ``dst`` with no answer; a :class:`Handler` of
        mode ``"control"`` runs on the receiving leader at once, in arrival order.

        Example::

            >>> agent.notify(owner, user_delete, (rref_id, fork_id))
        """
        payload, tensors, flags = self._encode_call(dst, func, args, kwargs or {})
        kind = _CONTROL if isinstance(func, Handler) and func.mode == "control" \
            else _NOTIFY
        self._send(dst, Envelope(kind=kind, flags=flags, payload=payload, tensors=tensors),
                   reply=False)

    def wait(self, future: RpcFuture, timeout: float) -> Any:
        """Wait for ``future`` driving progress; raise its error or a timeout."""
        seconds = self.resolve_timeout(timeout)
        deadline = time.monotonic() + seconds if seconds > 0 else None
        if not self.engine.wait_until(future.done, deadline) and not future.done():
            self._expire_future(future)
        return future.wait()

    def _expire_future(self, future: RpcFuture) -> None:
        for request_id, call in self._pending.copy().items():
            if call.future is future:
                self._fail_timeout(request_id)
                return

    def _fail_timeout(self, request_id: int) -> None:
        call = self._pending.pop(request_id, None)
        if call is None or call.done:
            return
        seconds = call.seconds
        dst_name = self.workers[call.dst].name
        error = RPCTimeoutError(
            f"RPC ran for more than the set timeout ({seconds * 1000:.0f} ms) and will now be "
            f"marked with an error: the call of {call.what} to {dst_name}; pass a larger "
            f"timeout= or rpc_timeout in the backend options"
        )
        if call.future is not None and call.future._user_callbacks:  # (see _complete)
            self.engine.submit(lambda: self._settle(call, None, error))
            return
        self._settle(call, None, error)

    def _tick(self) -> None:
        """Called by the leader after each poll: hooks, then expire calls past deadline.

        The table of pending calls is copied with ``dict.copy()``, never iterated or
        listed: building a list of its items allocates, an allocation can run the garbage
        collector and a ``__del__`` that releases the GIL, and another thread that adds a
        call meanwhile made the scan fail with "dictionary changed size during iteration"
        (seen with 4 ranks calling each other)."""
        for queue, hook in self._tick_hooks:
            if queue:
                hook()
        now = time.monotonic()
        if now < self._next_expiry_scan or not self._pending:
            return
        self._next_expiry_scan = now + EXPIRY_SCAN_INTERVAL
        for request_id, call in self._pending.copy().items():
            if call.deadline and call.deadline <= now:
                self._fail_timeout(request_id)

    # --------------------------------------------------------------- receiving
    def _dispatch(self, env: Envelope) -> Callable[[], None] | None:
        kind = env.kind
        if kind in (_RESULT, _ERROR):
            return self._complete(env)
        if kind == _CALL:
            return lambda: self._serve_call(env)
        if kind == _NOTIFY:
            return lambda: self._serve_notify(env)
        if kind == _CONTROL:
            self._serve_notify(env)
            return None
        if kind == PEER_FAILED:
            self._peer_failed(env.src)
            return None
        log.error("dropping a message of unknown kind %r from rank %d", kind, env.src)
        self._mark_processed(env.src)
        return None

    def _mark_processed(self, src: int) -> None:
        with self._count_lock:
            self._processed_from[src] += 1

    def _complete(self, env: Envelope) -> Callable[[], None] | None:
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
            if env.kind == _RESULT:
                try:
                    if env.message_id:
                        self.observer.received(env, lambda: f"the result of {call.what} from "
                                                            f"{self.workers[src].name}")
                    value = loads(env.payload, env.tensors, self.codecs)
                except Exception as exc:
                    error = SerializationError(
                        f"could not unpickle the result of {call.what} from "
                        f"{self.workers[src].name}: {exc}")
            else:
                error = unpack_exception(bytes(env.payload))
                if self.config.ft and isinstance(error, WorkerFailedError) and \
                        0 <= error.rank < self.world_size and error.rank != self.rank:
                    self._peer_failed(error.rank)  # another rank saw it first: so it is
            future = call.future
            if future is not None and future._user_callbacks:
                def finish(src: int = src) -> None:
                    try:
                        self._settle(call, value, error)
                    finally:
                        self._mark_processed(src)  # only now: the termination test waits

                src = -1  # counted as processed by finish()
                return finish
            self._settle(call, value, error)
            return None
        finally:
            if src >= 0:
                self._mark_processed(src)

    def _settle(self, call: _PendingCall, value: Any, error: BaseException | None) -> None:
        """Give ``call`` its answer (running its future's callbacks) and wake waiters."""
        if error is not None:
            call.set_exception(error)
        else:
            call.set_result(value)
        self.engine.wake_waiters()

    def _unpack_call(self, env: Envelope) -> tuple[Callable, tuple, dict]:
        try:
            flags = env.flags
            if flags & (FLAG_HANDLER | FLAG_FUNCTION_REF):
                payload = env.payload
                end = 2 + (payload[0] | payload[1] << 8)
                func = self._resolve_ref(bytes(payload[:end]), flags)
                if len(payload) == end:
                    return func, (), {}
                args, kwargs = self._load_arguments(payload[end:], env)
                return func, args, kwargs
            func, args, kwargs = self._load_arguments(env.payload, env)
        except RPCError:
            raise
        except Exception as exc:
            detail = (f"could not unpickle a call from {self.workers[env.src].name} on "
                      f"{self.where()}: {exc}. The function and the classes of its arguments "
                      f"must be importable on the callee (defined at module level in a module "
                      f"every rank imports).")
            if isinstance(exc, AttributeError | ImportError):  # torch's RuntimeError text
                raise wrap_error(exc, f"{exc}. Default RPC pickler does not serialize "
                                      f"function code. Ensure that UDFs are defined on both "
                                      f"caller and callee modules: {detail}") from exc
            try:
                raise type(exc)(detail) from exc
            except TypeError:  # an exception type whose __init__ takes other arguments
                raise SerializationError(detail) from exc
        return func, args or (), kwargs or {}

    def _load_arguments(self, payload: bytes | memoryview, env: Envelope) -> Any:
        """``loads`` of a call's arguments; with an arguments hook (see :meth:`add_hooks`),
        the serving thread then waits, driving progress, for what the arguments need
        before the function may run (RRefs confirmed by their owner, as torch does). A
        control message runs on the leader and never waits."""
        watch = self._arguments_hook
        if watch is None or env.kind == _CONTROL:
            return loads(payload, env.tensors, self.codecs)
        begin, end = watch
        begin()
        try:
            value = loads(payload, env.tensors, self.codecs)
        finally:
            ready = end()
        if ready is not None:
            self.engine.wait_until(ready, None)
        return value

    def _serve_call(self, env: Envelope) -> None:
        """Run an incoming CALL and answer it; a profiler range while a profiler runs.

        Any exception of the function, ``SystemExit`` and other ``BaseException`` types
        included, is the answer (with its type); the serving thread goes on serving.
        """
        if env.context_id or observing():
            self._serve_observed_call(env)
            return
        func = None
        try:  # the common case: no autograd context, no profiler, a synchronous function
            func, args, kwargs = self._unpack_call(env)
            if _is_asynchronous(func) and type(func) is not Handler:
                self._serve_observed_call(env, (func, args, kwargs))
                return
            result = func(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the caller gets it, with its type
            self._log_failure(exc)
            self._reply_error(env, operator_error(func, exc))
            return
        if type(func) is Handler and func.asynchronous and isinstance(result, torch._C.Future):
            self._answer_when_done(env, result, (func, args))
            return
        self._reply_value(env, result, (func, args))

    def _answer_when_done(self, env: Envelope, fut: torch.futures.Future,
                          call: tuple) -> None:
        """Answer with ``fut``'s value or error once it completes (at once if it has)."""
        add = fut.add_internal_callback if isinstance(fut, RpcFuture) \
            else fut.add_done_callback  # (the reply is short: on any thread)
        add(lambda done: self._reply_future(env, done, call))

    def _serve_observed_call(self, env: Envelope,
                             unpacked: tuple[Callable, tuple, dict] | None = None) -> None:
        """:meth:`_serve_call` in an autograd context, under a profiler (a server-wide one
        profiles ``func``; GIL profiling measures the wait for the GIL first), or of an
        ``@async_execution`` function (``unpacked``: the call, if already unpickled)."""
        state = None
        span = None
        func = None
        asynchronous = False
        src_name = self.workers[env.src].name
        try:
            if env.context_id:
                state = self.observer.received(
                    env, lambda: f"the arguments of a call from {src_name}")
            func, args, kwargs = unpacked or self._unpack_call(env)
            if profiling():
                span = record_function(f"mpidag.rpc.serve#{describe(func, args)}"
                                       f"({src_name} -> {self.info.name})")
                span.__enter__()
            asynchronous = _is_asynchronous(func)
            run = func
            if server_profiling() and func is not self._profiled[0] and \
                    func is not self._profiled[1]:  # a server-wide profile (not twice)
                def run(*a: Any, _f: Callable = func, **k: Any) -> Any:
                    return serve_profiled(self.rank, None, _f, a, k, asynchronous)
            measure_gil_wait()
            if state is None:
                result = run(*args, **kwargs)
            else:
                token = self.observer.serving(state, env.message_id, lambda: (
                    f"the arguments of {describe(func, args)} from {src_name}"))
                try:
                    result = run(*args, **kwargs)
                finally:
                    self.observer.served(token)
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
                self._answer_when_done(env, result, (func, args))
                if span is not None:  # the range ends when the function's future does
                    span._call_end_callbacks_on_future(result)
                    return
        else:
            self._reply_value(env, result, (func, args))
        if span is not None:
            span.__exit__(None, None, None)

    def _log_failure(self, exc: BaseException) -> None:
        """Log a served function's exception on the callee, as torch's ``_run_function``
        prints it (``On <WorkerInfo>:``, its repr and traceback; one record per failed
        call, at ERROR on the ``mpidag.agent.agent`` logger: with no logging set up it
        reaches ``sys.stderr`` as in torch). The caller gets the exception as well. The
        exception is text: a record that a handler keeps must not keep it, its frames and
        the RRefs and tensors in them alive."""
        if log.isEnabledFor(logging.ERROR):
            log.error("On %s:\n%s\n%s", self.info, repr(exc),
                      "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))

    def _reply_future(self, env: Envelope, fut: torch.futures.Future,
                      call: tuple | None = None) -> None:
        error = future_error(fut)
        if error is not None:
            self._reply_error(env, error)
            return
        self._reply_value(env, fut.value(), call)

    def _reply_value(self, env: Envelope, value: Any, call: tuple | None = None) -> None:
        try:
            payload, tensors = self.dumps_for(env.src, value, call)
            message_id = 0
            if env.context_id and tensors:
                message_id = self.observer.replying(
                    env.context_id, env.src, tensors,
                    lambda: f"the result of {describe(*call) if call else 'a call'} sent to "
                            f"{self.workers[env.src].name}")
            reply = Envelope(kind=_RESULT, request_id=env.request_id, payload=payload,
                             tensors=tensors, context_id=env.context_id if message_id else 0,
                             message_id=message_id)
            devices = self.devices_for(env.src, tensors, reply=True)
        except Exception as exc:
            self._reply_error(env, SerializationError(
                f"the return value ({type(value).__name__}) could not be sent back from "
                f"{self.where()}: {exc}"))
            return
        with self._count_lock:  # the request is handled once its answer is on its way
            self._sent_to[env.src] += 1
            self._processed_from[env.src] += 1
        try:
            self.transport.send(env.src, reply, devices)
        except WorkerFailedError:  # the caller died meanwhile: nobody to answer
            log.debug("the answer to rank %d is dropped: it failed", env.src)
            return
        if message_id:
            self.observer.sent(env.context_id, message_id)

    def _reply_error(self, env: Envelope, exc: BaseException) -> None:
        payload = pack_exception(exc, self.where())
        try:
            self._send(env.src, Envelope(kind=_ERROR, request_id=env.request_id,
                                         payload=payload), reply=True)
        except WorkerFailedError:  # the caller died meanwhile: nobody to answer
            log.debug("the error answer to rank %d is dropped: it failed", env.src)
        finally:
            self._mark_processed(env.src)

    def _serve_notify(self, env: Envelope) -> None:
        try:
            func, args, kwargs = self._unpack_call(env)
            func(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - nobody to answer: log it and go on serving
            log.exception("notification from rank %d failed on %s", env.src, self.where())
        finally:
            self._mark_processed(env.src)

    # ---------------------------------------------------------------- shutdown
    def counters(self) -> tuple[int, int, int]:
        busy = int(self.engine.busy or bool(self._pending)
                   or any(check() for check in self._busy_checks))
        failed = self.failed
        sent = processed = 0
        with self._count_lock:  # no container allocated under this lock: a GC could run
            for rank in range(self.world_size):  # a failed rank's messages are left out
                if rank not in failed:
                    sent += self._sent_to[rank]
                    processed += self._processed_from[rank]
        return sent, processed, busy

    def wait_quiescent(self, timeout: float) -> None:
        """Return when every rank is here and no message is in flight anywhere.

        Repeats a nonblocking all-reduce of (sent, processed, busy) until two rounds in a
        row show equal totals, nothing busy and no change: the four-counter termination
        test. Pool threads keep serving requests meanwhile.
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
        state = {"next_report": start + 30.0}

        def wait(done: Callable[[], bool]) -> None:
            with self.engine.parked():
                _wait(done)

        def _wait(done: Callable[[], bool]) -> None:
            backoff = Backoff(spin=0.0, min_sleep=20e-6, max_sleep=10e-3)
            while not done():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise RPCTimeoutError(
                        f"{self.where()} timed out after {timeout} s waiting for the other "
                        f"ranks; {hint}")
                if now >= state["next_report"]:
                    log.warning("%s: waiting %.0f s for all ranks to finish (%s)",
                                self.where(), now - start, hint)
                    state["next_report"] = now + 30.0
                backoff.idle()

        return wait

    def fail_pending(self, reason: str) -> None:
        for request_id in self._pending.copy():
            call = self._pending.pop(request_id, None)
            if call is not None and not call.done:
                call.set_exception(WorkerDiedError(
                    f"{call.what} to {self.workers[call.dst].name} did not complete: {reason}"))

    def stop(self, graceful: bool) -> None:
        if not graceful and self.running:
            self._say_goodbye()
        self.running = False
        self.engine.stop()
        self.fail_pending("the RPC agent was shut down")
        self.transport.close(collective=graceful)
