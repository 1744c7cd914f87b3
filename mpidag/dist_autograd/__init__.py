"""Distributed autograd's machinery (the public API is :mod:`mpidag.autograd`).

* :mod:`.graph`: regions of one rank's local graph, run by the native engine;
* :mod:`.context`: contexts, send/recv functions, recording through the agent's observer;
* :mod:`.engine`: the backward pass across ranks, FAST mode completed by SMART mode
  (:class:`DistAutograd`).
"""

from mpidag.dist_autograd.context import ContextContainer, DistAutogradContext
from mpidag.dist_autograd.engine import (
    DistAutograd,
    UnusedRPCGradientError,
    UnusedRPCWarning,
    check_roots,
)

__all__ = [
    "ContextContainer",
    "DistAutograd",
    "DistAutogradContext",
    "UnusedRPCGradientError",
    "UnusedRPCWarning",
    "check_roots",
]
