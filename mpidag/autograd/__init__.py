"""``mpidag.autograd``: ``torch.distributed.autograd`` on MPI (FAST engine, SMART mode).

Port a program by changing its imports::

    import mpidag.autograd as dist_autograd   # was: torch.distributed.autograd
    import mpidag.rpc as rpc                  # was: torch.distributed.rpc

    with dist_autograd.context() as context_id:
        t3 = rpc.rpc_sync("worker1", my_add, args=(t1, t2))
        loss = (t3 * t4).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # {t1: ..., t2: ..., t4: ...}

Every RPC made inside the ``with`` block (``rpc_sync``, ``rpc_async``, ``remote``,
``to_here``, RRef proxies, and calls nested in the remote functions) records a send
function on the sender and a recv function on the receiver for its tensors that require
grad. ``backward`` runs the FAST mode algorithm of PyTorch's design, completed by SMART mode
(the default, ``mode="smart"``): RPC results that the loss leaves unused get "no gradient"
instead of an error. See :mod:`mpidag.dist_autograd.engine` and the design overview of the
documentation (``docs/``).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from mpidag import _runtime
from mpidag.dist_autograd import (
    ContextContainer,
    DistAutogradContext,
    UnusedRPCGradientError,
    UnusedRPCWarning,
)

__all__ = [
    "DistAutogradContext",
    "UnusedRPCGradientError",
    "UnusedRPCWarning",
    "backward",
    "context",
    "get_gradients",
    "is_available",
]


def _container() -> ContextContainer:
    return _runtime.current().autograd.container


def is_available() -> bool:
    """Whether distributed autograd can be used (as ``torch.distributed.autograd``).

    Example::

        >>> import mpidag.autograd as dist_autograd
        >>> dist_autograd.is_available()
        True
    """
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


class context:  # noqa: N801 - torch's name
    """A distributed autograd context; ``with context() as context_id:``.

    The forward pass of a distributed backward must run inside it. Leaving the block
    releases the context on this rank and on every rank it exchanged RPCs with (also when
    the block ends with an exception). Contexts do not nest within one thread.

    Example::

        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> x = torch.tensor([3.0, 4.0])
        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", torch.mul, args=(w, x)).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     dist_autograd.get_gradients(context_id)[w]
        tensor([3., 4.])
    """

    def __init__(self) -> None:
        self._ctx: DistAutogradContext | None = None
        self._previous: Any = None

    def __enter__(self) -> int:
        container = _container()
        if container.current() is not None:
            raise RuntimeError(
                "Already have an autograd context id for this thread: distributed autograd "
                "contexts do not nest; use the context_id of the enclosing `with` block")
        ctx = container.new_context()
        self._ctx = ctx
        self._previous = container.enter(ctx)
        return ctx.context_id

    def __exit__(self, exc_type: type | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        ctx.container.leave(self._previous)
        ctx.container.release(ctx)


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False, *,
             mode: str = "smart") -> None:
    """Run the distributed backward pass from ``roots`` (scalar tensors on this rank).

    Gradients of the leaves on every rank accumulate in that rank's share of the context
    (read them with :func:`get_gradients`), never in ``.grad``. Returns when the pass is
    done on every rank; raises the first error any rank met as torch does, a
    ``RuntimeError("Error on Node {rank}: {message}")`` (an
    :class:`~mpidag.errors.WrappedError`, also of the original's type, which is its
    ``__cause__`` with the remote traceback). ``retain_graph=True`` keeps the graph for
    another backward in the same context, whose gradients add to these.

    ``mode="smart"`` (the default) gives exactly the gradients of the same computation done
    locally, for any graph recorded in the context, also when the loss does not use some
    RPC results; it costs nothing when every RPC is used. ``mode="fast"`` is PyTorch's
    FAST mode rule, strict: every RPC of the context must take part in the pass, and
    :class:`UnusedRPCGradientError` names those that did not when other gradients depend
    on them (PyTorch returns those gradients silently missing), :class:`UnusedRPCWarning`
    when nothing does.

    Example::

        >>> t1 = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> t2 = torch.tensor([3.0, 4.0], requires_grad=True)
        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        ...     unused = rpc.rpc_sync("worker1", torch.mul, args=(t1, t2))
        ...     dist_autograd.backward(context_id, [loss])      # exact, unused or not
        ...     grads = dist_autograd.get_gradients(context_id)
        >>> grads[t1], grads[t2]
        (tensor([1., 1.]), tensor([1., 1.]))
    """
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise TypeError(f"backward(): incompatible function arguments: context_id must be "
                        f"the int of a `with mpidag.autograd.context() as context_id:`, got "
                        f"{type(context_id).__name__}")
    _runtime.current().autograd.backward(context_id, roots, bool(retain_graph), mode)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This rank's gradients in the context: ``{leaf tensor: gradient}``.

    Example::

        >>> x = torch.ones(2, requires_grad=True)
        >>> with dist_autograd.context() as context_id:
        ...     y = rpc.rpc_sync("worker1", torch.mul, args=(x, 3.0)).sum()
        ...     dist_autograd.backward(context_id, [y])
        ...     dist_autograd.get_gradients(context_id)
        {tensor([1., 1.], requires_grad=True): tensor([3., 3.])}
    """
    return _container().retrieve(context_id).gradients.snapshot()


def _current_context() -> DistAutogradContext:
    """The context of this thread (torch's private helper of the same name)."""
    ctx = _container().current()
    if ctx is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context. Please "
                           "wrap your code using: `with mpidag.autograd.context() as "
                           "context_id` to generate a valid context")
    return ctx


def _retrieve_context(context_id: int) -> DistAutogradContext:
    """The context with this id on this rank (raises if there is none)."""
    return _container().retrieve(context_id)


def _is_valid_context(context_id: int) -> bool:
    """Whether this rank has a context with this id."""
    return context_id in _container().contexts


def _get_max_id() -> int:
    """The largest id this worker can give a context (torch's private helper): its rank
    in the high bits (16 or more, as the world needs), the counter's maximum below.

    Example::

        >>> dist_autograd._get_max_id() >> 48      # on worker0 of a job of 2: its rank
        0
        >>> rpc.rpc_sync("worker1", dist_autograd._get_max_id) >> 48
        1
        >>> dist_autograd._get_max_id() & 0xFFFF_FFFF_FFFF == (1 << 48) - 1
        True
    """
    ids = _runtime.current().agent.ids
    return (ids.rank << ids.counter_bits) | ((1 << ids.counter_bits) - 1)


def _get_debug_info() -> dict[str, str]:
    """torch's counters of this rank's distributed autograd, as strings:
    ``num_current_backward_passes`` and ``num_autograd_contexts``.

    Example::

        >>> dist_autograd._get_debug_info()
        {'num_current_backward_passes': '0', 'num_autograd_contexts': '0'}
    """
    return _container().torch_debug_info()
