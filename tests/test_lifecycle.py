"""init_rpc / shutdown lifecycle, misuse and failures, each in a real multi-rank job.

These tests start their own ``mpirun`` jobs (like pytest-mpi's own tests), so a hang or a
crash shows up as a failed assertion with the job's output, never as a stuck test run.
"""

from __future__ import annotations

import subprocess

import pytest

PRELUDE = """
import sys, time, torch
import mpidag.rpc as rpc
from mpidag.errors import RPCError, RPCNotInitializedError
def add(a, b): return a + b
def slow(s, v): time.sleep(s); return v
"""


def ok(result: subprocess.CompletedProcess) -> str:
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    return out


def test_calls_before_init_and_after_shutdown_raise(job):
    out = ok(job(PRELUDE + """
for api in (lambda: rpc.rpc_sync("worker1", add, args=(1, 2)),
            lambda: rpc.rpc_async(1, add, args=(1, 2)),
            lambda: rpc.get_worker_info(), lambda: rpc.shutdown()):
    try:
        api()
    except RPCNotInitializedError as e:
        assert "Call mpidag.rpc.init_rpc first" in str(e) and isinstance(e, RuntimeError)
    else:
        raise SystemExit("no error before init_rpc")
rpc.init_rpc()
try:
    rpc.init_rpc()
except RPCError as e:
    assert "already initialized" in str(e)
else:
    raise SystemExit("init_rpc twice did not raise")
me = rpc.get_worker_info().id
assert rpc.rpc_sync(1 - me, add, args=(me, 1), timeout=10) == me + 1
rpc.shutdown()
try:
    rpc.rpc_sync("worker1", add, args=(1, 2))
except RPCNotInitializedError:
    pass
else:
    raise SystemExit("no error after shutdown")
# a second life: init again after shutdown works
rpc.init_rpc(f"again{me}")
assert rpc.rpc_sync(f"again{1 - me}", add, args=(2, 2), timeout=10) == 4
rpc.shutdown()
print("LIFECYCLE-OK", me)
"""))
    assert out.count("LIFECYCLE-OK") == 2


def test_process_hooks_are_removed_at_shutdown_and_installed_once_per_session(job):
    """init_rpc installs sys.excepthook (an uncaught error ends the job) and two exit hooks
    (a forgotten shutdown; the exit without MPI_Finalize after a failure); shutdown(),
    graceful or not, puts sys.excepthook back and unregisters both, so every session
    installs them once and none stacks up. sys.exit is never touched without a failure
    (tests/test_ft.py: what stays after one). The ``kill -USR1`` report's handler comes and
    goes with the session too. A hook the program set over mpidag's stays."""
    out = ok(job(PRELUDE + """
import atexit, signal
from mpi4py import MPI
from mpidag.rpc import api
hook, exit_fn = sys.excepthook, sys.exit
usr1 = signal.getsignal(signal.SIGUSR1)
registered = []   # the exit hooks registered now (atexit does not say)
real_register, real_unregister = atexit.register, atexit.unregister

def register(fn, *args, **kwargs):
    registered.append(fn.__name__)
    return real_register(fn, *args, **kwargs)

def unregister(fn):
    registered[:] = [name for name in registered if name != fn.__name__]
    real_unregister(fn)

atexit.register, atexit.unregister = register, unregister

def state():
    mpidags = isinstance(sys.excepthook, api._AbortOnUncaught) and \\
        sys.excepthook.previous is hook
    return ("mpidag's" if mpidags else "before" if sys.excepthook is hook else "other",
            sys.exit is exit_fn, sorted(registered),
            signal.getsignal(signal.SIGUSR1) is usr1)

seen = [state()]
for graceful in (True, True, False):
    rpc.init_rpc()
    seen.append(state())
    me = rpc.get_worker_info().id
    assert rpc.rpc_sync(1 - me, add, args=(me, 1), timeout=10) == me + 1
    MPI.COMM_WORLD.Barrier()   # both calls answered: neither rank needs the other now
    rpc.shutdown(graceful=graceful, timeout=30)
    seen.append(state())
print("HOOKS", me, seen)
rpc.init_rpc()
own = lambda *exc: hook(*exc)   # the program's own hook, set over mpidag's
sys.excepthook = own
rpc.shutdown()
print("OWN-HOOK-KEPT", me, sys.excepthook is own, registered)
"""))
    exit_hooks = ["_shutdown_at_exit", "_skip_finalize_after_failures"]
    session = [("mpidag's", True, exit_hooks, False), ("before", True, [], True)]
    for me in (0, 1):
        assert f"HOOKS {me} {[('before', True, [], True)] + session * 3}" in out, out
        assert f"OWN-HOOK-KEPT {me} True []" in out, out


