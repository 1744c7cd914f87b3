"""The few exception types mpidag raises, and how remote errors are carried.

Every type also derives from the builtin that ``torch.distributed.rpc`` raises for the same
mistake (mostly ``RuntimeError``), so code ported from torch keeps catching what it caught.
"""

from __future__ import annotations

import copy
import pickle
import traceback

__all__ = [
    "RPCError",
    "RPCNotInitializedError",
    "RPCTimeoutError",
    "RemoteTraceback",
    "UnknownWorkerError",
    "InvalidArgumentError",
    "WorkerDiedError",
    "WorkerFailedError",
    "SerializationError",
    "RemoteBaseException",
    "WrappedError",
    "wrap_error",
    "node_error",
    "operator_error",
    "async_result_error",
    "storable",
    "pack_exception",
    "unpack_exception",
    "detached_copy",
    "frameless",
    "future_error",
]


class RPCError(RuntimeError):
    """Base class of mpidag's own errors (a ``RuntimeError``, like torch's RPC errors).

    Also raised for a remote exception whose type cannot be pickled, naming that type.

    Example::

        >>> try:
        ...     rpc.rpc_sync("worker1", time.sleep, args=(0.5,), timeout=0.1)
        ... except rpc.RPCError as exc:        # every mpidag error, timeouts included
        ...     print(type(exc).__name__)
        RPCTimeoutError
    """


class RPCNotInitializedError(RPCError):
    """An RPC API was used before :func:`mpidag.rpc.init_rpc` or after ``shutdown``.

    Example::

        >>> rpc.get_worker_info()              # before init_rpc()
        Traceback (most recent call last):
        mpidag.errors.RPCNotInitializedError: RPC has not been initialized. Call
        mpidag.rpc.init_rpc first, on every rank of the MPI job (torch: Current RPC agent is
        not set! Did you initialize the RPC framework?)
    """


class RPCTimeoutError(TimeoutError, RPCError):
    """A call did not complete within its timeout (a ``TimeoutError`` and a ``RuntimeError``).

    Example::

        >>> fut = rpc.rpc_async("worker1", time.sleep, args=(0.5,), timeout=0.1)
        >>> try:
        ...     fut.wait()
        ... except TimeoutError:               # what torch raises; RuntimeError works too
        ...     print("timed out")
        timed out
    """


class UnknownWorkerError(ValueError, RPCError):
    """A worker name, rank or ``WorkerInfo`` that is not part of this job (a ``ValueError``).

    Example::

        >>> rpc.rpc_sync("worker9", torch.add, args=(1, 2))   # a job of 2 ranks
        Traceback (most recent call last):
        mpidag.errors.UnknownWorkerError: could not find destination name worker9 (unknown
        destination worker 'worker9'); workers: ['worker0', 'worker1']
    """


class InvalidArgumentError(ValueError, RPCError):
    """An argument of an RPC call that can never be right (a negative or NaN ``timeout``, a
    ``to`` that is no worker name, ``WorkerInfo`` or rank), raised on the caller before
    anything is sent. A ``ValueError`` and a ``RuntimeError`` (torch's type for these).

    Example::

        >>> rpc.rpc_sync("worker1", torch.add, args=(1, 2), timeout=-5)
        Traceback (most recent call last):
        mpidag.errors.InvalidArgumentError: timeout=-5 is not a valid timeout: pass seconds >= 0
        (0: no timeout), or leave timeout= out (UNSET_RPC_TIMEOUT, -1.0) for the default
        timeout of the backend options (rpc_timeout)
    """


class WorkerDiedError(RPCError):
    """The peer rank of a call failed or shut down before answering.

    Example::

        >>> fut = rpc.rpc_async("worker1", time.sleep, args=(1,))
        >>> rpc.shutdown(graceful=False)       # this rank stops: fut fails
        >>> fut.wait()
        Traceback (most recent call last):
        mpidag.errors.WorkerDiedError: time.sleep to worker1 did not complete: the RPC agent was
        shut down
    """


