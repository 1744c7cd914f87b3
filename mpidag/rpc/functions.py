"""``mpidag.rpc.functions``: decorators for functions called over RPC (as in torch)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["async_execution"]


def async_execution(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as returning a ``torch.futures.Future``; the reply waits for it.

    The callee's thread is free as soon as ``fn`` returns its future; the reply is sent
    when that future completes (its value, or its exception with type).

    Example::

        >>> @rpc.functions.async_execution
        ... def async_add_chained(to, x, y, z):
        ...     return rpc.rpc_async(to, torch.add, args=(x, y)).then(
        ...         lambda fut: fut.wait() + z)
        >>> rpc.rpc_sync("worker1", async_add_chained, args=("worker0", torch.ones(2), 1, 1))
        tensor([3., 3.])
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper
