"""The per-message records of distributed autograd in C++ (the records part of
``_mpidag_torch``, ``mpidag/transport/torch_native.cpp``), built against this environment's
torch.

Recording a message in a context costs, through torch's Python autograd API, a custom
``autograd.Function`` node per received message (its Python ``forward``, an anchor input,
a detach per tensor: ~4.8 us) and, per sent leaf tensor, a view to find its gradient
accumulator (~1.8 us). The C++ module does what torch's own C++ does instead:

* ``record_recv(record, tensors)``: the received tensors that require grad become outputs of
  one new ``RecvRpcBackward`` node (a C++ node with no next edges, as torch's; its Python
  type reads the record as ``node.record``); ``record.n_outputs`` and ``record.node`` (a
  weak reference: called, the node or ``None``) are set; ~1 us for two tensors.
* ``gradient_edges(tensors, GradientEdge)``: torch's C++ ``gradient_edge`` of each tensor
  (``None`` where a custom Function's Python node or a tensor without grad needs the Python
  way, :func:`mpidag.dist_autograd.graph.edge_of`); ~0.5 us a leaf.
* ``reach(edges, recv_types, AccumulateGrad)``: the depth-first walk of
  :class:`mpidag.dist_autograd.graph.Reach` over torch's C++ nodes (0.19 instead of 0.41 us
  a node; ``None`` where an edge starts at a custom Function's Python node: Python walks);
  ``send_reach(tensors, GradientEdge, recv_types, AccumulateGrad)`` gives a send function's
  edges and their reach in one call.
* ``run_grad(outputs, grads, inputs, keep_graph)``: one region of a backward pass, what
  ``torch.autograd.grad`` does with ``GradientEdge``s, without its Python (~35 us a call
  less, and less per node: :func:`mpidag.dist_autograd.graph.engine_grad`); ``None`` where
  an edge starts at a Python node.

:func:`records_module` gives the module, or ``None``: ``MPIDAG_COMPILED=0`` (the container's
agent is not compiled), or the module is not usable here
(:func:`mpidag.transport.torch_native.problem` says why). Then the Python records of
:mod:`mpidag.dist_autograd.context` run; both make the same graph but for the recv node's
anchor input (the Python node needs one).

Example::

    >>> records_module(compiled=False) is None
    True
"""

from __future__ import annotations

from typing import Any

from mpidag.transport.torch_native import problem, torch_module

__all__ = ["problem", "records_module"]


def records_module(compiled: bool = True) -> Any:
    """The C++ records module, or ``None`` for the Python records (``compiled=False``:
    ``MPIDAG_COMPILED=0``; or not usable here: :func:`problem` says why).

    Example::

        >>> records_module() is None or hasattr(records_module(), "record_recv")
        True
    """
    return torch_module() if compiled else None
