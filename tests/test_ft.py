"""Fault tolerance (``python -m mpidag.run --ft``, Open MPI 5's ULFM): a rank dies, the others
go on. Each test starts its own 3-rank job and kills a rank of it (SIGKILL, a crash, an exit
without ``shutdown``); survivors print what they saw, checked here. The long trial count is
``benchmarks/chaos.py``'s."""

from __future__ import annotations

import re

import pytest

from mpidag.run import build_command

FT = ("--ft",)

PRELUDE = """
import os, signal, sys, threading, time
import torch
import mpidag.rpc as rpc
import mpidag.autograd as dist_autograd
from mpidag.optim import DistributedOptimizer

def die_soon(delay, how="kill"):
    def go():
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSEGV)
    threading.Thread(target=go, daemon=True).start()

def slow(seconds):
    time.sleep(seconds)
    return seconds

def mul(x, w):
    return x * w

def ones():
    return torch.ones(3)

W = torch.nn.Parameter(torch.ones(3))

def weight():
    return rpc.RRef(W)

KEPT = []

def keep(rref):
    KEPT.append(rref)

def wait_until(condition, limit=60.0):
    # poll condition until it holds (an event), at most limit s; return it
    deadline = time.monotonic() + limit
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()

def failed(name):
    return name in [w.name for w in rpc.failed_workers()]

def contexts():
    return int(dist_autograd._get_debug_info()["num_autograd_contexts"])

def report(**values):
    from mpi4py import MPI   # (also after shutdown)
    print("REPORT", f"worker{MPI.COMM_WORLD.Get_rank()}", repr(values), flush=True)
"""


def reports(out: str) -> dict[str, dict]:
    """``{worker name: values}`` of the REPORT lines of a job's output."""
    found: dict[str, dict] = {}
    for name, values in re.findall(r"^REPORT (\S+) (\{.*\})$", out, re.M):
        found.setdefault(name, {}).update(eval(values))  # noqa: S307 - our own repr
    return found


@pytest.mark.parametrize("how", ["kill", "segfault"])
def test_calls_rrefs_and_shutdown_survive_a_lost_worker(job, how):
    result = job(PRELUDE + f"""
import atexit
hook, exit_fn = sys.excepthook, sys.exit
registered = []   # the exit hooks registered now (atexit does not say)
real_register, real_unregister = atexit.register, atexit.unregister

def register(fn):
    registered.append(fn.__name__)
    return real_register(fn)

def unregister(fn):
    registered[:] = [name for name in registered if name != fn.__name__]
    real_unregister(fn)

atexit.register, atexit.unregister = register, unregister
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 0:
    held = rpc.remote("worker2", ones)
    held.to_here()
    pending = rpc.rpc_async("worker2", slow, args=(60,), timeout=0)
    rpc.rpc_sync("worker2", die_soon, args=(0.3, {how!r}))
    try:
        pending.wait()
        report(pending="no error")
    except rpc.WorkerFailedError as exc:
        report(pending=(type(exc).__name__, exc.worker_name, exc.rank,
                        isinstance(exc, RuntimeError)))
    try:
        rpc.rpc_sync("worker2", slow, args=(0,))
    except rpc.WorkerFailedError as exc:
        report(new_call=exc.worker_name)
    try:
        held.to_here()
    except rpc.WorkerFailedError as exc:
        report(rref=exc.worker_name)
    report(survivor=rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist(),
           failed=[w.name for w in rpc.failed_workers()])
    del held
elif me == 1:
    owned = rpc.RRef(torch.zeros(2))
    rpc.rpc_sync("worker2", keep, args=(owned,))   # worker2 holds a fork of it
    del owned                                       # now only worker2's fork keeps it
    before = int(rpc.api._get_debug_info()["num_owner_rrefs"])
    wait_until(lambda: failed("worker2"))
    wait_until(lambda: int(rpc.api._get_debug_info()["num_owner_rrefs"]) == 0)
    report(failed=[w.name for w in rpc.failed_workers()], owned_before=before,
           owned_after=int(rpc.api._get_debug_info()["num_owner_rrefs"]))
rpc.shutdown()
report(shutdown=True, hooks=(sys.excepthook is hook, sys.exit is exit_fn,
                             getattr(sys.exit, "previous", None) is exit_fn, registered))
""", nprocs=3, timeout=90, launcher=FT)
    out = result.stdout + result.stderr
    seen = reports(out)
    w0, w1 = seen.get("worker0", {}), seen.get("worker1", {})
    assert w0.get("pending") == ("WorkerFailedError", "worker2", 2, True), out
    assert w0["new_call"] == "worker2", out
    assert w0["rref"] == "worker2", out
    assert w0["survivor"] == [2.0, 2.0] and w0["failed"] == ["worker2"], out
    assert w1["failed"] == ["worker2"], out
    assert (w1["owned_before"], w1["owned_after"]) == (1, 0), out  # the dead fork let go
    assert w0.get("shutdown") and w1.get("shutdown"), out
    # after a shutdown that lost a worker, sys.excepthook is the program's again; what
    # stays on purpose, for the rest of the process: the exit hook that leaves without
    # MPI_Finalize (which would wait for the dead rank forever) and the sys.exit that
    # keeps its status for it (api._keep_exit_without_finalize says why)
    for survivor in (w0, w1):
        assert survivor["hooks"] == (True, False, True, ["_skip_finalize_after_failures"]), out
    assert "worker2" not in seen


