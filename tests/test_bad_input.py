"""Bad input is refused on the caller, at once, naming the argument and the fix.

torch reports most of these late and far from the mistake (a remote ``TypeError`` of
``func(*args)``, a negative timeout that times every call out at once, a duplicate name or
a wrong world size as a store timeout); mpidag raises them before anything is sent, with
torch's type (or a subclass of it). The call checks run over the in-process transport with
the public API (its runtime installed as the current one); the ``init_rpc`` checks run in
real MPI jobs (each test starts its own ``mpirun``, so a hang is a failed assertion).
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable, Iterator

import pytest
import torch

import mpidag.rpc as rpc
from mpidag import _runtime
from mpidag._runtime import Runtime
from mpidag.agent.options import UNSET_RPC_TIMEOUT, check_timeout
from mpidag.errors import InvalidArgumentError
from tests import rpc_funcs as rf
from tests.test_inproc import TIMEOUT, on_every_rank, settle, start_world


def _exit_with(code: int) -> None:
    raise SystemExit(code)


@pytest.fixture
def world() -> Iterator[list[Runtime]]:
    """Two in-process ranks; rank 0's runtime is the current one (``mpidag.rpc.*``)."""
    runtimes = start_world(2)
    _runtime.install(runtimes[0])
    try:
        yield runtimes
    finally:
        _runtime.uninstall(runtimes[0])
        on_every_rank(2, lambda r: runtimes[r].shutdown(graceful=True, timeout=TIMEOUT))


CALLS: dict[str, Callable[..., object]] = {
    "rpc_sync": lambda **kw: rpc.rpc_sync("worker1", rf.add, **kw),
    "rpc_async": lambda **kw: rpc.rpc_async("worker1", rf.add, **kw).wait(),
    "remote": lambda **kw: rpc.remote("worker1", rf.add, **kw).to_here(),
}


# ------------------------------------------------------------------------ args / kwargs
@pytest.mark.parametrize("api", sorted(CALLS))
@pytest.mark.parametrize("bad, expected", [
    (dict(args=5), "args must be a tuple (or list) of the positional arguments of add, got "
                   "int: 5; for one argument write args=(5,)"),
    (dict(args="ab"), "args must be a tuple (or list) of the positional arguments of add, "
                      "got str: 'ab'; for one argument write args=('ab',)"),
    (dict(args=(1, 2), kwargs=[1]), "kwargs must be a dict of the keyword arguments of add, "
                                    "got list: [1]; positional arguments go in args=(...)"),
    (dict(args=(1,), kwargs={1: 2}), "kwargs of add must have str keys (argument names), "
                                     "got 1"),
])
def test_args_and_kwargs_of_the_wrong_type_raise_on_the_caller(world, api, bad, expected):
    agent = world[0].agent
    sent = agent.sent
    with pytest.raises(TypeError) as info:
        CALLS[api](**bad)
    assert str(info.value) == expected
    assert agent.sent == sent  # refused before anything was sent


def test_args_as_a_list_and_kwargs_as_a_mapping_still_work(world):
    from types import MappingProxyType

    assert rpc.rpc_sync("worker1", rf.add, args=[1, 2]) == 3
    assert rpc.rpc_sync("worker1", rf.add, args=(1,), kwargs=MappingProxyType({"b": 5})) == 6
    assert rpc.remote("worker1", rf.add, args=[2], kwargs={"b": 2}).to_here() == 4
    assert rpc.rpc_async("worker1", rf.add, args=(), kwargs={"a": 1, "b": 1}).wait() == 2


# ----------------------------------------------------------------------------- timeouts
def _timed(call: Callable[..., object]) -> Callable[..., object]:
    return lambda world, t: call(args=(1, 2), timeout=t)


def _rref(world):
    return rpc.remote("worker1", torch.ones, args=(2,))


