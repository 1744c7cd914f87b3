"""Transport: framing (`frames`), MPI point-to-point (`mpi`), progress (`progress`).

:mod:`mpidag.transport.mpi` is the only module of mpidag that imports ``mpi4py.MPI``.
"""

from mpidag.transport.frames import Envelope, dumps, loads

__all__ = ["Envelope", "dumps", "loads"]
