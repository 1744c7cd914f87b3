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
    "WorkerDiedError",
    "SerializationError",
    "pack_exception",
    "unpack_exception",
    "detached_copy",
    "frameless",
    "future_error",
]


class RPCError(RuntimeError):
    """Base class of mpidag's own errors."""


class RPCNotInitializedError(RPCError):
    """An RPC API was used before :func:`mpidag.rpc.init_rpc` or after ``shutdown``."""


class RPCTimeoutError(TimeoutError, RPCError):
    """A call did not complete within its timeout (a ``TimeoutError`` and a ``RuntimeError``)."""


class UnknownWorkerError(ValueError, RPCError):
    """A worker name, rank or ``WorkerInfo`` that is not part of this job."""


class WorkerDiedError(RPCError):
    """The peer rank of a call failed or shut down before answering."""


class SerializationError(TypeError, RPCError):
    """An argument or return value could not be pickled or unpickled."""


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised on another rank.

    Set as ``__cause__`` of the re-raised exception, so a printed traceback shows the
    remote one first, headed by the worker that raised it.
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
        except Exception:
            exc = None
    if exc is None:
        exc = RPCError(f"{module}.{qualname}: {message}")
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
