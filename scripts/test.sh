#!/usr/bin/env bash
# Set everything up and run the whole test suite: lint, single-process tests (which also
# start their own multi-rank jobs), then the multi-rank tests at 2 and at 3 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_slurm.sh  # Debian's Slurm for tests/test_slurm.py (root + apt only)
PY=.venv/bin/python
export PYTHONUNBUFFERED=1 MPIDAG_ABORT_ON_ERROR=1
echo "== ruff"
.venv/bin/ruff check .
echo "== single-process tests"
timeout --kill-after=30 1800 $PY -m pytest -q -p no:cacheprovider -m "not mpi" tests
for n in 2 3; do
  echo "== multi-rank tests on $n ranks"
  timeout --kill-after=30 1200 $PY -m mpidag.run -n "$n" -m pytest -q -p no:cacheprovider \
    --with-mpi -m mpi tests
done
echo "== all test stages passed"
