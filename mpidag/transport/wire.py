"""The compiled frame-0 path of the MPI transport, and the rule for when it is used.

``_mpidag_wire`` (``wire.c``, built per virtual environment by
``python -m mpidag.transport.wire_build``, which ``scripts/setup.sh`` runs) does in C what
:class:`~mpidag.transport.mpi.MPITransport` otherwise does through mpi4py for every
message: ``MPI_Isend`` of frame 0 and its first ``MPI_Test`` (the frame kept alive while in
flight), and ``MPI_Improbe`` + ``MPI_Get_count`` + ``MPI_Mrecv`` of the next frame 0 into a
new ``bytearray``, each with the GIL released around the MPI call. It replaces the Python
methods one for one (same arguments, same results, MPI errors raised as mpi4py's
``MPI.Exception``), so everything above the transport is unchanged.

:func:`open_wire` gives a ``Wire`` for a communicator, or ``None`` (the Python path) when
``MPIDAG_COMPILED=0`` asks for it, when the module is not built, or when it was built
against another MPI library than the one mpi4py loaded (a venv whose MPI changed since set
up); :func:`status` says which and why, for logs and ``mpidag.inspect``.

Example (needs MPI, so not run by the doctests)::

    from mpi4py import MPI
    wire = open_wire(MPI.COMM_SELF, tag=7, MPI=MPI)
    wire.send(0, b"hello")              # to itself
    wire.probe()                        # (0, bytearray(b'hello'))
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__all__ = ["WIRE_VERSION", "import_built", "open_wire", "status"]

#: the ``VERSION`` of ``wire.c`` this code calls (a build from older sources lacks a
#: method: rebuild it)
WIRE_VERSION = 5

log = logging.getLogger(__name__)

_status = "not asked for yet"


def status() -> str:
    """Which frame-0 path the last :func:`open_wire` chose, and why.

    Example::

        >>> isinstance(status(), str)
        True
    """
    return _status


def import_built(name: str, version: int, instead: str) -> tuple[Any, str]:
    """``(module, "")``: the compiled module ``name`` built by ``wire_build`` from this
    mpidag's sources (its ``VERSION`` is ``version``); else ``(None, why)``, ``why`` starting
    with ``instead``, the Python path that runs then (not built, or built from other sources:
    a ``git pull`` without ``setup.sh``).

    Example::

        >>> import_built("_mpidag_no_such_module", 1, "Python path")[1].split(":")[0]
        'Python path'
    """
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return None, (f"{instead}: the compiled one is not built ({exc}); build it with "
                      f"'python -m mpidag.transport.wire_build'")
    built = getattr(module, "VERSION", 1)
    if built != version:
        return None, (f"{instead}: {module.__file__} was built from other sources (version "
                      f"{built}, this mpidag needs {version}); rebuild it with "
                      f"'python -m mpidag.transport.wire_build'")
    return module, ""


def _load(MPI: Any) -> tuple[Any, str]:
    module, why = import_built("_mpidag_wire", WIRE_VERSION, "Python frame-0 path")
    if module is None:
        return None, why
    ours = module.library_version().splitlines()[0].strip()
    theirs = MPI.Get_library_version().splitlines()[0].strip()
    if ours != theirs:
        return None, (f"Python frame-0 path: {module.__file__} was built against {ours!r} but "
                      f"mpi4py uses {theirs!r}; rebuild it with "
                      f"'python -m mpidag.transport.wire_build'")
    return module, f"compiled frame-0 path ({module.__file__})"


def open_wire(comm: Any, tag: int, MPI: Any, compiled: bool = True) -> Any:
    """A ``Wire`` sending and receiving frame 0 on ``tag`` of ``comm``, or ``None``.

    ``compiled=False`` (``MPIDAG_COMPILED=0``) always gives ``None``.
    """
    global _status
    if not compiled:
        _status = "Python frame-0 path: MPIDAG_COMPILED=0"
        return None
    module, _status = _load(MPI)
    if module is None:  # a build for another MPI is a mistake to fix; none is a choice
        (log.info if "not built" in _status else log.warning)("%s", _status)
        return None
    return module.Wire(MPI._handleof(comm), tag, MPI.Exception)
