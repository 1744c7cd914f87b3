#!/usr/bin/env bash
# Install Debian's Open MPI (4.1, with mpicc and mpirun in /usr/bin) for the test matrix's
# "system MPI" stage: scripts/test.sh then builds mpi4py from source against it in
# .venv-sysmpi (MPIDAG_MPI=system bash scripts/setup.sh), as a cluster user does after
# `module load openmpi`.
#
# Idempotent and quiet unless something fails. Only acts as root with apt-get available;
# otherwise it says why and exits 1, so that the caller can skip the stage.
#
#   sudo bash scripts/install_system_mpi.sh
set -euo pipefail

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_system_mpi.sh: needs root and apt-get to install Debian's Open MPI" >&2
  exit 1
fi
bash "$(dirname "$0")/apt_install.sh" install_system_mpi.sh libopenmpi-dev openmpi-bin
command -v mpicc >/dev/null
echo "install_system_mpi.sh: $(mpirun --version 2>/dev/null | head -1) ($(command -v mpicc))"