def test_backward_and_optimizer_step_raise_and_release_on_survivors(job):
    result = job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 0:
    x = torch.ones(3, requires_grad=True)
    w1, w2 = rpc.rpc_sync("worker1", weight), rpc.rpc_sync("worker2", weight)
    opt = DistributedOptimizer(torch.optim.SGD, [w1, w2, rpc.RRef(x)], lr=0.1)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", mul, args=(x, 2.0)) + \\
            rpc.rpc_sync("worker2", mul, args=(x, 3.0))
        rpc.rpc_sync("worker2", die_soon, args=(0.05,))
        wait_until(lambda: failed("worker2"))
        try:
            dist_autograd.backward(ctx, [y.sum()])
            report(backward="no error")
        except rpc.WorkerFailedError as exc:
            report(backward=exc.worker_name)
    try:
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [rpc.rpc_sync("worker1", mul, args=(x, 2.0)).sum()])
            opt.step(ctx)
        report(step="no error")
    except rpc.WorkerFailedError as exc:
        report(step=exc.worker_name)
    with dist_autograd.context() as ctx:   # among the survivors, all as before
        dist_autograd.backward(ctx, [rpc.rpc_sync("worker1", mul, args=(x, 2.0)).sum()])
        DistributedOptimizer(torch.optim.SGD, [w1, rpc.RRef(x)], lr=0.5).step(ctx)
    report(x=x.tolist(), w1=rpc.rpc_sync("worker1", torch.clone, args=(W,)).tolist())
    del w1, w2, opt
wait_until(lambda: contexts() == 0)
report(contexts=contexts())
rpc.shutdown()
""", nprocs=3, timeout=90, launcher=FT)
    out = result.stdout + result.stderr
    seen = reports(out)
    w0 = seen.get("worker0", {})
    assert w0.get("backward") == "worker2" and w0.get("step") == "worker2", out
    assert w0["x"] == [0.0, 0.0, 0.0], out        # 1 - 0.5 * d(2x)/dx
    assert w0["w1"] == [1.0, 1.0, 1.0], out       # W is not in that graph
    assert w0["contexts"] == 0 and seen["worker1"]["contexts"] == 0, out


def test_contexts_of_a_lost_worker_are_released_and_a_crash_is_a_failure(job):
    result = job(PRELUDE + """
rpc.init_rpc()
me = rpc.get_worker_info().id
if me == 2:
    x = torch.ones(3, requires_grad=True)
    ctx = dist_autograd.context().__enter__()   # never left: this rank crashes in it
    rpc.rpc_sync("worker1", mul, args=(x, 2.0))
    rpc.rpc_sync("worker0", mul, args=(x, 2.0))
    raise RuntimeError("rank 2 crashed")        # uncaught: this rank exits, the job goes on
wait_until(lambda: failed("worker2") and contexts() == 0)
report(contexts=contexts(), failed=[w.name for w in rpc.failed_workers()])
rpc.shutdown()
report(shutdown=True)
""", nprocs=3, timeout=90, launcher=FT)
    out = result.stdout + result.stderr
    seen = reports(out)
    for name in ("worker0", "worker1"):
        assert seen[name]["contexts"] == 0 and seen[name]["failed"] == ["worker2"], out
        assert seen[name]["shutdown"], out
    assert "this rank exits and the other ranks of this fault-tolerant job go on" in out


def test_ft_launcher_refuses_what_cannot_survive_a_rank():
    argv, env = build_command(2, ["prog.py"], use_srun=False, ft=True)
    assert argv[1:3] == ["--with-ft", "ulfm"] and env["MPIDAG_FT"] == "1"
    with pytest.raises(RuntimeError, match="srun cannot keep a job alive"):
        build_command(2, ["prog.py"], use_srun=True, ft=True)
    with pytest.raises(RuntimeError, match="is not Open MPI's"):
        build_command(2, ["prog.py"], use_srun=False, mpirun="/bin/true", ft=True)


def _parameter_server(nprocs: int, fail_rank: int, fail_step: int) -> str:
    """Output of the parameter-server example under --ft with one rank killing itself."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    run = subprocess.run(
        [sys.executable, "-m", "mpidag.run", "--ft", "-n", str(nprocs),
         str(ROOT / "examples" / "parameter_server.py"), "--fail-rank", str(fail_rank),
         "--fail-step", str(fail_step)], capture_output=True, text=True, timeout=120)
    return run.stdout + run.stderr


def test_parameter_server_example_trains_on_when_a_trainer_is_lost():
    out = _parameter_server(4, fail_rank=2, fail_step=5)
    assert "[parameter_server] trainer_2 was lost (its rank failed); training goes on with 2 " \
           "trainer(s)" in out, out
    assert "OK parameter_server: world_size=4 trainers=2 steps=40" in out, out
    assert "[trainer_1] training complete" in out and "[trainer_3] training complete" in out


def test_parameter_server_example_trainers_stop_when_the_server_is_lost():
    out = _parameter_server(3, fail_rank=0, fail_step=6)
    for rank in (1, 2):
        assert f"[trainer_{rank}] the parameter server failed" in out, out
        assert f"[trainer_{rank}] training complete" not in out, out
    assert "OK parameter_server" not in out
