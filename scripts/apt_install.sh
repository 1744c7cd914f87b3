#!/usr/bin/env bash
# Install the Debian packages named that are not installed yet, quietly; print apt's log and
# fail if that does not work. Used by install_slurm.sh and install_system_mpi.sh (root only).
#
#   bash scripts/apt_install.sh CALLER PACKAGE...
set -euo pipefail
caller=$1
shift
missing=()
for p in "$@"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
apt_install() {
  apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null >"$log" 2>&1
}
# A fresh image may have no package lists yet: update only if the plain install fails.
if ! apt_install; then
  if ! apt-get update -q </dev/null >>"$log" 2>&1 || ! apt_install; then
    cat "$log" >&2
    echo "$caller: apt-get install ${missing[*]} failed" >&2
    exit 1
  fi
fi
