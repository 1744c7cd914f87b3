"""``RRef`` and ``remote()``, mirroring ``torch.distributed.rpc``.

The behaviour of a reference is in :class:`~mpidag.rref.handle.RRefHandle` and its
protocol in :mod:`mpidag.rref.protocol`; this module adds what needs the current session:
``RRef(value)`` and ``remote()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mpidag import _runtime
from mpidag._remote_profiling import legacy_profiling, take_profiled_future
from mpidag.agent.options import UNSET_RPC_TIMEOUT, WorkerInfo, check_timeout
from mpidag.rref.handle import RRefHandle

__all__ = ["RRef", "check_call", "remote"]


class RRef(RRefHandle):
    """A reference to a value that lives on one worker (its owner).

    ``RRef(value)`` wraps a local value: this worker is the owner. Remote references come
    from :func:`remote` or arrive as arguments and results of RPCs. The owner frees the
    value when no reference to it is left on any worker.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rref.owner_name(), rref.is_owner()
        ('worker1', False)
        >>> rref.to_here()
        tensor([2., 2.])
        >>> rpc.RRef(torch.zeros(2)).local_value()
        tensor([0., 0.])
    """

    __slots__ = ()

    def __init__(self, value: Any, type_hint: type | None = None) -> None:
        rrefs = _runtime.current().rrefs
        self._ctx = rrefs
        self._owner = rrefs.rank
        self._fork_id = None
        self._rref_id = rrefs.create_local_record(value)

    def _get_profiling_future(self) -> torch.futures.Future:
        """torch's: the future of the ``remote()`` call that made this reference, completed
        once its profiled range ended (under torch's legacy profiler); otherwise a
        completed future.

        Example::

            >>> with torch.autograd.profiler_legacy.profile() as prof:
            ...     rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
            ...     rref._get_profiling_future().wait()
        """
        future = _profiling_futures.get(self)
        if future is None:
            future = torch.futures.Future()
            future.set_result(None)
        return future


#: RRef -> the future of its profiled remote() call (see RRef._get_profiling_future)
_profiling_futures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_call(func: Callable, args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """The ``args`` and ``kwargs`` of a call as a tuple and a dict, checked on the caller:
    a ``TypeError`` naming the argument when ``func`` is not callable, ``args`` is not a
    tuple or list (or ``None``), or ``kwargs`` is not a mapping with str keys (or ``None``).
    torch sends such a call and reports the remote ``TypeError`` of ``func(*args,
    **kwargs)`` instead.

    Example::

        >>> check_call(torch.add, [torch.ones(2), 1], None)
        ((tensor([1., 1.]), 1), {})
        >>> check_call(torch.ones, 5, None)
        Traceback (most recent call last):
        TypeError: args must be a tuple (or list) of the positional arguments of ...
    """
    if not callable(func):
        raise TypeError(f"function should be callable, got {type(func).__name__}")
    if args.__class__ is not tuple:
        if args is None:
            args = ()
        elif isinstance(args, tuple | list):
            args = tuple(args)
        else:
            raise TypeError(
                f"args must be a tuple (or list) of the positional arguments of "
                f"{_name(func)}, got {type(args).__name__}: {_short(args)}; for one argument "
                f"write args=({_short(args)},)")
    if kwargs is None:
        kwargs = {}
    elif isinstance(kwargs, Mapping):
        kwargs = dict(kwargs)
        bad = [k for k in kwargs if not isinstance(k, str)]
        if bad:
            raise TypeError(f"kwargs of {_name(func)} must have str keys (argument names), "
                            f"got {_short(bad[0])}")
    else:
        raise TypeError(
            f"kwargs must be a dict of the keyword arguments of {_name(func)}, got "
            f"{type(kwargs).__name__}: {_short(kwargs)}; positional arguments go in "
            f"args=(...)")
    return args, kwargs


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or type(func).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def remote(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None,
           kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> RRef:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return an ``RRef`` to the result.

    Returns at once; the value is made on ``to`` in the background. An error raised by
    ``func`` surfaces on ``to_here()`` and on the proxies, with its type.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref.to_here()
        tensor([4., 4.])
    """
    runtime = _runtime.current()
    args, kwargs = check_call(func, args, kwargs)
    rref = runtime.rrefs.remote(runtime.to_rank(to), func, args, kwargs,
                                check_timeout(timeout))
    if legacy_profiling():  # the call was profiled: keep its future
        future = take_profiled_future()
        if future is not None:
            _profiling_futures[rref] = future
    return rref
