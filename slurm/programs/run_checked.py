"""Run a Python program on this rank after checking that the MPI world is the Slurm job's.

The Slurm templates start every program through this wrapper, so that any program, yours
included, fails the job at once when ``srun`` and the MPI library disagree (wrong
``--mpi`` plugin: N one-rank worlds instead of one N-rank world) instead of running N copies
of rank 0 that all exit 0. The program then runs in this same process, as
``python program.py args`` would run it (``__name__ == "__main__"``, ``sys.argv``, its
directory first on ``sys.path``); ``-m module args`` runs a module.

Run:  srun --mpi=pmix -n 4 python slurm/programs/run_checked.py train.py --epochs 3
"""

from __future__ import annotations

import os
import runpy
import sys

from _common import check_world, expected_world_size


def run_program(argv: list[str]) -> None:
    """Run ``argv`` (``program.py args`` or ``-m module args``) as the main program."""
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("run_checked.py: -m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    program = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(program))
    runpy.run_path(program, run_name="__main__")


def main() -> None:
    """Check the world (quietly: one line on rank 0), then run the program."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: run_checked.py program.py [args] | -m module [args]")
    rank, size = check_world("world-check", verbose=False)
    if rank == 0:
        checked = ("as many as the Slurm tasks" if expected_world_size(size) is not None
                   else "no Slurm task count to check against")
        print(f"[world-check] MPI world of {size} rank(s): {checked}", flush=True)
    run_program(sys.argv[1:])


if __name__ == "__main__":
    main()
