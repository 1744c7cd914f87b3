"""mpidag: PyTorch's RPC, RRef, distributed autograd and distributed optimizer on MPI.

Nothing here touches MPI at import time; :func:`mpidag.rpc.init_rpc` does.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