TIMED: dict[str, Callable[..., object]] = {
    **{name: _timed(call) for name, call in CALLS.items()},
    "to_here": lambda world, t: _rref(world).to_here(timeout=t),
    "rref.rpc_sync()": lambda world, t: _rref(world).rpc_sync(timeout=t).size(),
    "rref.rpc_async()": lambda world, t: _rref(world).rpc_async(timeout=t).size().wait(),
    "rref.remote()": lambda world, t: _rref(world).remote(timeout=t).size().to_here(),
    "rref._get_type()": lambda world, t: _rref(world)._get_type(timeout=t),
}


@pytest.mark.parametrize("api", sorted(TIMED))
@pytest.mark.parametrize("timeout", [-5, -0.25, float("nan")], ids=["-5", "-0.25", "nan"])
def test_negative_or_nan_timeout_raises_at_once(world, api, timeout):
    """torch takes these and fails the call with a timeout; mpidag refuses them with an
    error that is a ValueError and torch's RuntimeError."""
    with pytest.raises(InvalidArgumentError) as info:
        TIMED[api](world, timeout)
    exc = info.value
    assert isinstance(exc, ValueError) and isinstance(exc, RuntimeError)
    assert str(exc) == (
        f"timeout={timeout!r} is not a valid timeout: pass seconds >= 0 (0: no timeout), or "
        f"leave timeout= out (UNSET_RPC_TIMEOUT, -1.0) for the default timeout of the backend "
        f"options (rpc_timeout)")


@pytest.mark.parametrize("api", sorted(TIMED))
@pytest.mark.parametrize("timeout", [UNSET_RPC_TIMEOUT, -1, 0, 30, math.inf, None],
                         ids=["unset", "-1", "0", "30", "inf", "None"])
def test_the_sentinel_zero_and_positive_timeouts_still_work(world, api, timeout):
    result = TIMED[api](world, timeout)
    expected = {"to_here": torch.ones(2), "rref._get_type()": torch.Tensor}.get(
        api, torch.Size([2]) if api.startswith("rref.") else 3)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(result, expected)
    else:
        assert result == expected


def test_a_timeout_that_is_no_number_raises_a_type_error_naming_it(world):
    with pytest.raises(TypeError, match=r"^timeout must be a number of seconds \(0: no "
                                        r"timeout\), got str: '5'$"):
        rpc.rpc_sync("worker1", rf.add, args=(1, 2), timeout="5")
    with pytest.raises(TypeError, match="got bool: True"):
        _rref(world).to_here(timeout=True)


def test_check_timeout_keeps_torchs_rules():
    assert check_timeout(2) == 2 and check_timeout(0.5) == 0.5
    assert check_timeout(0) == 0                       # no timeout
    assert check_timeout(UNSET_RPC_TIMEOUT) == UNSET_RPC_TIMEOUT  # the default
    assert check_timeout(-1) == UNSET_RPC_TIMEOUT and check_timeout(None) == UNSET_RPC_TIMEOUT
    assert check_timeout(math.inf) == 0.0              # no timeout, not an overflow
    with pytest.raises(InvalidArgumentError, match=r"^timeout=-1\.5 is not a valid"):
        check_timeout(-1.5)


# ----------------------------------------------------------------------------------- to
@pytest.mark.parametrize("to", [1.5, 1.0, None, b"worker1"])
def test_a_destination_that_is_no_worker_raises_a_value_error_naming_to(world, to):
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync(to, rf.add, args=(1, 2))
    assert isinstance(info.value, RuntimeError)  # InvalidArgumentError, torch's ValueError
    assert str(info.value) == (
        f"Cannot get WorkerInfo from name {to}: `to` must be a worker name (str), a "
        f"WorkerInfo or a rank (int), got {type(to).__name__}; workers: "
        f"['worker0', 'worker1']")


def test_bool_destination_is_refused_too(world):
    with pytest.raises(InvalidArgumentError, match="got bool"):
        rpc.remote(True, rf.add, args=(1, 2))


