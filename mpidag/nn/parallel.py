"""``DistributedDataParallel`` that also averages gradients in mpidag's distributed backward.

torch's ``DistributedDataParallel`` averages gradients from hooks that run after each
parameter's ``AccumulateGrad`` node. mpidag's distributed backward (like torch's FAST mode)
puts a leaf's gradient into the distributed autograd context instead of ``.grad``; its
native-engine calls capture the gradient at the leaf's edge, so ``AccumulateGrad`` and DDP's
hooks never run: with torch's class the trainers' gradients would silently stay un-averaged.

This subclass is torch's class (construction, the broadcast of parameters and buffers, every
forward and backward outside a distributed autograd context are untouched). A forward inside
an ``mpidag.autograd.context()`` runs the module with its parameters passed through one
identity function whose backward all-reduces their gradients over the process group (one
flat all-reduce per dtype, divided by the group's size, as DDP does) before they reach the
context; DDP's own reducer is bypassed for that forward (``no_sync``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from mpidag import _runtime

__all__ = ["DistributedDataParallel"]


class _AverageGradients(torch.autograd.Function):
    """Identity on the parameters; backward: their gradients averaged over ``group``."""

    @staticmethod
    def forward(ctx: Any, group: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        group = ctx.group
        out: list[torch.Tensor | None] = [None] * len(grads)
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, grad in enumerate(grads):  # undefined gradients arrive as zeros
            by_kind.setdefault((grad.dtype, grad.device), []).append(i)
        size = dist.get_world_size(group)
        for indices in by_kind.values():  # same order on every member: parameter order
            flat = torch.cat([grads[i].reshape(-1) for i in indices])
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            for i, part in zip(indices, flat.split([grads[i].numel() for i in indices]),
                               strict=True):
                out[i] = part.view_as(grads[i])
        return (None, *out)


class DistributedDataParallel(_TorchDDP):
    """torch's ``DistributedDataParallel``, usable inside mpidag's distributed autograd.

    Same arguments as ``torch.nn.parallel.DistributedDataParallel``. Outside a distributed
    autograd context it *is* torch's DDP. Inside ``with mpidag.autograd.context()``, the
    gradients of the wrapped module's parameters that ``mpidag.autograd.backward`` leaves in
    the context are averaged over ``process_group`` (torch's DDP would leave each
    trainer's own gradients there, since its reducer never sees mpidag's backward pass).
    Every member must run the same forwards and backwards (one all-reduce per backward and
    parameter dtype); inside ``no_sync()`` nothing is averaged, as in torch. Only the
    all-reduce-and-average behaviour is provided inside a context: communication hooks,
    ``static_graph`` and ``find_unused_parameters`` do not apply there (a parameter the loss
    does not use contributes a zero gradient).

    Example::

        >>> from mpidag.nn.parallel import DistributedDataParallel as DDP
        >>> pg = rpc.init_process_group(ranks=[0, 1])        # on the trainers
        >>> dense = DDP(torch.nn.Linear(16, 8), process_group=pg)
        >>> with dist_autograd.context() as context_id:
        ...     loss = dense(emb(indices, offsets)).sum()
        ...     dist_autograd.backward(context_id, [loss])   # dense grads averaged
        ...     opt.step(context_id)
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        self._mpidag_inner = threading.local()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """DDP's forward; inside a distributed autograd context, with averaged gradients.

        Example::

            >>> with dist_autograd.context() as context_id:
            ...     out = ddp_model(batch)
        """
        if getattr(self._mpidag_inner, "active", False) or not self._in_distributed_context():
            return super().forward(*inputs, **kwargs)
        named = [(f"module.{name}", p) for name, p in self.module.named_parameters()
                 if p.requires_grad]
        if not named:
            return super().forward(*inputs, **kwargs)
        averaged = _AverageGradients.apply(self.process_group, *(p for _, p in named))
        swapped = {name: a for (name, _), a in zip(named, averaged, strict=True)}
        self._mpidag_inner.active = True
        try:
            with self.no_sync():  # DDP's reducer would wait for hooks that never run
                return torch.func.functional_call(self, swapped, inputs, kwargs)
        finally:
            self._mpidag_inner.active = False

    def _in_distributed_context(self) -> bool:
        runtime = _runtime.current_or_none()
        return (runtime is not None and torch.is_grad_enabled()
                and self.require_backward_grad_sync
                and runtime.autograd.container.current() is not None)
