"""Whether glibc keeps freed memory on every rank (``--keep-freed-memory``).

``python -m mpidag.run --keep-freed-memory`` (and ``MPIDAG_KEEP_FREED_MEMORY=1`` with the
sbatch templates) starts the ranks with glibc's allocator settings that keep freed memory in
the process (``mpidag.run.KEEP_FREED_MEMORY``). With glibc's defaults a 5 MiB block (a
parameter server's gradient) is a fresh ``mmap``, unmapped at its ``free``, so the next one
faults its pages in again; with the settings it comes from the heap and stays there. Each
rank allocates and frees one such block and prints what glibc did::

    rank 0: MALLOC_ARENA_MAX=1 mapped=0 kept=True

(``mapped=1 kept=False``: glibc's defaults). Rank 0 ends with
``OK glibc: world_size=N keeps_freed_memory=True|False`` (True only if every rank keeps it).
Needs glibc 2.33 or later (``mallinfo2``).

Run:  python -m mpidag.run --keep-freed-memory -n 2 slurm/programs/glibc_check.py
      MPIDAG_KEEP_FREED_MEMORY=1 sbatch slurm/single_node.sbatch slurm/programs/glibc_check.py
"""

from __future__ import annotations

import ctypes
import os
import sys

from mpi4py import MPI

BLOCK = 5 << 20


class Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def what_glibc_does() -> tuple[int, bool]:
    """Allocate and free one block: ``(fresh mmaps it took, whether it stayed free in the
    heap afterwards)``."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2().hblks
    block = libc.malloc(BLOCK)
    mapped = libc.mallinfo2().hblks - before
    libc.free(block)
    return mapped, libc.mallinfo2().fordblks >= BLOCK


def main() -> int:
    comm = MPI.COMM_WORLD
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        print(f"rank {comm.rank}: not glibc 2.33 or later (no mallinfo2)", flush=True)
        return 2
    mapped, kept = what_glibc_does()
    print(f"rank {comm.rank}: MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX')} "
          f"mapped={mapped} kept={kept}", flush=True)
    everywhere = comm.allreduce(int(kept and not mapped), op=MPI.MIN)
    if comm.rank == 0:
        print(f"OK glibc: world_size={comm.size} keeps_freed_memory={bool(everywhere)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