def test_torch_style_init_arguments_and_options(job):
    out = ok(job(PRELUDE + """
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=0.5,
                                       init_method="tcp://ignored:1234")
rpc.init_rpc(f"trainer{r}", backend=rpc.BackendType.TENSORPIPE, rank=r, world_size=2,
             rpc_backend_options=opts)
assert rpc.get_worker_info().name == f"trainer{r}"
assert rpc.get_worker_info(f"trainer{1 - r}").id == 1 - r
assert rpc.get_rpc_timeout() == 0.5
if r == 0:
    try:   # the 2 s call outlives the options' 0.5 s default, not the 60 s one
        rpc.rpc_sync("trainer1", slow, args=(2, 1))
    except TimeoutError as e:
        print("DEFAULT-TIMEOUT-OK")
    else:
        print("NO-TIMEOUT: the options' rpc_timeout was not the default")
rpc.shutdown()
"""))
    assert "DEFAULT-TIMEOUT-OK" in out, out


@pytest.mark.parametrize("bad, expected", [
    # (a rank or world_size that does not fit the job is raised at once on its rank alone,
    # before any collective call: tests/test_bad_input.py)
    ("kwargs = dict(name='')", "worker name must be"),
    # every MPIDAG_* variable is read once, at init_rpc (set here after the imports)
    ("os.environ['MPIDAG_BACKOFF_MAX'] = 'fast'", "MPIDAG_BACKOFF_MAX='fast'"),
    ("os.environ['MPIDAG_GC_FREEZE'] = 'maybe'", "MPIDAG_GC_FREEZE='maybe'"),
    ("os.environ['MPIDAG_LOG'] = 'loud'", "MPIDAG_LOG='loud'"),
])
def test_bad_init_argument_or_setting_fails_on_every_rank_without_hanging(job, bad, expected):
    """A ValueError naming the mistake on the rank that made it, an RPCError naming that
    rank on the others; no rank waits for a rank that gave up."""
    result = job(PRELUDE + f"""
import os
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
kwargs = {{}}
if r == 1:
    {bad}
try:
    rpc.init_rpc(**kwargs)
except ValueError as e:
    print("RANK", r, "VALUE-ERROR", e)
except RPCError as e:
    print("RANK", r, "RPC-ERROR", e)
else:
    print("RANK", r, "NO-ERROR")
""", timeout=60)
    out = ok(result)
    assert f"RANK 1 VALUE-ERROR {expected}" in out, out  # the rank that made the mistake
    assert "RANK 0 RPC-ERROR init_rpc failed on rank 1" in out  # the others are told
    assert "NO-ERROR" not in out


def test_one_pool_thread_and_large_replies_both_ways_do_not_deadlock(job):
    """Both ranks have one pool thread, and each asks the other for a large tensor while no
    user thread waits: each pool thread serves the request and blocks sending its large
    reply, which only the other rank's (busy) pool thread could receive. The sentinel must
    take over the progress (before: both ranks waited forever)."""
    out = ok(job(PRELUDE + """
def big(n):
    return torch.arange(n, dtype=torch.float32)

opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=1)
rpc.init_rpc(rpc_backend_options=opts)
me = rpc.get_worker_info().id
n = 16 << 20                                   # 64 MiB: far above any eager limit
fut = rpc.rpc_async(1 - me, big, args=(n,), timeout=0)
deadline = time.monotonic() + 30
while not fut.done() and time.monotonic() < deadline:
    time.sleep(0.05)                           # this thread does not drive progress
print("RANK", me, "DONE" if fut.done() else "STUCK")
if fut.done():
    value = fut.wait()
    assert value.numel() == n and float(value[-1]) == n - 1
    rpc.shutdown()
else:
    rpc.shutdown(graceful=False)
""", timeout=120))
    assert out.count("DONE") == 2, out


def test_nested_calls_beyond_the_pool_do_not_deadlock(job):
    """One pool thread per rank and a chain worker0 -> worker1.f -> worker0.g -> worker1.h:
    worker1's only pool thread waits in f while h is queued behind it. The pool grows by a
    thread when every pool thread waits for a nested call and a request is queued (before:
    the chain waited forever, as it would with torch's fixed pool)."""
    out = ok(job(PRELUDE + """
def h(x):
    return x + 1

def g(x):
    return rpc.rpc_sync("worker1", h, args=(x * 2,), timeout=0)

def f(x):
    return rpc.rpc_sync("worker0", g, args=(x + 3,), timeout=0)

opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=1)
rpc.init_rpc(rpc_backend_options=opts)
if rpc.get_worker_info().id == 0:
    fut = rpc.rpc_async("worker1", f, args=(1,), timeout=0)
    deadline = time.monotonic() + 30
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("RESULT", fut.wait() if fut.done() else "STUCK")
rpc.shutdown()
""", timeout=120))
    assert "RESULT 9" in out, out   # ((1 + 3) * 2) + 1
    assert "starting more threads" in out, out


