"""Helpers shared by the programs the Slurm templates run (not part of the mpidag package).

Every program starts with :func:`check_world`, which prints the MPI world this rank sees
(``rank=R world_size=N``) and stops with a clear message when the MPI world is not the one
``srun`` started. The usual cause is a wrong ``srun --mpi=`` plugin: Open MPI needs
``--mpi=pmix``; under ``--mpi=pmi2`` each of the N tasks becomes a 1-rank MPI "singleton",
and N copies of rank 0 would otherwise run side by side and all exit 0.

The expected size is ``$MPIDAG_EXPECTED_WORLD_SIZE`` (the templates set it to the number of
tasks they ask ``srun`` for) or, when unset, ``$SLURM_STEP_NUM_TASKS`` if this rank sees a
world of one (``mpirun`` inside an allocation is not checked then: its ranks inherit the
task count of the step that started its daemons, not their own).
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
from mpi4py import MPI

WRONG_PLUGIN_HINT = (
    "wrong srun --mpi plugin for this MPI? Open MPI needs --mpi=pmix; MPICH, Intel MPI and "
    "MVAPICH --mpi=pmi2 (set MPIDAG_SRUN_MPI; `srun --mpi=list` shows what this Slurm has)"
)


def node_name() -> str:
    """The Slurm node this rank runs on (``$SLURMD_NODENAME``), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def expected_world_size(size: int) -> int | None:
    """The world size this rank should see, or ``None`` when there is nothing to check."""
    explicit = os.environ.get("MPIDAG_EXPECTED_WORLD_SIZE", "")
    if explicit.isdigit():
        return int(explicit)
    step_tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if size == 1 and step_tasks.isdigit():
        return int(step_tasks)
    return None


def check_world(program: str, *, verbose: bool = True) -> tuple[int, int]:
    """Check the MPI world against the Slurm task count; return ``(rank, world_size)``.

    Prints ``[program] rank=R world_size=N ...`` on every rank when ``verbose`` (else
    nothing). Exits with status 1 and an explanation on stderr when the world size is not
    the expected one (see the module docstring).
    """
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if verbose:
        print(f"[{program}] rank={rank} world_size={size} node={node_name()} "
              f"slurm_procid={os.environ.get('SLURM_PROCID', '-')} "
              f"slurm_step_tasks={os.environ.get('SLURM_STEP_NUM_TASKS', '-')}", flush=True)
    expected = expected_world_size(size)
    if expected is not None and size != expected:
        sys.stderr.write(
            f"[{program}] error: the job started {expected} tasks but this one (Slurm task "
            f"{os.environ.get('SLURM_PROCID', '?')}) is rank {rank} of an MPI world of {size}: "
            f"{WRONG_PLUGIN_HINT}.\n")
        sys.stderr.flush()
        sys.exit(1)
    return rank, size


def all_ranks_ok(ok: bool) -> bool:
    """True on every rank when ``ok`` is True on every rank (a collective).

    Uses the buffer ``Allreduce``: mpi4py's pickling ``allreduce`` was seen to stop a rank
    from serving mpidag RPCs while it waits, so that a peer's call to it timed out.
    """
    flag = np.array([1 if ok else 0], dtype=np.int32)
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, flag, op=MPI.MIN)
    return bool(flag[0])


def slurm_summary() -> str:
    """The Slurm job this runs in, in one line (or a note that it is not in one)."""
    if "SLURM_JOB_ID" not in os.environ:
        return "not in a Slurm job"
    keys = ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS", "SLURM_JOB_PARTITION")
    return " ".join(f"{k.removeprefix('SLURM_').lower()}={os.environ.get(k, '-')}" for k in keys)