class WorkerFailedError(WorkerDiedError):
    """A worker of the job failed (its process died of a signal: killed, crashed, or an
    uncaught exception, which an ``--ft`` job turns into ``SIGKILL``), in a job started with
    fault tolerance (``python -m mpidag.run --ft``). A process that exits normally without
    ``shutdown`` is not reported by Open MPI (see ``docs/fault_tolerance.md``).

    Raised on every survivor by the calls, RRef uses, backward passes and optimizer steps
    that needed that worker: pending ones within the failure detector's delay, new ones at
    once. ``rank`` is the failed rank, ``worker_name`` its name (``None`` where only the rank
    is known). The survivors go on; :func:`mpidag.rpc.failed_workers` lists what was lost.

    Example (in a job of ``python -m mpidag.run --ft -n 3`` whose worker2 was killed: not
    run by the doctests, which kill no process)::

        try:
            rpc.rpc_sync("worker2", torch.add, args=(x, 1))
        except rpc.WorkerFailedError as exc:
            print(exc.worker_name, "is gone")       # prints: worker2 is gone
    """

    def __init__(self, message: str, rank: int = -1, worker_name: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.worker_name = worker_name

    def __reduce__(self):  # travels as a remote error with its fields
        return (type(self), (str(self), self.rank, self.worker_name))


class SerializationError(TypeError, RPCError):
    """An argument or return value could not be pickled or unpickled (a ``TypeError``).

    Example::

        >>> rpc.rpc_sync("worker1", lambda: 1)     # lambdas do not pickle
        Traceback (most recent call last):
        mpidag.errors.SerializationError: could not pickle the call of ...<lambda> for worker1:
        Can't pickle <function <lambda> at 0x...>: attribute lookup <lambda> on ... failed.
        Arguments and the function must be picklable (define functions at module level; no
        lambdas, locks, open files or generators).
    """


class RemoteBaseException(RPCError):
    """Carries a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, ...) raised by a remote function: a ``torch.futures.Future`` can
    only hold an ``Exception``. ``rpc_sync`` and the future's ``wait()`` raise the carried
    exception itself, with its type; ``torch.futures.wait_all`` and ``value()`` raise this.

    Example::

        >>> rpc.rpc_sync("worker1", sys.exit, args=(3,))
        Traceback (most recent call last):
        SystemExit: 3
        >>> fut = rpc.rpc_async("worker1", sys.exit, args=(3,))
        >>> fut.wait()
        Traceback (most recent call last):
        SystemExit: 3
        >>> fut.value()                        # once done
        Traceback (most recent call last):
        mpidag.errors.RemoteBaseException: the remote function raised SystemExit: 3
    """

    def __init__(self, exception: BaseException) -> None:
        super().__init__(f"the remote function raised {type(exception).__name__}: "
                         f"{exception}")
        self.exception = exception

    def __reduce__(self) -> tuple:
        return type(self), (self.exception,)


class WrappedError(RuntimeError):
    """A ``RuntimeError`` carrying another exception, where torch reports a
    ``RuntimeError`` with a message of its own: a backward pass that failed on some rank
    (``"Error on Node 1: ..."``), a function or class the callee cannot find, a torch
    operator called with arguments that none of its schemas takes, an
    ``@async_execution`` function that returned no future.

    The message starts with torch's wording; the carried exception is ``original`` and
    ``__cause__``. The class also derives from the carried exception's type (it is named
    ``WrappedError[ValueError]`` and so on), so code that caught that type still does.

    Example::

        >>> class Bad(torch.autograd.Function):          # its backward fails
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         return x.clone()
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         raise ValueError("bad gradient")
        >>> def bad(x):
        ...     return Bad.apply(x)
        >>> x = torch.ones(2, requires_grad=True)
        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", bad, args=(x,)).sum()
        ...     try:
        ...         dist_autograd.backward(context_id, [loss])  # fails on worker1's part
        ...     except RuntimeError as exc:                 # torch's type; ValueError works too
        ...         print(exc, "|", type(exc.original).__name__, isinstance(exc, ValueError))
        Error on Node 1: bad gradient | ValueError True
    """

    #: the type this class also derives from (``None`` for ``WrappedError`` itself)
    carried_type: type[BaseException] | None = None
    original: BaseException | None = None

    def __str__(self) -> str:  # the message as given, whatever the carried type's __str__
        return str(self.args[0]) if len(self.args) == 1 else RuntimeError.__str__(self)

    def __reduce__(self) -> tuple:  # the class is made at run time: rebuilt from its parts
        state = {k: v for k, v in self.__dict__.items() if k != "original"}
        carried = self.original if self.original is not None else self.carried_type
        return _rebuild_wrapped, (carried, str(self), state)


_wrapped_types: dict[type, type[WrappedError]] = {}


def _wrapped_type(base: type[BaseException] | None) -> type[WrappedError]:
    """``WrappedError[base]``, a subclass of ``WrappedError`` and ``base`` (made once per
    type); ``WrappedError`` itself where ``base`` is none, ``RuntimeError``, or cannot be
    combined with it."""
    if (base is None or base is RuntimeError or issubclass(base, WrappedError)
            or not issubclass(base, Exception)):
        return WrappedError
    cls = _wrapped_types.get(base)
    if cls is None:
        try:
            cls = type(f"WrappedError[{base.__qualname__}]", (WrappedError, base),
                       {"__module__": __name__, "carried_type": base})
            base.__new__(cls, "probe")  # a type whose construction cannot be combined
        except Exception:
            cls = WrappedError
        _wrapped_types[base] = cls
    return cls


def wrap_error(carried: BaseException | type[BaseException] | None, message: str,
               **attrs: object) -> WrappedError:
    """A :class:`WrappedError` with ``message``, carrying ``carried`` (an exception, which
    becomes ``original`` and ``__cause__`` and whose attributes it copies, or just the type
    to derive from); ``attrs`` become its attributes.

    Example::

        >>> exc = wrap_error(ValueError("bad"), "Error on Node 1: bad", node=1)
        >>> isinstance(exc, RuntimeError), isinstance(exc, ValueError), exc.node
        (True, True, 1)
    """
    original = carried if isinstance(carried, BaseException) else None
    cls = _wrapped_type(type(carried) if original is not None else carried)
    try:
        exc = (cls.carried_type or WrappedError).__new__(cls, message)
        BaseException.__init__(exc, message)
    except Exception:
        exc = WrappedError(message)
    if original is not None:
        for key, value in getattr(original, "__dict__", {}).items():  # e.g. a failed rank
            exc.__dict__.setdefault(key, value)
    exc.__dict__.update(attrs)
    exc.original = original
    exc.__cause__ = original
    return exc


def _rebuild_wrapped(carried: BaseException | type[BaseException] | None, message: str,
                     state: dict) -> WrappedError:
    exc = wrap_error(carried, message)
    exc.__dict__.update(state)
    return exc


def node_error(exc: BaseException, node: int) -> BaseException:
    """What a distributed backward pass raises for ``exc``, met on rank ``node``: torch's
    ``RuntimeError("Error on Node {node}: {message}")`` (a :class:`WrappedError`, so also
    of ``exc``'s type, with ``exc`` as its cause and ``node`` as an attribute). An error
    already reported that way is returned as it is.

    Example::

        >>> str(node_error(ValueError("bad gradient"), 1))
        'Error on Node 1: bad gradient'
    """
    if isinstance(exc, WrappedError) and getattr(exc, "node", None) is not None:
        return exc
    return wrap_error(exc, f"Error on Node {node}: {exc}", node=node)


def operator_error(func: object, exc: BaseException) -> BaseException:
    """``exc`` as the caller should see it: a ``TypeError`` of a torch operator (``func``)
    called with arguments none of its schemas takes becomes torch's ``RuntimeError``
    wording ("Overloaded torch operator invoked from Python failed to match any schema"),
    a :class:`WrappedError` that is still a ``TypeError``; any other ``exc`` is returned.

    Example::

        >>> try:
        ...     torch.add()
        ... except TypeError as exc:
        ...     print(str(operator_error(torch.add, exc)).splitlines()[0])
        Overloaded torch operator invoked from Python failed to match any schema:
    """
    if type(exc) is not TypeError or func is None:
        return exc
    try:
        from torch.jit._builtins import _find_builtin

        name = _find_builtin(func)
    except Exception:
        return exc
    if name is None:
        return exc
    return wrap_error(exc, f"Overloaded torch operator invoked from Python failed to match "
                           f"any schema:\n{name}: {exc}")


def async_result_error(what: str, result: object) -> WrappedError:
    """The error of an ``@rpc.functions.async_execution`` function (``what``) that returned
    ``result``, not a ``torch.futures.Future``: torch's ``RuntimeError`` wording, a
    :class:`WrappedError` that is also a ``TypeError``.

    Example::

        >>> str(async_result_error("f", 3)).split(",")[0]
        'Functions decorated with @rpc.async_function must return a torch.futures.Future object'
    """
    return wrap_error(TypeError, f"Functions decorated with @rpc.async_function must return a "
                                 f"torch.futures.Future object, but got {type(result)}: {what} "
                                 f"is decorated with @rpc.functions.async_execution; return the "
                                 f"future of the work it starts (e.g. rpc.rpc_async(...) or "
                                 f"fut.then(...))")


def storable(exc: BaseException) -> Exception:
    """``exc`` as something a ``torch.futures.Future`` can hold (see
    :class:`RemoteBaseException`)."""
    return exc if isinstance(exc, Exception) else RemoteBaseException(exc)


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised on another rank.

    Set as ``__cause__`` of the re-raised exception, so a printed traceback shows the
    remote one first, headed by the worker that raised it.

    Example::

        >>> try:
        ...     rpc.rpc_sync("worker1", operator.truediv, args=(1, 0))
        ... except ZeroDivisionError as exc:   # the remote exception's own type
        ...     print(exc.__cause__.text.splitlines()[1])
        ### Remote traceback from worker1 (rank 1 of 2)
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def pack_exception(exc: BaseException, where: str) -> bytes:
    """Pickle ``exc`` with its traceback text for the caller; never raises.

    Example::

        >>> blob = pack_exception(ValueError("bad"), "worker1 (rank 1 of 2)")
        >>> type(unpack_exception(blob)).__name__
        'ValueError'
    """
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    header = f"\n### Remote traceback from {where}\n"
    try:
        blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # an exception whose __init__ signature breaks unpickling
    except Exception:
        blob = None
    return pickle.dumps(
        (blob, type(exc).__module__, type(exc).__qualname__, str(exc), header + text),
        protocol=pickle.HIGHEST_PROTOCOL,
    )


def unpack_exception(data: bytes) -> BaseException:
    """Rebuild an exception packed by :func:`pack_exception`, remote traceback as cause."""
    blob, module, qualname, message, text = pickle.loads(data)
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception as failure:  # torch's words when the type cannot be remade
            exc = RPCError(
                f"Failed to create original exception type. Error msg was {failure} "
                f"Original exception on remote side was {module}.{qualname}: {message} "
                f"(make the exception class importable here and constructible from its "
                f"arguments to get it with its type)")
    if exc is None:  # the callee could not pickle it with its arguments
        exc = RPCError(
            f"{module}.{qualname}: {message} (Failed to create original exception type: it "
            f"cannot be pickled with its arguments. Original exception on remote side was "
            f"{message})")
    if isinstance(exc, WrappedError) and exc.original is not None:
        exc.original.__cause__ = RemoteTraceback(text)  # the wrapper's cause stays its original
    else:
        exc.__cause__ = RemoteTraceback(text)
    return exc


def detached_copy(exc: BaseException) -> BaseException:
    """A copy of ``exc`` to raise, so that ``exc`` itself never gets a traceback.

    An exception stored in a ``torch.futures.Future`` (or kept in a table) that is raised
    gets a traceback whose frames often reference that future; the future holds the
    exception in C++, where Python's garbage collector cannot see the cycle, and
    everything those frames reference leaks. Raising a copy keeps the stored one clean.
    """
    try:
        fresh = copy.copy(exc)
    except Exception:
        return exc
    fresh.__cause__ = exc.__cause__
    fresh.__traceback__ = None
    return fresh


def frameless(exc: BaseException, where: str) -> BaseException:
    """A copy of ``exc`` to store for later: no frames, its traceback kept as text.

    Stored exceptions (a failed ``remote()``) must not hold frames: those reference the
    locals of every function on the stack at the time, RRefs included, for as long as the
    exception is kept.
    """
    fresh = detached_copy(exc)
    if not isinstance(exc.__cause__, RemoteTraceback):
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        fresh.__cause__ = RemoteTraceback(f"\n### Traceback from {where}\n{text}")
    return fresh


def future_error(fut) -> BaseException | None:
    """The exception a completed future holds (``None`` if it holds a value).

    ``fut.value()`` re-raises the stored exception, which then records the raising frames
    in its traceback, while the future (in C++) holds it: a cycle Python's garbage
    collector cannot see. The traceback is cleared before returning.
    """
    try:
        fut.value()
    except BaseException as exc:
        exc.__traceback__ = None
        return exc
    return None