def test_duplicate_worker_names_rejected(job):
    out = ok(job(PRELUDE + """
try:
    rpc.init_rpc("same")
except RuntimeError as e:  # torch's type and wording
    print("DUP", "RPC worker name same is not unique" in str(e))
""", timeout=60))
    assert out.count("DUP True") == 2


def test_graceful_shutdown_waits_for_calls_in_flight(job):
    out = ok(job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
n = rpc.get_worker_info  # noqa
futs = [rpc.rpc_async((me + 1) % 3, slow, args=(0.3, i), timeout=30) for i in range(20)]
t0 = time.monotonic()
rpc.shutdown()          # must wait for every reply, on every rank
assert all(f.done() for f in futs)
assert [f.value() for f in futs] == list(range(20))
print("SHUTDOWN-WAITED", me, round(time.monotonic() - t0, 2))
""", nprocs=3))
    assert out.count("SHUTDOWN-WAITED") == 3


def test_shutdown_when_only_some_ranks_used_rrefs(job):
    """Ranks that touched RRefs have shutdown work the others lack; all must still agree."""
    out = ok(job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 0:
    rref = rpc.remote("worker2", torch.ones, args=(3,))
    assert rref.to_here().sum().item() == 3
    del rref
rpc.shutdown(timeout=60)
print("SOME-RREFS-OK", me)
""", nprocs=3, timeout=120))
    assert out.count("SOME-RREFS-OK") == 3


def test_shutdown_with_one_rank_late(job):
    # rank 1 keeps working (and serving calls) long after rank 0 entered shutdown()
    out = ok(job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 1:
    for i in range(20):
        assert rpc.rpc_sync("worker0", add, args=(i, 1), timeout=10) == i + 1
        time.sleep(0.05)
rpc.shutdown()
print("LATE-OK", me)
"""))
    assert out.count("LATE-OK") == 2


def test_nongraceful_shutdown_fails_pending_futures(job):
    out = ok(job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 0:
    fut = rpc.rpc_async("worker1", slow, args=(1.0, 1), timeout=30)
    rpc.shutdown(graceful=False)
    try:
        fut.wait()
    except RPCError as e:
        print("PENDING-FAILED", "shut down" in str(e))
else:
    time.sleep(2.0)
    rpc.shutdown(graceful=False)
"""))
    assert "PENDING-FAILED True" in out


def test_forgotten_shutdown_is_done_at_exit(job):
    out = ok(job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
assert rpc.rpc_sync(1 - me, add, args=(1, 1), timeout=10) == 2
print("EXITING", me)
"""))
    assert out.count("EXITING") == 2
    assert "exits without mpidag.rpc.shutdown()" in out


def test_shutdown_timeout_when_a_rank_never_arrives(job):
    # rank 1 calls shutdown only after rank 0's shutdown gave up (told over COMM_WORLD):
    # the timeout is the only way rank 0's shutdown can end
    out = ok(job(PRELUDE + """
from mpi4py import MPI
from mpidag.errors import RPCTimeoutError
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 0:
    try:
        rpc.shutdown(timeout=1.0)
    except RPCTimeoutError as e:
        print("SHUTDOWN-TIMEOUT", "did not call shutdown" in str(e))
    MPI.COMM_WORLD.send("gave up", dest=1)
else:
    request = MPI.COMM_WORLD.irecv(source=0)
    while not request.test()[0]:
        time.sleep(0.01)
    rpc.shutdown(graceful=False)
""", timeout=60))
    assert "SHUTDOWN-TIMEOUT True" in out, out


def test_uncaught_error_on_one_rank_ends_the_job_instead_of_hanging(job):
    result = job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 1:
    raise RuntimeError("rank 1 crashed")
rpc.rpc_sync("worker1", slow, args=(60, 1), timeout=0)   # would wait forever
""", timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "rank 1 crashed" in out and "aborting the MPI job" in out


def test_killed_rank_ends_the_job_instead_of_hanging(job):
    result = job(PRELUDE + """
import os, signal
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 1:
    os.kill(os.getpid(), signal.SIGKILL)
rpc.rpc_sync("worker1", slow, args=(60, 1), timeout=0)
""", timeout=60)
    assert result.returncode != 0
    out = result.stdout + result.stderr  # mpirun names the lost rank and its signal
    assert "rank 1" in out and ("signal 9" in out or "Killed" in out), out


def test_device_map_naming_an_unknown_worker_fails_everywhere(job):
    out = ok(job(PRELUDE + """
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
opts = rpc.MPIRpcBackendOptions()
if r == 1:
    opts.set_device_map("nobody", {0: 0})
try:
    rpc.init_rpc(rpc_backend_options=opts)
except ValueError as e:
    print("RANK", r, "VALUE-ERROR", "unknown workers ['nobody']" in str(e))
except RPCError as e:
    print("RANK", r, "RPC-ERROR", "rank 1" in str(e))
""", timeout=60))
    assert "RANK 1 VALUE-ERROR True" in out and "RANK 0 RPC-ERROR True" in out


def test_rref_after_shutdown_and_leak_report(job):
    out = ok(job(PRELUDE + """
from mpidag.rpc import api
rpc.init_rpc()
me = rpc.get_worker_info().id
kept = rpc.remote(1 - me, add, args=(torch.ones(2), 1))     # still referenced at shutdown
assert torch.equal(kept.to_here(timeout=30), torch.full((2,), 2.0))
rpc.shutdown()
try:
    kept.to_here()
except RuntimeError as e:
    print("AFTER-SHUTDOWN", type(e).__name__, "init_rpc" in str(e))
"""))
    assert out.count("AFTER-SHUTDOWN RPCNotInitializedError True") == 2
    assert "worker0 (rank 0 of 2): 1 user RRef(s) still referenced at shutdown" in out
    assert "worker1 (rank 1 of 2): 1 user RRef(s) still referenced at shutdown" in out


def test_sigusr1_dumps_stacks_and_calls_in_flight(job):
    out = ok(job(PRELUDE + """
import os, signal
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 0:
    fut = rpc.rpc_async("worker1", slow, args=(1.0, 1), timeout=30)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.1)   # the Python part of the report runs between bytecodes
    assert fut.wait() == 1
rpc.shutdown()
""", env={"MPIDAG_LOG": "info"}))
    assert "Current thread" in out or "Thread 0x" in out  # faulthandler's stacks
    assert "=== mpidag state of worker0 (rank 0 of 2) ===" in out
    assert "calls in flight: 1" in out and "slow -> worker1" in out


def test_mpidag_log_prefixes_the_rank_and_rejects_bad_levels(job):
    out = ok(job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
assert rpc.rpc_sync(1 - me, add, args=(1, 1), timeout=10) == 2
print("DONE", me)
""", env={"MPIDAG_LOG": "info"}))
    assert "[mpidag r0] WARNING mpidag.rpc.api:" in out and "[mpidag r1] WARNING" in out
    bad = ok(job(PRELUDE + """
try:
    rpc.init_rpc()
except ValueError as e:
    print("BAD-LEVEL", "not a log level" in str(e))
""", env={"MPIDAG_LOG": "loud"}))
    assert bad.count("BAD-LEVEL True") == 2


@pytest.mark.parametrize("variable", ["SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"])
def test_a_singleton_of_a_larger_launch_is_an_error(tmp_path, variable):
    """srun --mpi=pmi2 with Open MPI gives every task a world of its own: each would run
    alone as worker0 and exit 0. init_rpc says what is wrong instead."""
    import os
    import sys

    script = tmp_path / "single.py"
    script.write_text("import mpidag.rpc as rpc\nrpc.init_rpc()\nprint('RAN ALONE')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM"))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, env={**env, variable: "2"})
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "RAN ALONE" not in out, out
    assert f"the launcher started 2 tasks ({variable})" in out
    assert "srun --mpi=pmix" in out
    # a real one-rank run is fine
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0 and "RAN ALONE" in result.stdout, result.stderr


def test_calls_to_a_worker_that_shut_down_alone_fail_at_once_not_by_timeout(job):
    out = ok(job(PRELUDE + """
from mpi4py import MPI
from mpidag.errors import WorkerFailedError, RPCTimeoutError
rpc.init_rpc()
me = rpc.get_worker_info().id
assert rpc.rpc_sync(1 - me, add, args=(me, 1), timeout=10) == me + 1
MPI.COMM_WORLD.Barrier()                  # both calls answered
if me == 1:
    rpc.shutdown(graceful=False)          # alone: tells the others it is gone
    MPI.COMM_WORLD.Barrier()
else:
    MPI.COMM_WORLD.Barrier()
    try:
        rpc.rpc_sync("worker1", add, args=(1, 2), timeout=60)
    except RPCTimeoutError as e:
        raise SystemExit(f"timed out instead of failing at once: {e}")
    except WorkerFailedError as e:
        assert "worker1" in str(e), e
        print("FAILED AT ONCE", [w.name for w in rpc.failed_workers()])
    rpc.shutdown(graceful=False)
"""))
    assert "FAILED AT ONCE ['worker1']" in out
