"""The per-message records of distributed autograd in C++ (``_mpidag_autograd``,
``native.cpp``), built against this environment's torch.

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

:func:`records_module` gives the module, or ``None``: ``MPIDAG_COMPILED=0`` (the container's
agent is not compiled), not built (``python -m mpidag.transport.wire_build`` builds it with
the other compiled modules), built from other sources or against another torch. Then the
Python records of :mod:`mpidag.dist_autograd.context` run; both make the same graph but for
the recv node's anchor input (the Python node needs one).

Example::

    >>> records_module() is None or records_module().VERSION == NATIVE_VERSION
    True
"""

from __future__ import annotations

from typing import Any

import torch

from mpidag.transport.wire import import_built

__all__ = ["NATIVE_VERSION", "problem", "records_module"]

#: the ``VERSION`` of ``native.cpp`` this code calls (a build from older sources is not used)
NATIVE_VERSION = 1


def _load() -> tuple[Any, str]:
    module, why = import_built("_mpidag_autograd", NATIVE_VERSION, "Python autograd records")
    if module is None:
        return None, why
    if torch.__version__ != module.TORCH_VERSION:
        return None, (f"Python autograd records: {module.__file__} was built against torch "
                      f"{module.TORCH_VERSION}, this environment has {torch.__version__}; "
                      f"rebuild it with 'python -m mpidag.transport.wire_build'")
    return module, f"C++ autograd records ({module.__file__})"


_module, _status = _load()


def records_module(compiled: bool = True) -> Any:
    """The C++ records module, or ``None`` for the Python records (``compiled=False``:
    ``MPIDAG_COMPILED=0``).

    Example::

        >>> records_module(compiled=False) is None
        True
    """
    return _module if compiled else None


def problem() -> str:
    """Which records run and why (the module's file, or why not).

    Example::

        >>> problem().split(" ")[1] in ("autograd", "Python")
        True
    """
    return _status
