#!/usr/bin/env bash
# Set everything up and run the whole test suite:
#   set-up   .venv (Open MPI wheel, torch 2.13.0), .venv-mpich (MPICH wheel),
#            .venv-torch2.14 (torch 2.14.1), Debian's Open MPI 4.1 and .venv-sysmpi (mpi4py
#            built from source against it), Slurm's daemons for tests/test_slurm.py
#   stages   lint; single-process tests (which also start their own multi-rank jobs); the
#            multi-rank tests at 2 and 3 ranks on Open MPI 5, on MPICH 5 and on torch 2.14.1,
#            and at 2 ranks on the Python frame-0 path (MPIDAG_COMPILED=0);
#            the system-MPI build's demo and multi-rank tests at 2 ranks; as root, the
#            README's set-up-and-demo command run by a normal user
#            (scripts/check_user_setup.sh).
# A failing stage does not stop the others: every stage runs, the summary at the end lists
# each with its time, and the exit status is 1 if any failed. Set-up failures stop at once.
#
#   bash scripts/test.sh                  # everything (what CI runs)
#   MPIDAG_MATRIX=0 bash scripts/test.sh  # only .venv: lint, single-process, 2 and 3 ranks
set -euo pipefail
cd "$(dirname "$0")/.."
MATRIX=${MPIDAG_MATRIX:-1}
started=$SECONDS

# Set-up: the venvs are made side by side (each mostly unpacks torch: one after another took
# 322 s here, side by side ~150-190 s); apt's steps stay in one line since they share dpkg's
# lock. Each step's output goes to its own log, shown when the step ends; a failure stops
# the run once every step has ended.
setup_logs=$(mktemp -d)
setup_names=()
setup_pids=()
in_background() {  # in_background NAME COMMAND...: start one set-up step
  local name=$1
  shift
  "$@" >"$setup_logs/$name.log" 2>&1 &
  setup_names+=("$name")
  setup_pids+=("$!")
}
system_mpi_line() {  # Slurm (tests/test_slurm.py), then the system MPI and its venv
  bash scripts/install_slurm.sh
  [ "$MATRIX" = 1 ] || return 0
  if bash scripts/install_system_mpi.sh; then
    MPIDAG_VENV=.venv-sysmpi MPIDAG_MPI=system bash scripts/setup.sh
    touch "$setup_logs/system-mpi-ready"
  elif [ "${CI:-}" = true ]; then
    echo "test.sh: CI must test the system-MPI build, but Debian's Open MPI could not be installed" >&2
    return 1
  else
    echo "test.sh: no system MPI (needs root and apt-get): its stage is skipped"
  fi
}
in_background ".venv" bash scripts/setup.sh
# tests/test_slurm.py's MPICH job loads this venv's libmpi, so it is made even without the matrix
in_background ".venv-mpich" env MPIDAG_VENV=.venv-mpich MPIDAG_MPI=mpich bash scripts/setup.sh
in_background "apt: Slurm, system MPI, .venv-sysmpi" system_mpi_line
if [ "$MATRIX" = 1 ]; then
  in_background ".venv-torch2.14" env MPIDAG_VENV=.venv-torch2.14 MPIDAG_TORCH=2.14.1 \
    bash scripts/setup.sh
fi
setup_failed=0
for i in "${!setup_pids[@]}"; do
  rc=0
  wait "${setup_pids[$i]}" || rc=$?
  echo "-- set-up: ${setup_names[$i]} ($([ "$rc" = 0 ] && echo done || echo "FAILED, exit $rc"))"
  cat "$setup_logs/${setup_names[$i]}.log"
  [ "$rc" = 0 ] || setup_failed=1
done
SYSMPI=0
if [ -e "$setup_logs/system-mpi-ready" ]; then SYSMPI=1; fi
rm -rf "$setup_logs"
if [ "$setup_failed" = 1 ]; then
  echo "test.sh: set-up failed (above); no test was run" >&2
  exit 1
fi
echo "== set-up done in $((SECONDS - started)) s"

