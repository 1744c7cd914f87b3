"""The RRef handle type: what users hold (the public ``mpidag.rpc.RRef`` derives from it).

A handle refers, on the owner, to the owner record (the value), on any other rank to a user
fork. Every method works through the :class:`~mpidag.rref.protocol.RRefContext` that made
the handle; handles are made by that context (``remote()``, ``RRef(value)``, unpickling an
RRef that arrived as an argument or result of an RPC), and the protocol keeps the value
alive exactly as long as some handle exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpidag.agent.options import UNSET_RPC_TIMEOUT, WorkerInfo
from mpidag.errors import RPCError, RPCNotInitializedError, detached_copy

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

    __slots__ = ("_rref_id", "_fork_id", "_owner", "_ctx", "__weakref__")

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

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(rref_id=0x{self._rref_id:x}, owner={self.owner_name()})"

    def __reduce__(self) -> tuple:
        raise RPCError("an RRef can only be pickled as an argument or return value of an RPC "
                       "(rpc_sync, rpc_async, remote)")

    def _live(self) -> RRefContext:
        ctx = self._ctx
        if not ctx.agent.running:
            raise RPCNotInitializedError(
                f"the RPC session of {self!r} was shut down; an RRef is usable only in the "
                f"session that made it (call mpidag.rpc.init_rpc first for a new one)")
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
        """Whether the owner knows of this reference (always true on the owner).

        Example::

            >>> rref = rpc.remote("worker1", torch.ones, args=(2,))
            >>> rref.to_here(); rref.confirmed_by_owner()
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
                f"RRef.local_value() called on a non-owner: this is "
                f"{self._ctx.agent.info.name}, the value lives on {self.owner_name()}. Call "
                f"to_here() for a copy, or rpc_sync().method(...) to run a method there."
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
        ctx = self._live()
        if self._fork_id is None:
            return self.local_value()
        rec = ctx.users.get(self._fork_id)
        if rec is not None and rec.creation_error is not None:
            raise detached_copy(rec.creation_error)
        return ctx.fetch(self, timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run a backward pass with the value (a scalar tensor) as the root, on the owner.

        With ``dist_autograd_ctx_id`` it is a distributed backward pass in that context
        (read the gradients with ``mpidag.autograd.get_gradients``); with -1 (the default)
        a plain local ``value.backward()``, which only the owner may call.

        Example::

            >>> with dist_autograd.context() as context_id:
            ...     rref = rpc.remote("worker1", torch.sum, args=(x,))   # x requires grad
            ...     rref.backward(context_id)
        """
        ctx = self._live()
        if dist_autograd_ctx_id is None:
            dist_autograd_ctx_id = -1
        if self._fork_id is not None and dist_autograd_ctx_id == -1:
            raise RuntimeError(
                f"RRef.backward() without a dist_autograd_ctx_id runs a local backward pass, "
                f"which only the owner ({self.owner_name()}) can do; pass the context id of "
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
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        """Proxy: ``rref.rpc_async().m(*a)`` returns a future of ``value.m(*a)``.

        Example::

            >>> rref.rpc_async().size().wait()
            torch.Size([2])
        """
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> _Proxy:
        """Proxy: ``rref.remote().m(*a)`` returns an RRef to ``value.m(*a)`` on the owner.

        Example::

            >>> rref.remote().size().to_here()
            torch.Size([2])
        """
        return _Proxy(self, "remote", timeout)


class _Proxy:
    """``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()``: methods run on the owner."""

    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRefHandle, mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Any:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def method(*args: Any, **kwargs: Any) -> Any:
            return rref._live().invoke(rref, mode, name, args, kwargs, timeout)

        method.__name__ = name
        return method
