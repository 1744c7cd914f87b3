"""The RRef handle type: what users hold (the public ``mpidag.rpc.RRef`` derives from it).

A handle refers, on the owner, to the owner record (the value), on any other rank to a user
fork. Every method works through the :class:`~mpidag.rref.protocol.RRefContext` that made
the handle; handles are made by that context (``remote()``, ``RRef(value)``, unpickling an
RRef that arrived as an argument or result of an RPC), and the protocol keeps the value
alive exactly as long as some handle exists.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch

from mpidag.agent.options import UNSET_RPC_TIMEOUT, WorkerInfo, check_timeout
from mpidag.errors import (
    RPCError,
    RPCNotInitializedError,
    RPCTimeoutError,
    detached_copy,
    future_error,
)

if TYPE_CHECKING:
    from mpidag.rref.protocol import RRefContext

__all__ = ["RRefHandle"]


class RRefHandle:
    """A reference to a value that lives on one worker (its owner); the behaviour of
    ``mpidag.rpc.RRef``, made by an :class:`~mpidag.rref.protocol.RRefContext`.

    Example::

        >>> handle = runtime.rrefs.remote(1, torch.ones, (2,), {}, timeout=10)
        >>> handle.rpc_sync().size()        # runs value.size() on the owner
        torch.Size([2])
    """

    __slots__ = ("_rref_id", "_fork_id", "_owner", "_ctx", "_type_future", "_creation_future",
                 "__weakref__")

    _rref_id: int
    _fork_id: int | None
    _owner: int
    _ctx: RRefContext

    @classmethod
    def _handle(cls, ctx: RRefContext, rref_id: int, owner: int,
                fork_id: int | None) -> RRefHandle:
        obj = cls.__new__(cls)
        obj._ctx, obj._rref_id, obj._owner, obj._fork_id = ctx, rref_id, owner, fork_id
        return obj

    def __del__(self) -> None:
        # __del__ may run inside any allocation of any thread (a GC), even one holding a
        # lock of mpidag's: only queue the release; the progress leader carries it out
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.releases.append((self._rref_id, self._fork_id))

    def __class_getitem__(cls, item: Any) -> types.GenericAlias:
        """``RRef[T]`` in annotations, as torch's ``RRef`` (a ``Generic``)."""
        return types.GenericAlias(cls, item)

    def _gid(self, any_id: int) -> str:
        """An id in torch's form: ``GloballyUniqueId(created_on=0, local_id=3)``."""
        ids = self._ctx.ids
        return (f"GloballyUniqueId(created_on={ids.creator(any_id)}, "
                f"local_id={ids.local_counter(any_id) - 1})")  # torch counts from 0

    def __repr__(self) -> str:
        """torch's form: ``OwnerRRef(GloballyUniqueId(created_on=0, local_id=0))`` or
        ``UserRRef(RRefId = GloballyUniqueId(...), ForkId = GloballyUniqueId(...))``.

        Example::

            >>> rpc.RRef(1)                  # the first RRef of worker0
            OwnerRRef(GloballyUniqueId(created_on=0, local_id=0))
            >>> rpc.remote("worker1", torch.ones, args=(2,))
            UserRRef(RRefId = GloballyUniqueId(created_on=0, local_id=1),
                     ForkId = GloballyUniqueId(created_on=0, local_id=...))
        """
        if self._fork_id is None:
            return f"OwnerRRef({self._gid(self._rref_id)})"
        return f"UserRRef(RRefId = {self._gid(self._rref_id)}, ForkId = {self._gid(self._fork_id)})"

    def __reduce__(self) -> tuple:
        raise RPCError("Can not pickle rref in python pickler, rref can only be pickled when "
                       "using RPC: as an argument or return value of rpc_sync, rpc_async or "
                       "remote")

    def _live(self, operation: str = "use") -> RRefContext:
        ctx = self._ctx
        if not ctx.agent.running:
            raise RPCNotInitializedError(
                f"{self!r} has been deleted. Cannot call {operation} on it after deletion. "
                f"The RPC session that made it was shut down, and an RRef is usable only in "
                f"that session (call mpidag.rpc.init_rpc first for a new one)")
        return ctx

    # ---------------------------------------------------------------- queries
    def owner(self) -> WorkerInfo:
        """The ``WorkerInfo`` of the owner.

        Example::

            >>> rpc.remote("worker1", torch.ones, args=(2,)).owner()
            WorkerInfo(id=1, name=worker1)
        """
        return self._ctx.agent.workers[self._owner]

    def owner_name(self) -> str:
        """The worker name of the owner.

        Example::

            >>> rpc.remote("worker1", torch.ones, args=(2,)).owner_name()
            'worker1'
        """
        return self.owner().name

    def is_owner(self) -> bool:
        """Whether this worker owns the value.

        Example::

            >>> rpc.RRef(torch.ones(2)).is_owner()
            True
        """
        return self._fork_id is None

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always true on the owner). A user's
        reference made by ``remote()`` is confirmed by the owner's answer to that call, which
        may come after the answer to a ``to_here()`` (as in torch, whose tests wait for it).

        Example::

            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.to_here()
            tensor([1., 1.])
            >>> while not rref.confirmed_by_owner():   # the answer to remote() is on its way
            ...     time.sleep(0.001)
            >>> rpc.RRef(torch.zeros(1)).confirmed_by_owner()   # owned here
            True
        """
        if self._fork_id is None:
            return True
        rec = self._ctx.users.get(self._fork_id)
        return rec is not None and rec.confirmed

    # ------------------------------------------------------------------ value
    def local_value(self) -> Any:
        """The value itself; only on the owner (waits for a ``remote()`` still running).

        Example::

            >>> rpc.RRef(torch.zeros(3)).local_value()
            tensor([0., 0., 0.])
        """
        if self._fork_id is not None:
            raise RPCError(
                f"For UserRRef(rref_id={self._gid(self._rref_id)}, "
                f"fork_id={self._gid(self._fork_id)}), can't call localValue() on user "
                f"{self._ctx.agent.info}. Call it on owner {self.owner()}: local_value() "
                f"works only where the value lives; on a non-owner RRef call to_here() for a "
                f"copy, or rpc_sync().method(...) to run a method there."
            )
        return self._ctx.owner_value(self._rref_id)

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A copy of the value on this worker (the value itself on the owner).

        Raises the error of the function behind ``remote()`` if it failed. ``timeout`` as
        for :func:`mpidag.rpc.rpc_sync`.

        Example::

            >>> rpc.remote("worker1", torch.ones, args=(2,)).to_here()
            tensor([1., 1.])
        """
        timeout = check_timeout(timeout)
        ctx = self._live("to_here()")
        if self._fork_id is None:
            try:
                return self.local_value()
            except RPCTimeoutError as exc:  # remote() to this worker timed out
                raise _creation_timed_out(exc) from None
        rec = ctx.users.get(self._fork_id)
        if rec is not None and rec.creation_error is not None:
            error = rec.creation_error
            if isinstance(error, RPCTimeoutError):
                raise _creation_timed_out(error)
            raise detached_copy(error)
        return ctx.fetch(self, timeout)

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT,
                  blocking: bool = True) -> type | torch.futures.Future:
        """The type of the value (torch's private helper): asked of the owner once, then
        kept. ``blocking=False`` returns a ``torch.futures.Future`` of it (the same one on
        every call). A value still being made by ``remote()`` is waited for, up to
        ``timeout`` (as for :func:`mpidag.rpc.rpc_sync`).

        Example::

            >>> rpc.remote("worker1", torch.ones, args=(2,))._get_type()
            <class 'torch.Tensor'>
        """
        timeout = check_timeout(timeout)
        fut = getattr(self, "_type_future", None)
        if fut is None or (fut.done() and future_error(fut) is not None):  # (re)ask
            ctx = self._live("_get_type()")
            if self._fork_id is None:
                fut = torch.futures.Future()
                try:
                    fut.set_result(type(self.local_value()))
                except Exception as exc:
                    exc.__traceback__ = None  # no frames (of this handle) in the future
                    fut.set_exception(exc)
            else:
                fut = ctx.agent.call(self._owner, _rref_typeof_on_owner, (self,), {}, timeout)
            self._type_future = fut
        return fut.wait() if blocking else fut

    def _get_future(self) -> torch.futures.Future:
        """The future of the ``remote()`` call that made this reference (torch's private
        helper): done when the owner has the value; its error is the call's (a timeout
        included). A reference not made by ``remote()`` gets a completed future.

        Example::

            >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
            >>> rref._get_future().wait()
        """
        future = getattr(self, "_creation_future", None)
        if future is None:
            future = torch.futures.Future()
            future.set_result(None)
        return future

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run a backward pass with the value (a scalar tensor) as the root, on the owner.

        With ``dist_autograd_ctx_id`` it is a distributed backward pass in that context
        (read the gradients with ``mpidag.autograd.get_gradients``); with -1 (the default)
        a plain local ``value.backward()``, which only the owner may call.

        Example::

            >>> x = torch.ones(2, requires_grad=True)
            >>> with dist_autograd.context() as context_id:
            ...     rref = rpc.remote("worker1", torch.sum, args=(x,))
            ...     rref.backward(context_id)         # runs on worker1, reaches x here
            ...     dist_autograd.get_gradients(context_id)[x]
            tensor([1., 1.])
        """
        ctx = self._live("backward()")
        if dist_autograd_ctx_id is None:
            dist_autograd_ctx_id = -1
        if self._fork_id is not None and dist_autograd_ctx_id == -1:
            raise RuntimeError(
                f"User RRefs require 'dist_autograd_ctx_id' to be specified: RRef.backward() "
                f"without one runs a local backward pass, which only the owner "
                f"({self.owner_name()}) can do; pass the context id of "
                f"`with mpidag.autograd.context() as context_id` for a distributed one")
        ctx.backward(self, dist_autograd_ctx_id, retain_graph)

    # ---------------------------------------------------------------- proxies
    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        """Proxy: ``rref.rpc_sync().m(*a)`` runs ``value.m(*a)`` on the owner, waits.

        Example::

            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.rpc_sync().size()
            torch.Size([2])
        """
        return _Proxy(self, "rpc_sync", check_timeout(timeout))

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        """Proxy: ``rref.rpc_async().m(*a)`` returns a future of ``value.m(*a)``.

        Example::

            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.rpc_async().size().wait()
            torch.Size([2])
        """
        return _Proxy(self, "rpc_async", check_timeout(timeout))

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        """Proxy: ``rref.remote().m(*a)`` returns an RRef to ``value.m(*a)`` on the owner.

        Example::

            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.remote().size().to_here()
            torch.Size([2])
        """
        return _Proxy(self, "remote", check_timeout(timeout))


class _Proxy:
    """``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()``: methods run on the owner."""

    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRefHandle, mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Any:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def method(*args: Any, **kwargs: Any) -> Any:
            return rref._live(f"{mode}().{name}()").invoke(rref, mode, name, args, kwargs,
                                                           timeout)

        method.__name__ = name
        return method


def _rref_typeof_on_owner(rref: RRefHandle) -> type:
    """On the owner: the type of the value (``RRef._get_type``)."""
    return type(rref.local_value())


def _creation_timed_out(error: BaseException) -> RPCTimeoutError:
    """torch's error of ``to_here()`` after the ``remote()`` that makes the value timed
    out; the timeout is its cause."""
    exc = RPCTimeoutError(
        f"RRef creation via rpc.remote() timed out, and it is possible that the RRef on the "
        f"owner node does not exist: {error}")
    exc.__cause__ = error
    return exc