# ------------------------------------------------------------ remote() of a SystemExit
@pytest.mark.parametrize("dst", [1, 0], ids=["other", "self"])
def test_remote_function_raising_system_exit_reaches_to_here_and_frees_the_value(world, dst):
    """Before: the owner's record was never completed, so to_here() timed out and the
    graceful shutdown waited for the fetch that never ended."""
    rref = rpc.remote(dst, _exit_with, args=(3,), timeout=TIMEOUT)
    with pytest.raises(SystemExit) as info:
        rref.to_here(timeout=TIMEOUT)
    assert info.value.code == 3
    del rref, info  # (its traceback holds the RRef)
    settle(world)
    assert [rt.rrefs.debug_info()["num_owner_rrefs"] for rt in world] == [0, 0]
    # the proxies see it too (not counted: pytest keeps the owner's log record of the
    # error, whose traceback holds the owner's handle)
    with pytest.raises(SystemExit):
        rpc.remote(dst, _exit_with, args=(4,)).rpc_sync(timeout=TIMEOUT).size()


# ----------------------------------------------------------------------- init_rpc (MPI)
PRELUDE = """
import sys
import torch
import mpidag.rpc as rpc
from mpidag.errors import RPCError
def add(a, b): return a + b
def report(label, fn):
    try:
        fn()
    except BaseException as e:
        print("RANK", r, label, type(e).__name__, "|", e, flush=True)
    else:
        print("RANK", r, label, "NO-ERROR", flush=True)
"""


def ok(result: subprocess.CompletedProcess) -> str:
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    return out


def test_world_arguments_that_do_not_fit_the_job_raise_at_once_and_leave_nothing_started(job):
    """Each raises on the rank that passed it before any collective call; a rank that
    calls init_rpc alone with world_size=1 (torch's world of one process, rank 0 only: it
    hung in the collective start before) gets a world of its own; afterwards init_rpc()
    works on the whole job."""
    out = ok(job("""
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
""" + PRELUDE + """
if r == 0:  # torch's test_world_size_one: only rank 0 starts a world of one, on COMM_SELF
    rpc.init_rpc("me", rank=0, world_size=1)
    assert rpc.rpc_sync("me", add, args=(2, 3)) == 5
    assert rpc.remote("me", add, args=(1, 1)).to_here() == 2
    assert [w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos()] == ["me"]
    rpc.shutdown()
    print("RANK 0 WORLD-OF-ONE", flush=True)
report("TOO-MANY", lambda: rpc.init_rpc(f"w{r}", rank=r, world_size=3))
report("DYNAMIC", lambda: rpc.init_rpc(f"w{r}", rank=r))
report("NONE", lambda: rpc.init_rpc(world_size=None))
report("RANK", lambda: rpc.init_rpc(rank=1 - r, world_size=2))
rpc.init_rpc(f"w{r}", rank=r, world_size=2)      # nothing was left half-started
assert rpc.rpc_sync(f"w{1 - r}", add, args=(r, 1)) == r + 1
rpc.shutdown()
print("RANK", r, "STARTED-AFTERWARDS", flush=True)
""", timeout=120))
    assert "RANK 0 WORLD-OF-ONE" in out, out
    for r in (0, 1):
        assert (f"RANK {r} TOO-MANY ValueError | init_rpc(world_size=3) but the MPI job has 2 "
                f"ranks: launch with `python -m mpidag.run -n 3 ...`") in out, out
        assert (f"RANK {r} DYNAMIC ValueError | init_rpc(rank={r}) without a world_size is "
                f"torch's dynamic membership (workers that join and leave one by one), which "
                f"mpidag does not have: the RPC world is the MPI job (2 ranks), started and "
                f"shut down together. Pass world_size=2, or leave out rank= too") in out, out
        assert (f"RANK {r} NONE ValueError | init_rpc(world_size=None) needs a rank (torch's "
                f"dynamic membership), which mpidag does not have: the RPC world is the MPI "
                f"job (2 ranks). Leave world_size= out, or pass world_size=2") in out, out
        assert (f"RANK {r} RANK ValueError | init_rpc(rank={1 - r}) but this process is MPI "
                f"rank {r} of 2: ranks come from the MPI launcher") in out, out
        assert f"RANK {r} STARTED-AFTERWARDS" in out
    assert "NO-ERROR" not in out


