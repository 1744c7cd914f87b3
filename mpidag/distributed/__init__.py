"""``torch.distributed`` collectives over the job's MPI: the process group of backend
``"mpidag"`` (see :mod:`mpidag.distributed.process_group`)."""

from mpidag.distributed.process_group import BACKEND, MPIProcessGroup, new_mpi_group, register

__all__ = ["BACKEND", "MPIProcessGroup", "new_mpi_group", "register"]
