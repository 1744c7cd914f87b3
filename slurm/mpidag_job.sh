# Shared part of mpidag's sbatch templates: sourced by them, not run on its own.
#
# Expects PYTHON (the interpreter with mpidag, torch and mpi4py) and MPIDAG_SLURM_DIR (this
# directory) to be set. Provides:
#
#   mpidag_setup                 choose the srun --mpi plugin, export the run-time settings,
#                                print what the job is about to use
#   mpidag_srun [srun options] -- program.py [args]
#                                srun the program on every task of the job, through
#                                programs/run_checked.py (it fails the job when the MPI world
#                                is not the srun step's: the wrong-plugin trap)
#
# Settings read from the environment (export them before sbatch, or set them in the
# template):
#   MPIDAG_SRUN_MPI   srun's --mpi plugin: pmix (Open MPI), pmi2 (MPICH, Intel MPI,
#                     MVAPICH), cray_shasta (HPE Cray EX). Unset: chosen from the MPI
#                     library mpi4py loads (its version string), pmix when unknown.
#   OMPI_ALLOW_RUN_AS_ROOT / OMPI_ALLOW_RUN_AS_ROOT_CONFIRM
#                     Open MPI refuses to start as root without both set to 1; set for you
#                     when the job runs as root (containers, test clusters).
#   MPIDAG_KEEP_FREED_MEMORY=1
#                     start the ranks with glibc keeping the memory they free, as
#                     `python -m mpidag.run --keep-freed-memory` does (faster steps that
#                     reallocate large tensors, e.g. a parameter server's gradients;
#                     resident memory stays at its peak); MALLOC_* values of your own win.

# The first line of the version string of the MPI library that mpi4py loads, and the srun
# --mpi plugin for it (one line each), from mpidag's launcher (mpidag.run), which decides
# the same way: $MPIDAG_SRUN_MPI, else pmi2 for the MPICH family, pmix for Open MPI.
mpidag_mpi_facts() {
  "$PYTHON" -c 'from mpidag.run import mpi_library_version, srun_mpi_plugin
version = mpi_library_version().replace(chr(0), "").strip()
print(version.splitlines()[0] if version else "unknown")
print(srun_mpi_plugin(version))'
}

mpidag_setup() {
  if [ ! -x "$PYTHON" ]; then
    echo "mpidag: no Python at $PYTHON: set MPIDAG_VENV or MPIDAG_PYTHON in the template" >&2
    exit 2
  fi
  local facts library
  facts=$(mpidag_mpi_facts) || { echo "mpidag: cannot import mpidag with $PYTHON" >&2; exit 2; }
  library=$(head -n 1 <<<"$facts")
  MPIDAG_SRUN_MPI=$(tail -n 1 <<<"$facts")
  if ! srun --mpi=list 2>&1 | grep -qw -- "$MPIDAG_SRUN_MPI"; then
    echo "mpidag: warning: srun --mpi=list does not list '$MPIDAG_SRUN_MPI'" >&2
  fi
  if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  export PYTHONUNBUFFERED=1
  if [ "${MPIDAG_KEEP_FREED_MEMORY:-0}" = 1 ]; then
    local setting settings
    settings=$("$PYTHON" -c 'from mpidag.run import keep_freed_memory_env
for name, value in keep_freed_memory_env().items(): print(f"{name}={value}")') || exit 2
    while IFS= read -r setting; do
      [ -n "$setting" ] && export "${setting?}"
    done <<<"$settings"
    echo "mpidag: glibc keeps freed memory: MALLOC_ARENA_MAX=$MALLOC_ARENA_MAX" \
         "MALLOC_TOP_PAD_=$MALLOC_TOP_PAD_ MALLOC_TRIM_THRESHOLD_=$MALLOC_TRIM_THRESHOLD_" \
         "MALLOC_MMAP_THRESHOLD_=$MALLOC_MMAP_THRESHOLD_"
  fi
  # Threads of torch and OpenMP inside each rank: the cores Slurm gave the task.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
  echo "mpidag: job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NUM_NODES:-?} node(s)" \
       "(${SLURM_JOB_NODELIST:-?}), ${SLURM_NTASKS:-?} task(s)," \
       "${SLURM_CPUS_PER_TASK:-1} cpu(s) per task"
  echo "mpidag: python $PYTHON; MPI library: ${library:-unknown}; srun --mpi=$MPIDAG_SRUN_MPI"
}

mpidag_srun() {
  local opts=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    opts+=("$1")
    shift
  done
  [ "$#" -gt 0 ] && shift  # the --
  if [ "$#" -eq 0 ]; then
    echo "mpidag_srun: no program given" >&2
    exit 2
  fi
  # Every task checks that MPI sees exactly this many ranks.
  export MPIDAG_EXPECTED_WORLD_SIZE=${SLURM_NTASKS:?not inside a Slurm job}
  # srun does not inherit sbatch's --cpus-per-task since Slurm 22.05: pass it on.
  local cmd=(srun --mpi="$MPIDAG_SRUN_MPI" --kill-on-bad-exit=1
             --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" "${opts[@]}"
             "$PYTHON" "$MPIDAG_SLURM_DIR/programs/run_checked.py" "$@")
  echo "mpidag: ${cmd[*]}"
  local status=0
  "${cmd[@]}" || status=$?
  echo "mpidag: exit status $status"
  return "$status"
}