export PYTHONUNBUFFERED=1 MPIDAG_ABORT_ON_ERROR=1
summary=()
failed=0
stage() {  # stage NAME COMMAND...: run it, time it, remember how it went
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== $name"
  "$@" || rc=$?
  if [ "$rc" = 0 ]; then
    summary+=("passed  $(printf '%5d' $((SECONDS - t0))) s  $name")
  else
    summary+=("FAILED  $(printf '%5d' $((SECONDS - t0))) s  $name (exit $rc)")
    failed=1
  fi
}
multi_rank() {  # multi_rank VENV N [pytest args]: the multi-rank tests on N ranks
  local venv=$1 n=$2
  shift 2
  timeout --kill-after=30 1200 "$venv/bin/python" -m mpidag.run -n "$n" -m pytest -q \
    -p no:cacheprovider --with-mpi -m mpi "$@" tests
}

stage "ruff" .venv/bin/ruff check .
# Two pytest-xdist workers, one test module each at a time (--dist loadfile: a module's
# fixtures, e.g. test_slurm.py's cluster, stay in one worker). One worker alone keeps the 2
# cores ~74% busy (each test's MPI job waits on starts, timeouts and sbatch polls): two
# bring the stage from ~745 to ~560 s here. tests/conftest.py starts the longest modules first.
stage "single-process tests" timeout --kill-after=30 1800 .venv/bin/python -m pytest -q \
  -p no:cacheprovider --durations=30 -n 2 --dist loadfile -m "not mpi" tests
stage "multi-rank tests, 2 ranks, Open MPI 5 (wheel), torch 2.13" multi_rank .venv 2
# the Python frame-0 path, which runs where the compiled one cannot be built (MPIDAG_COMPILED=0)
stage "multi-rank tests, 2 ranks, Open MPI 5, Python frame-0 path" env MPIDAG_COMPILED=0 \
  MPIDAG_TEST_ITERATIONS=1500 bash -c "$(declare -f multi_rank); multi_rank .venv 2"
# test_many_iterations_leave_nothing_alive: its 10000 backward passes (30 s at 2 ranks, 85 s
# at 3 on 2 cores) run once, above; 1500 in every other stage
export MPIDAG_TEST_ITERATIONS=1500
stage "multi-rank tests, 3 ranks, Open MPI 5 (wheel), torch 2.13" multi_rank .venv 3
if [ "$MATRIX" = 1 ]; then
  stage "multi-rank tests, 2 ranks, MPICH 5 (wheel)" multi_rank .venv-mpich 2
  stage "multi-rank tests, 3 ranks, MPICH 5 (wheel)" multi_rank .venv-mpich 3
  stage "in-process tests, torch 2.14.1" timeout --kill-after=30 900 \
    .venv-torch2.14/bin/python -m pytest -q -p no:cacheprovider -m "not mpi" \
    tests/contract tests/test_inproc.py tests/test_doctests.py
  stage "multi-rank tests, 2 ranks, torch 2.14.1" multi_rank .venv-torch2.14 2
  stage "multi-rank tests, 3 ranks, torch 2.14.1" multi_rank .venv-torch2.14 3
  if [ "$SYSMPI" = 1 ]; then
    stage "demo, system MPI (Debian's Open MPI 4.1)" timeout --kill-after=30 300 \
      .venv-sysmpi/bin/python -m mpidag.run -n 2 examples/demo.py
    stage "multi-rank tests, 2 ranks, system MPI" multi_rank .venv-sysmpi 2
  fi
  # the README's first command as a normal user (set-up works as root and as a user; CI
  # is root): a user made for it, a clone of HEAD in its home (scripts/check_user_setup.sh)
  if [ "$(id -u)" = 0 ]; then
    stage "set-up and demo as a normal user" timeout --kill-after=30 900 \
      bash scripts/check_user_setup.sh
  fi
fi

echo "== summary (total $((SECONDS - started)) s)"
printf '%s\n' "${summary[@]}"
if [ "$failed" = 0 ]; then
  echo "== all test stages passed"
else
  echo "== some test stages FAILED (see above)"
fi
exit "$failed"