def test_a_wrong_world_size_on_one_rank_ends_the_job_instead_of_hanging(job):
    """Only rank 1 passes a wrong world size: it raises at once, and, uncaught, aborts the
    job (rank 0 waits for it in init_rpc, and rank 1's MPI_Finalize would wait for rank
    0: without the abort both hung)."""
    result = job("""
import mpidag.rpc as rpc
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
rpc.init_rpc(world_size=7 if r == 1 else 2)
print("RANK", r, "STARTED", flush=True)
""", timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "ValueError: init_rpc(world_size=7) but the MPI job has 2 ranks" in out, out
    assert "mpidag: init_rpc failed on this rank alone (above); aborting the MPI job" in out
    assert "STARTED" not in out


def test_duplicate_worker_names_raise_torchs_runtime_error_on_every_rank(job):
    out = ok(job("""
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
""" + PRELUDE + """
report("DUP", lambda: rpc.init_rpc("same" if r < 2 else "other"))
rpc.init_rpc()                                    # the failed start left nothing behind
rpc.shutdown()
""", nprocs=3, timeout=120))
    for r in range(3):  # rank 2's own name was unique: it is told all the same
        assert (f"RANK {r} DUP RPCError | RPC worker name same is not unique. Workers 0 and 1 "
                f"share the same name: every rank needs a name of its own "
                f"(init_rpc(name=...)); leave name= out for worker{{rank}}. Names by rank: "
                f"['same', 'same', 'other']") in out, out
    assert "NO-ERROR" not in out


def test_a_thread_level_below_serialized_is_refused_on_every_rank(job):
    out = ok(job("""
import mpi4py
mpi4py.rc.thread_level = "funneled"
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
""" + PRELUDE + """
report("LEVEL", rpc.init_rpc)
MPI.COMM_WORLD.Barrier()                          # MPI itself is usable, nothing hangs
print("RANK", r, "EXITS", flush=True)
""", timeout=120))
    for r in (0, 1):
        assert (f"RANK {r} LEVEL RPCError | init_rpc needs MPI_THREAD_MULTIPLE, but MPI runs "
                f"with MPI_THREAD_FUNNELED (mpi4py.rc.thread_level = 'funneled'): mpidag serves "
                f"and sends calls on several threads. Set mpi4py.rc.thread_level = "
                f"\"multiple\" (mpi4py's default) before the first `from mpi4py import MPI`, or "
                f"drop the line that lowers it") in out, out
        assert f"RANK {r} EXITS" in out


def test_init_rpc_in_a_spawned_child_of_a_rank_is_refused_before_mpi_starts(job):
    """torch.multiprocessing.spawn under mpirun: the children inherit the launcher's
    variables and would start MPI again as their parent's rank (a hang or a crash)."""
    out = ok(job("""
import torch.multiprocessing as mp
import mpidag.rpc as rpc

def worker(i):
    rpc.init_rpc(f"worker{i}", rank=i, world_size=2)

if __name__ == "__main__":
    try:
        mp.spawn(worker, nprocs=1)
    except Exception as e:
        print("PARENT SAW", type(e).__name__, "|", e, flush=True)
""", nprocs=1, timeout=120))
    assert "RPCError: init_rpc called in a child process of MPI rank 0" in out, out
    assert ("drop mp.spawn and launch one rank per worker with `python -m mpidag.run -n N "
            "prog.py` (or mpirun -n N), calling init_rpc in every rank") in out, out
    assert "PARENT SAW ProcessRaisedException" in out


def test_check_world_refuses_bad_types_before_mpi():
    from mpidag.rpc.api import _check_world

    assert str(_check_world("0", 2, 0, 2)) == "rank must be a non-negative int or -1, got '0'"
    assert str(_check_world(0, 2.0, 0, 2)) == "world_size must be a positive int, got 2.0"
    assert _check_world(-1, 2, 0, 2) is None and _check_world(None, 2, 1, 2) is None
    assert isinstance(_check_world(0, 2, 1, 2), ValueError)
