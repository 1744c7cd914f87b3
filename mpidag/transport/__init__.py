"""Transport: framing (``frames``), the interface and shared framing path (``base``), MPI
point-to-point (``mpi``), threads of one process (``inproc``), progress (``progress``).

:mod:`mpidag.transport.mpi` is the only module of mpidag that imports ``mpi4py.MPI``.
"""

from mpidag.transport.base import FramedTransport, Transport
from mpidag.transport.frames import Codecs, Envelope, dumps, loads

__all__ = ["Codecs", "Envelope", "FramedTransport", "Transport", "dumps", "loads"]
