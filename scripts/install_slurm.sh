#!/usr/bin/env bash
# Install what tests/test_slurm.py needs to start a throwaway single-node Slurm: Debian's
# slurmctld, slurmd, slurm-client and libpmix2, plus the unversioned libpmix.so that Slurm's
# mpi/pmix plugin dlopens (Debian ships only libpmix.so.2 without the -dev package).
#
# Idempotent and quiet unless something fails. Only acts as root with apt-get available;
# otherwise it says why and exits 0 (the Slurm tests then skip, or fail under CI=true).
#
#   sudo bash scripts/install_slurm.sh
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "install_slurm.sh: not root, not installing Slurm (the Slurm tests will skip)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm.sh: no apt-get, not installing Slurm (the Slurm tests will skip)"
  exit 0
fi

bash "$(dirname "$0")/apt_install.sh" install_slurm.sh slurmctld slurmd slurm-client libpmix2

# Slurm's mpi_pmix plugin loads <pmix prefix>/lib/libpmix.so; make it point at libpmix.so.2.
found=0
for so in /usr/lib/*/pmix2/lib/libpmix.so.2 /usr/lib/pmix2/lib/libpmix.so.2; do
  [ -e "$so" ] || continue
  found=1
  link="$(dirname "$so")/libpmix.so"
  if [ ! -e "$link" ]; then
    ln -sf libpmix.so.2 "$link"
  fi
done
if [ "$found" = 0 ]; then
  echo "install_slurm.sh: libpmix.so.2 not found under /usr/lib/*/pmix2/lib" >&2
  exit 1
fi
