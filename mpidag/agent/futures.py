"""The future of an RPC: a ``torch.futures.Future`` whose ``wait()`` drives progress."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mpidag.errors import RemoteBaseException, detached_copy

if TYPE_CHECKING:
    from mpidag.transport.progress import ProgressEngine

__all__ = ["RpcFuture"]


#: ``torch.futures.Future.__init__`` without devices, called directly (0.3 us a future less)
_init_future = torch._C.Future.__init__
_NO_DEVICES: list[torch.device] = []


class RpcFuture(torch.futures.Future):
    """A ``torch.futures.Future`` whose ``wait()`` drives the MPI progress itself.

    ``engine``: the progress engine a waiting thread leads until the future is done
    (``None``: plain ``torch.futures.Future`` waiting, for futures completed locally). Its
    errors are raised as copies (:func:`mpidag.errors.detached_copy`), so the stored
    exception never references the frames that wait for it. A future given a callback
    with ``then`` or ``add_done_callback`` is completed off the leader (see
    :meth:`mpidag.agent.calls.OutgoingCalls.complete`): a callback may wait for another RPC.

    Example::

        >>> fut = RpcFuture()              # completed here, so no engine to drive
        >>> fut.set_result(3)
        >>> fut.wait()
        3
    """

    #: the engine in a slot, not the instance's ``__dict__``: no dict made per future (0.1 us
    #: and a collected object less a call)
    __slots__ = ("engine",)

    #: a callback of the user's was added: complete this future on a pool thread
    user_callbacks = False

    def __init__(self, engine: ProgressEngine | None = None) -> None:
        # the compiled call path makes its futures the same way, without this frame
        # (new_future in mpidag/agent/fastpath.c): change both together
        _init_future(self, _NO_DEVICES)  # torch.futures.Future() less its devices' frame
        self.engine = engine

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        # torch.futures.Future.then; the callback may block (waits, RPCs)
        self.user_callbacks = True
        return super().then(callback)

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        # torch.futures.Future.add_done_callback; the callback may block
        self.user_callbacks = True
        super().add_done_callback(callback)

    def add_internal_callback(self, callback: Callable[[torch.futures.Future], None]
                              ) -> None:
        """``add_done_callback`` for mpidag's own short callbacks that never block: they
        run on the thread that completes the future, the progress leader included.

        Example::

            >>> fut, seen = RpcFuture(), []
            >>> fut.add_internal_callback(lambda f: seen.append(f.value()))
            >>> fut.set_result(7)
            >>> seen
            [7]
        """
        super().add_done_callback(callback)

    def wait(self) -> Any:  # noqa: D102 - same contract as torch.futures.Future.wait
        if not self.done():
            engine = self.engine
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
