"""One lock per parameter tensor, taken in one global order (the optimizer's locks).

Kept by the runtime (one table per RPC session, made by ``init_rpc``); the
``DistributedOptimizer``'s local optimizers take them around each step, so two steps wait
for each other only when they share a parameter, and steps that share several parameters
cannot deadlock (every step takes its locks in the order the parameters were first seen).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable
from contextlib import ExitStack

import torch

__all__ = ["ParameterLocks"]


class ParameterLocks:
    """One lock per parameter tensor of this rank, and the global order to take them in.

    ``mode="global"`` uses one lock for everything (torch's way, kept for comparison;
    ``MPIDAG_OPTIM_LOCKS=global``).

    Example::

        >>> w, b = torch.zeros(2), torch.zeros(1)
        >>> locks = ParameterLocks()
        >>> locks.register([w, b])               # the order: w, then b
        >>> with locks.holding([b, w]):          # w and b locked, w first
        ...     w.add_(1)
        tensor([1., 1.])
        >>> len(locks)
        2
    """

    def __init__(self, mode: str = "parameter") -> None:
        if mode not in ("parameter", "global"):
            raise ValueError(f"lock mode must be 'parameter' or 'global', got {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[int, threading.Lock]] = {}
        self._order = itertools.count()
        self._global = threading.Lock()

    def _entry(self, param: torch.Tensor) -> tuple[int, threading.Lock]:
        key = id(param)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = (next(self._order), threading.Lock())
                weakref.finalize(param, self._forget, key, entry)
        return entry

    def _forget(self, key: int, entry: tuple[int, threading.Lock]) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]

    def register(self, params: Iterable[torch.Tensor]) -> None:
        """Give each parameter its place in the lock order (first come, first placed)."""
        for param in params:
            self._entry(param)

    def holding(self, params: Iterable[torch.Tensor]) -> ExitStack:
        """A context manager that holds the locks of ``params`` (in the global order)."""
        stack = ExitStack()
        if self.mode == "global":
            stack.enter_context(self._global)
            return stack
        entries = sorted({id(p): self._entry(p) for p in params}.values(), key=lambda e: e[0])
        try:
            for _, lock in entries:
                stack.enter_context(lock)
        except BaseException:
            stack.close()
            raise
        return stack

    def __len__(self) -> int:
        return len(self._entries)
