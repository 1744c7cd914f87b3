"""Build ``_mpidag_wire`` (``wire.c``) for this virtual environment's MPI.

The module calls MPI directly, so it must be compiled against the very MPI library that
mpi4py uses here (Open MPI's and MPICH's handles and status layouts differ): the wheel's or
the system's ``mpicc``, and it goes into this interpreter's ``site-packages``, one build per
virtual environment (an editable checkout shared by several environments keeps none).
``scripts/setup.sh`` runs it; by hand::

    python -m mpidag.transport.wire_build          # build, check, say where it went
    python -m mpidag.transport.wire_build --check  # only say whether it is there and loads

The compiler is ``$MPICC``, else the environment's own ``bin/mpicc`` (the Open MPI and
MPICH wheels ship one), else ``mpicc`` on ``PATH`` (a system MPI). After building, a fresh
interpreter loads the module and compares its ``MPI_Get_library_version`` with mpi4py's; a
build that does not match is removed. Exit status 1 with the reason when no build is
possible; mpidag then runs its Python frame-0 path (``mpidag.transport.wire``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

MODULE = "_mpidag_wire"
SOURCE = Path(__file__).with_name("wire.c")

_CHECK = """
import sys
from mpi4py import MPI
import _mpidag_wire
ours = _mpidag_wire.library_version().splitlines()[0].strip()
theirs = MPI.Get_library_version().splitlines()[0].strip()
if ours != theirs:
    sys.exit(f"built against {ours!r} but mpi4py uses {theirs!r}")
print(_mpidag_wire.__file__)
"""


def target() -> Path:
    """Where the built module goes: this interpreter's ``site-packages``."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return Path(sysconfig.get_paths()["platlib"]) / (MODULE + suffix)


def find_mpicc(environ: os._Environ | dict | None = None) -> str | None:
    """The MPI compiler wrapper to build with (see the module's doc), or ``None``.

    Example::

        >>> find_mpicc({"MPICC": "/opt/mpi/bin/mpicc"})
        '/opt/mpi/bin/mpicc'
    """
    env = os.environ if environ is None else environ
    if env.get("MPICC"):
        return env["MPICC"]
    own = Path(sys.prefix) / "bin" / "mpicc"
    if own.exists():
        return str(own)
    return shutil.which("mpicc", path=env.get("PATH"))


def check() -> tuple[bool, str]:
    """Whether the built module loads in a fresh interpreter and matches mpi4py's MPI."""
    result = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                            timeout=120)
    text = (result.stdout + result.stderr).strip().splitlines()
    return result.returncode == 0, text[-1] if text else f"exit status {result.returncode}"


def build() -> tuple[bool, str]:
    """Compile, install into ``site-packages`` and check; ``(ok, what happened)``."""
    mpicc = find_mpicc()
    if mpicc is None:
        return False, ("no MPI C compiler wrapper found (set MPICC, or put an MPI's mpicc on "
                       "PATH, e.g. 'module load openmpi' or Debian's libopenmpi-dev)")
    out = target()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    command = [mpicc, "-O2", "-shared", "-fPIC", "-Wall", "-Werror",
               f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(partial)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except OSError as exc:
        return False, f"{mpicc} could not run: {exc}"
    if result.returncode != 0:
        return False, f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}"
    partial.replace(out)
    ok, said = check()
    if not ok:
        out.unlink(missing_ok=True)
        return False, f"the built module does not load or match mpi4py's MPI: {said}"
    return True, f"built {out} with {mpicc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that the module is built and matches mpi4py's MPI")
    args = parser.parse_args(argv)
    ok, said = check() if args.check else build()
    print(f"mpidag wire: {said}" if ok else f"mpidag wire: not built: {said}",
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
