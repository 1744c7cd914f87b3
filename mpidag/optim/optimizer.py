"""``DistributedOptimizer``: one local optimizer per owner rank, stepped over RPC.

Data flow of ``DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05).step(context_id)``::

    caller:  group the parameter RRefs by owner -> at construction, one call per owner makes a
             _LocalOptimizer there (kept through an RRef); step() calls every owner at once
    owner:   take the locks of the optimizer's parameters (one lock per parameter, taken in
             one global order) -> set .grad from the context's gradients -> optimizer.step()
             -> clear .grad -> release

PyTorch's Python local optimizer serializes every step on a worker behind one global lock
(its path for the optimizers that have a functional version, TorchScript up to torch 2.13
and plain Python from 2.14, takes no lock at all; so two steps sharing a parameter may
interleave there). mpidag runs every optimizer class the same way, on torch's own
``torch.optim`` classes, so it neither needs nor prints torch's warnings about that path.
Here two steps wait for each other only when they share a parameter; steps over
disjoint parameters of the same owner run at the same time. Locks are always taken in the
order the parameters were first seen on that rank, so two steps that share several
parameters cannot deadlock, and the instance lock of a local optimizer (its state:
momentum, Adam moments) is taken before any parameter lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable
from contextlib import suppress
from typing import Any

import torch

from mpidag import _runtime
from mpidag._locks import ParameterLocks
from mpidag._profiling import span
from mpidag.autograd import _retrieve_context, get_gradients
from mpidag.errors import detached_copy, future_error
from mpidag.rpc.api import rpc_async
from mpidag.rpc.rref import RRef

__all__ = ["DistributedOptimizer", "ParameterLocks"]

log = logging.getLogger(__name__)


class _LocalOptimizer:
    """Lives on an owner rank: a torch optimizer over that rank's parameters."""

    def __init__(self, optimizer_class: type, groups: list[dict[str, Any]], args: tuple,
                 kwargs: dict) -> None:
        local_groups = []
        self.params: list[torch.Tensor] = []
        for group in groups:
            values = []
            for i, rref in enumerate(group["params"]):
                value = rref.local_value()
                _check_parameter(value, f"params_rref{group['where'][i]}")
                values.append(value)
            self.params.extend(values)
            local_groups.append({**{k: v for k, v in group.items()
                                    if k not in ("params", "where")}, "params": values})
        runtime = _runtime.current()
        #: this session's lock table (parameters are objects of this process)
        self.locks = runtime.parameter_locks
        self.locks.register(self.params)
        self.optimizer = optimizer_class(local_groups, *args, **kwargs)
        self.lock = threading.Lock()  # this optimizer's own state
        #: (start, end) monotonic times of the locked part of recent steps (for tests)
        self.step_times: list[tuple[float, float]] = []

    def step(self, context_id: int) -> int:
        contexts = _runtime.current().autograd.container.contexts
        grads = get_gradients(context_id) if context_id in contexts else {}
        mine = [(p, grads.get(p)) for p in self.params]
        for index, (param, grad) in enumerate(mine):  # check all before changing anything
            if grad is not None and (grad.shape != param.shape or grad.dtype != param.dtype
                                     or grad.device != param.device):
                raise RuntimeError(
                    f"gradient {index} in context {context_id} has shape {tuple(grad.shape)}, "
                    f"{grad.dtype} on {grad.device}, but its parameter has "
                    f"{tuple(param.shape)}, {param.dtype} on {param.device}")
        with span(lambda: "mpidag.optim.step"), self.lock, \
                self.locks.holding(self.params):
            start = time.monotonic()
            for param, grad in mine:
                param.grad = grad  # None: skipped by the optimizer, as in torch
            try:
                self.optimizer.step()
            finally:
                for param in self.params:
                    param.grad = None
            self.step_times.append((start, time.monotonic()))
            del self.step_times[:-1000]
        return sum(g is not None for _, g in mine)


def _check_parameter(value: Any, where: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} refers to a {type(value).__name__}, not a tensor: "
                        f"DistributedOptimizer needs RRefs of parameters (e.g. "
                        f"[RRef(p) for p in model.parameters()])")
    # a tensor that does not require grad is accepted, as torch does: it never gets a
    # gradient in a context, so its optimizer skips it (its .grad stays None)
    if not value.is_leaf:
        raise ValueError(f"{where} refers to a non-leaf tensor (computed from others): "
                         f"optimizers can only update leaf tensors such as nn.Parameters")


#: on an owner: the key of each local optimizer -> it, weakly (the value of its RRef keeps it
#: alive: once the ``DistributedOptimizer`` that holds the RRef is gone, so is the entry)
_local_optimizers: weakref.WeakValueDictionary[int, _LocalOptimizer] = \
    weakref.WeakValueDictionary()
_local_keys = itertools.count(1)


def _new_local_optimizer(optimizer_class: type, groups: list[dict[str, Any]], args: tuple,
                         kwargs: dict) -> tuple[Any, int]:
    """On an owner: a local optimizer; returns its RRef (which keeps it) and its key (what
    each step names it by)."""
    local = _LocalOptimizer(optimizer_class, groups, args, kwargs)
    key = next(_local_keys)
    _local_optimizers[key] = local
    return RRef(local), key


def _local_step(key: int, context_id: int) -> int:
    """On an owner: step the local optimizer ``key``. Its caller holds the optimizer's RRef,
    so the optimizer lives; two plain integers make the call a plain one, which the
    compiled path sends and serves (an RRef argument would take Python's pickler on both
    ends and a fork message back)."""
    local = _local_optimizers.get(key)
    if local is None:
        raise RuntimeError(
            f"DistributedOptimizer: its local optimizer {key} no longer exists on "
            f"{_runtime.current().agent.where()}: the RPC session that made it was shut "
            f"down; make a new DistributedOptimizer after init_rpc")
    return local.step(context_id)


