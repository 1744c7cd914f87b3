#!/usr/bin/env bash
# The README's set-up-and-demo command (`bash scripts/demo.sh`) run by a normal user, as
# scripts/test.sh's stage "set-up and demo as a normal user": set-up must work as root and
# as a user (issue 24), and CI runs as root. Needs root to make the user: a user account
# (MPIDAG_CHECK_USER, default mpidag-check) gets a clone of this checkout's HEAD in its
# home and runs the command there with this environment's pip settings (its find-links
# and constraints: the registries as root sees them) and a plain PATH, so it uses the
# system's python3, not root's. Passes when the demo exits 0 (it exits 1 when the
# distributed gradients differ from local autograd) and both ranks shut down cleanly.
# The clone and its venvs are removed afterwards. Not root: nothing to check (exit 0).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "check_user_setup.sh: not root: the set-up just ran as a normal user already"
  exit 0
fi
user=${MPIDAG_CHECK_USER:-mpidag-check}
if ! id "$user" >/dev/null 2>&1; then
  useradd --create-home --shell /bin/bash "$user"
fi
home=$(getent passwd "$user" | cut -d: -f6)
tree="$home/mpidag"
rm -rf "$tree"
trap 'rm -rf "$tree"' EXIT
git clone -q "$(pwd)" "$tree"
chown -R "$user:" "$tree"
log=$(mktemp)
rc=0
runuser -u "$user" -- env HOME="$home" USER="$user" LOGNAME="$user" \
  PATH=/usr/local/bin:/usr/bin:/bin bash -c 'cd ~/mpidag && bash scripts/demo.sh' \
  >"$log" 2>&1 || rc=$?
tail -n 25 "$log"
clean=$(grep -c 'shut down cleanly' "$log" || true)
rm -f "$log"
if [ "$rc" != 0 ] || [ "$clean" != 2 ]; then
  echo "check_user_setup.sh: the demo as user $user failed (exit $rc, $clean of 2 ranks" \
       "shut down cleanly)" >&2
  exit 1
fi
echo "check_user_setup.sh: set-up and demo passed as user $user ($(id -u "$user"))"
