"""``DistributedDataParallel`` that also averages gradients in mpidag's distributed backward.

torch's ``DistributedDataParallel`` averages gradients from hooks that run after each
parameter's ``AccumulateGrad`` node. mpidag's distributed backward (like torch's FAST mode)
puts a leaf's gradient into the distributed autograd context instead of ``.grad``; its
native-engine calls capture the gradient at the leaf's edge, so ``AccumulateGrad`` and DDP's
hooks never run. mpidag's engine therefore averages the parameters of torch's own class
itself (through the reducer's buckets and communication hook, see
``mpidag.dist_autograd.engine.average_ddp_gradients``), so torch's class works unchanged;
options it cannot serve that way (``static_graph``, mixed precision, ``join()``) are a clear
error there, and this subclass is the alternative.

This subclass is torch's class (construction, the broadcast of parameters and buffers, every
forward and backward outside a distributed autograd context are untouched). A forward inside
an ``mpidag.autograd.context()`` runs the module with its parameters passed through one
identity function whose backward all-reduces their gradients over the process group (one
flat all-reduce per dtype, divided by the group's size, as DDP does) before they reach the
context; DDP's own reducer is bypassed for that forward (``no_sync``). The parameters of
``nn.Embedding``/``nn.EmbeddingBag`` modules made with ``sparse=True`` (DDP's own rule for
expecting a sparse gradient) get sparse gradients: each is all-reduced as a sparse tensor
of its own (gloo sums the members' indices and values) and averaged, and stays sparse.
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
    """Identity on the parameters; backward: their gradients averaged over ``group``
    (``sparse[i]``: parameter ``i`` gets a sparse gradient, all-reduced on its own)."""

    @staticmethod
    def forward(ctx: Any, group: Any, sparse: tuple[bool, ...], *params: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.sparse = sparse
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        group = ctx.group
        out: list[torch.Tensor | None] = [None] * len(grads)
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        size = dist.get_world_size(group)
        dense: list[torch.Tensor] = list(grads)
        for i, grad in enumerate(grads):  # undefined gradients arrive as zeros
            if ctx.sparse[i]:  # every member, in parameter order (an unused one: empty)
                # an embedding's gradient has its rows sparse (sparse_dim 1), on every member
                sparse = grad if grad.is_sparse else grad.to_sparse(1)
                dist.all_reduce(sparse, group=group)  # gloo: a coalesced sparse sum
                out[i] = sparse.div_(size)
                continue
            if grad.is_sparse:
                dense[i] = grad.to_dense()
            by_kind.setdefault((grad.dtype, grad.device), []).append(i)
        for indices in by_kind.values():  # same order on every member: parameter order
            flat = torch.cat([dense[i].reshape(-1) for i in indices])
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            for i, part in zip(indices, flat.split([dense[i].numel() for i in indices]),
                               strict=True):
                out[i] = part.view(dense[i].shape)
        return (None, None, *out)


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

    Example (on the trainers of an MPI job, with a remote embedding ``emb`` and a
    ``DistributedOptimizer`` ``opt``; not run by the doctests, which have no process
    group)::

        from mpidag.nn.parallel import DistributedDataParallel as DDP
        pg = rpc.init_process_group(ranks=[0, 1])        # on every rank; None off 0 and 1
        dense = DDP(torch.nn.Linear(16, 8), process_group=pg)
        with dist_autograd.context() as context_id:
            loss = dense(emb(indices, offsets)).sum()
            dist_autograd.backward(context_id, [loss])   # dense grads averaged
            opt.step(context_id)
    """

    #: mpidag's backward leaves this module's parameters alone (torch's class is averaged
    #: there by mpidag.dist_autograd.engine; this one averages in its forward's graph)
    _mpidag_averages_itself = True

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        self._mpidag_inner = threading.local()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """DDP's forward; inside a distributed autograd context, with averaged gradients.

        Example (on every member of the process group; not run by the doctests)::

            with dist_autograd.context() as context_id:
                out = ddp_model(batch)       # the parameters' gradients will be averaged
        """
        if getattr(self._mpidag_inner, "active", False) or not self._in_distributed_context():
            return super().forward(*inputs, **kwargs)
        named = [(f"module.{name}", p) for name, p in self.module.named_parameters()
                 if p.requires_grad]
        if not named:
            return super().forward(*inputs, **kwargs)
        sparse = tuple(id(p) in self._mpidag_sparse_params() for _, p in named)
        averaged = _AverageGradients.apply(self.process_group, sparse, *(p for _, p in named))
        swapped = {name: a for (name, _), a in zip(named, averaged, strict=True)}
        self._mpidag_inner.active = True
        try:
            with self.no_sync():  # DDP's reducer would wait for hooks that never run
                return torch.func.functional_call(self, swapped, inputs, kwargs)
        finally:
            self._mpidag_inner.active = False

    def _mpidag_sparse_params(self) -> set[int]:
        """Ids of the parameters that get sparse gradients: those of ``nn.Embedding`` and
        ``nn.EmbeddingBag`` modules with ``sparse=True`` (torch DDP's rule)."""
        return {id(p) for module in self.module.modules()
                if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                and module.sparse for p in module.parameters(recurse=False)}

    def _in_distributed_context(self) -> bool:
        runtime = _runtime.current_or_none()
        return (runtime is not None and torch.is_grad_enabled()
                and self.require_backward_grad_sync
                and runtime.autograd.container.current() is not None)