class DistributedOptimizer:
    """torch's ``DistributedOptimizer`` on MPI: one local optimizer per owner of parameters.

    Args:
        optimizer_class: any ``torch.optim.Optimizer`` subclass, made on every owner.
        params_rref: RRefs of the parameters to optimize (local ones wrapped in ``RRef``);
            like torch's param groups, dicts ``{"params": [rrefs...], "lr": ...}`` give
            options per group of parameters.
        *args: passed to ``optimizer_class`` on every owner.
        **kwargs: passed to ``optimizer_class`` on every owner (``lr=0.05``, ...).

    ``step(context_id)`` applies, on every owner at once, the gradients that the
    distributed backward pass of that context left there. A parameter with no gradient in
    the context is skipped, as torch's optimizers skip parameters whose ``.grad`` is
    ``None`` (torch's Python local optimizer would re-apply a stale ``.grad`` left from an
    earlier step; here ``.grad`` is set only for the step and cleared after it).

    Example::

        >>> def parameter():
        ...     return torch.tensor([1.0, 2.0], requires_grad=True)
        >>> with dist_autograd.context() as context_id:
        ...     rref1 = rpc.remote("worker1", parameter)
        ...     rref2 = rpc.remote("worker1", parameter)
        ...     loss = rref1.to_here() + rref2.to_here()
        ...     dist_autograd.backward(context_id, [loss.sum()])
        ...     dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05)
        ...     dist_optim.step(context_id)
        >>> rref1.to_here()                     # stepped on worker1: minus 0.05 * 1
        tensor([0.9500, 1.9500], requires_grad=True)
    """

    def __init__(self, optimizer_class: type, params_rref: list, *args: Any,
                 **kwargs: Any) -> None:
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                            f"{optimizer_class!r}")
        if isinstance(params_rref, (RRef, dict)) or not isinstance(params_rref, Iterable):
            raise TypeError("params_rref must be a list of RRefs (or of param-group dicts)")
        params_rref = list(params_rref)
        if not params_rref:
            raise ValueError("DistributedOptimizer got an empty params_rref: pass the RRefs of "
                             "the parameters to optimize")
        per_owner: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for g, entry in enumerate(params_rref):
            if isinstance(entry, dict):
                if "params" not in entry:
                    raise ValueError(f"params_rref[{g}] is a param group without 'params'")
                rrefs = list(entry["params"])
                options = {k: v for k, v in entry.items() if k != "params"}
                where = [f"[{g}]['params'][{i}]" for i in range(len(rrefs))]
            else:
                rrefs, options, where = [entry], {}, [f"[{g}]"]
            groups: dict[Any, dict[str, Any]] = {}
            for rref, place in zip(rrefs, where, strict=True):
                if not isinstance(rref, RRef):
                    raise TypeError(f"params_rref{place} is a {type(rref).__name__}, not an "
                                    f"RRef: wrap local parameters with rpc.RRef(param)")
                owner = rref.owner()
                group = groups.get(owner)
                if group is None:
                    group = groups[owner] = {**options, "params": [], "where": []}
                    per_owner[owner].append(group)
                group["params"].append(rref)
                group["where"].append(place)
        self._owners = list(per_owner)
        futures = [rpc_async(owner, _new_local_optimizer,
                             args=(optimizer_class, per_owner[owner], args, kwargs))
                   for owner in self._owners]
        made = _wait_for_all(futures, self._owners, "create the optimizer")
        #: torch's attribute: the RRef of each owner's local optimizer
        self.remote_optimizers = [rref for rref, _ in made]
        self._local_keys = [key for _, key in made]  # what step() names them by

    def step(self, context_id: int) -> None:
        """Apply the gradients of ``context_id`` on every owner, concurrently.

        Raises the first owner's error with its type; the message says on which owners the
        step was applied and on which it was not.

        Example::

            >>> w = rpc.remote("worker1", torch.ones, args=(2,), kwargs={"requires_grad": True})
            >>> dist_optim = DistributedOptimizer(optim.SGD, [w], lr=0.1)
            >>> with dist_autograd.context() as context_id:
            ...     loss = (w.to_here() * 3).sum()          # w lives on worker1
            ...     dist_autograd.backward(context_id, [loss])
            ...     dist_optim.step(context_id)             # every owner steps at once
            >>> w.to_here()
            tensor([0.7000, 0.7000], requires_grad=True)
        """
        _retrieve_context(context_id)  # a clear error for an unknown id
        futures = [rpc_async(owner.id, _local_step, args=(key, context_id))
                   for owner, key in zip(self._owners, self._local_keys, strict=True)]
        _wait_for_all(futures, self._owners, "step")


def _wait_for_all(futures: list, owners: list, what: str) -> list:
    results, failed, done = [], [], []
    for fut, owner in zip(futures, owners, strict=True):
        with suppress(Exception):  # read below, as a value or as the stored error
            fut.wait()
        error = future_error(fut)
        if error is None:
            results.append(fut.value())
            done.append(owner.name)
        else:
            failed.append((owner.name, error))
    if failed:
        name, first = failed[0]
        error = detached_copy(first)
        summary = (f"DistributedOptimizer could not {what} on {', '.join(n for n, _ in failed)}"
                   f"; it did on {', '.join(done) or 'no owner'}")
        if hasattr(error, "add_note"):
            error.__notes__ = [*getattr(error, "__notes__", []), summary]
        else:  # Python 3.10
            log.error(summary)
        raise error
    return results
