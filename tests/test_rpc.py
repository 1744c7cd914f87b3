"""rpc_sync / rpc_async across ranks: values, tensors, nesting, errors, timeouts.

Run with ``mpirun -n 2`` (and ``-n 3``) ``python -m pytest --with-mpi -m mpi tests``.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import mpidag.rpc as rpc
from mpidag.errors import RemoteTraceback, RPCTimeoutError, SerializationError
from tests import rpc_funcs as f
from tests.conftest import profiled_names
from tests.test_frames import DTYPES, sample

pytestmark = pytest.mark.mpi(min_size=2)


def test_sync_to_every_rank_by_name_rank_and_workerinfo(rpc_world):
    for dst in range(rpc_world.size):
        info = rpc.get_worker_info(f"worker{dst}")
        assert info.id == dst and info.name == f"worker{dst}"
        for to in (f"worker{dst}", dst, info):
            assert rpc.rpc_sync(to, f.whoami, timeout=10) == f"worker{dst}"
            got = rpc.rpc_sync(to, f.add, args=(rpc_world.rank, 10), timeout=10)
            assert got == rpc_world.rank + 10


def test_kwargs_and_builtin_functions(rpc_world):
    out = rpc.rpc_sync(rpc_world.next, torch.add, args=(torch.ones(3),), kwargs={"other": 2},
                       timeout=10)
    torch.testing.assert_close(out, torch.full((3,), 3.0))


def test_async_many_in_flight_to_all_ranks(rpc_world):
    futs = [rpc.rpc_async(i % rpc_world.size, f.add, args=(i, 1), timeout=30) for i in range(500)]
    assert isinstance(futs[0], torch.futures.Future)
    assert [fut.wait() for fut in futs] == [i + 1 for i in range(500)]
    futs = [rpc.rpc_async(rpc_world.next, f.add, args=(i, 2), timeout=30) for i in range(200)]
    assert torch.futures.wait_all(futs) == [i + 2 for i in range(200)]


def test_future_then_and_callbacks(rpc_world):
    fut = rpc.rpc_async(rpc_world.next, f.add, args=(1, 2), timeout=10)
    chained = fut.then(lambda x: x.value() * 10)
    assert chained.wait() == 30


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_dtypes_round_trip(rpc_world, dtype):
    small, big = sample(dtype), sample(dtype, (300, 120))
    a, b = rpc.rpc_sync(rpc_world.next, f.identity, args=((small, big),), timeout=30)
    for sent, got in ((small, a), (big, b)):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8))


def test_views_noncontiguous_zero_size_and_structure(rpc_world):
    base = torch.arange(120.0).reshape(10, 12)
    views = {"t": base.t(), "strided": base[::3, 1::4], "row": base[7], "empty": base[:0],
             "scalar": torch.tensor(5.5), "expanded": torch.ones(1, 4).expand(1000, 4)}
    got = rpc.rpc_sync(rpc_world.next, f.identity, args=(views,), timeout=30)
    for key, sent in views.items():
        torch.testing.assert_close(got[key], sent)
    t = torch.randn(4, requires_grad=True)
    desc = rpc.rpc_sync(rpc_world.next, f.describe_tensors,
                        args=({"a": t, "b": torch.zeros(2), "nested": [t]},), timeout=10)
    assert desc == {"same": True, "shapes": [(4,), (2,)], "requires_grad": [True, False]}


@pytest.mark.parametrize("nbytes", [1024, 1 << 20, 64 << 20])
def test_tensor_echo_sizes(rpc_world, nbytes):
    x = torch.randn(nbytes // 4)
    y = rpc.rpc_sync(rpc_world.next, f.identity, args=(x,), timeout=60)
    assert torch.equal(x, y)
    y2 = rpc.rpc_sync(rpc_world.next, f.identity, args=(x * 2,), timeout=60)  # recycled buffers
    assert torch.equal(x * 2, y2) and torch.equal(x, y)


def test_tensor_larger_than_2gib(rpc_world):
    if rpc_world.rank != 0:
        return
    nbytes = (1 << 31) + (1 << 20)  # past the int32 count limit of MPI 3 calls
    n, strided_sum, last, dtype = rpc.rpc_sync(rpc_world.next, f.big_tensor_check,
                                               args=(f.make_big(nbytes),), timeout=120)
    expected = f.make_big(nbytes)
    assert n == expected.numel() and dtype == torch.int32
    assert last == float(expected[-1])
    assert strided_sum == float(expected[:: 1 << 20].double().sum())
    del expected
    back = rpc.rpc_sync(rpc_world.next, f.make_big, args=(nbytes,), timeout=120)
    assert back.numel() == nbytes // 4 and int(back[-1]) == nbytes // 4 - 1


@pytest.mark.parametrize("kind", ["bytes", "numpy"])
def test_non_tensor_payload_larger_than_2gib(rpc_world, kind):
    """bytes go in the pickle (the payload travels as its own chunked frame); numpy arrays
    travel out of band like tensors (no copy into the pickle)."""
    if rpc_world.rank != 0:
        return
    nbytes = (1 << 31) + (1 << 20) + 7  # past the int32 count limit of MPI 3 calls
    payload = f.make_large_payload(kind, nbytes)
    expected = f.payload_digest(payload)
    got = rpc.rpc_sync(rpc_world.next, f.payload_digest, args=(payload,), timeout=300)
    del payload
    assert got == (("bytes" if kind == "bytes" else "ndarray"), *expected[1:])


def test_base_exceptions_reach_the_caller_and_the_rank_keeps_serving(rpc_world):
    """SystemExit and other BaseExceptions of a remote function are the call's answer,
    with their type; the serving thread survives (before: it died, the call hung)."""
    with pytest.raises(SystemExit) as info:
        rpc.rpc_sync(rpc_world.next, f.raise_system_exit, args=(3,), timeout=20)
    assert info.value.code == 3
    with pytest.raises(f.Interrupted, match="stop here"):
        rpc.rpc_async(rpc_world.next, f.raise_base_exception, args=("stop here",),
                      timeout=20).wait()
    # every pool thread of the callee still serves: more concurrent calls than threads
    futs = [rpc.rpc_async(rpc_world.next, f.add, args=(i, 1), timeout=20) for i in range(40)]
    assert [fut.wait() for fut in futs] == list(range(1, 41))


def test_calls_to_self(rpc_world):
    t = torch.randn(3)
    out = rpc.rpc_sync(rpc_world.name, f.identity, args=(t,), timeout=10)
    assert torch.equal(out, t) and out is not t  # copy semantics, as for remote calls
    assert rpc.rpc_async(rpc_world.rank, f.add, args=(1, 1), timeout=10).wait() == 2


def test_nested_calls_and_cycles(rpc_world):
    assert rpc.rpc_sync(rpc_world.next, f.nested_add, args=(rpc_world.prev, 2, 3), timeout=30) == 6
    # A -> B -> A -> B -> A: each hop is a nested rpc_sync back to the caller
    path = rpc.rpc_sync(rpc_world.next, f.call_back_to, args=(rpc_world.name, 4), timeout=60)
    assert path == [rpc_world.next, rpc_world.name] * 2 + [rpc_world.next]


def test_concurrent_cycles_from_every_rank(rpc_world):
    futs = [rpc.rpc_async(rpc_world.next, f.call_back_to, args=(rpc_world.name, 3), timeout=60)
            for _ in range(8)]
    for fut in futs:
        assert fut.wait() == [rpc_world.next, rpc_world.name, rpc_world.next, rpc_world.name]


def test_async_execution(rpc_world):
    x = torch.ones(2)
    out = rpc.rpc_sync(rpc_world.next, f.async_add_chained, args=(rpc_world.prev, x, 1, 1),
                       timeout=30)
    torch.testing.assert_close(out, torch.full((2,), 3.0))
    with pytest.raises(ValueError, match="inner failure"):
        rpc.rpc_sync(rpc_world.next, f.async_fail, args=(rpc_world.prev,), timeout=30)
    # torch's RuntimeError and wording (still a TypeError), through remote() too
    wrong = ("Functions decorated with @rpc\\.async_function must return a "
             "torch\\.futures\\.Future object,")
    with pytest.raises(TypeError, match="must return a torch.futures.Future") as info:
        rpc.rpc_sync(rpc_world.next, f.async_not_a_future, timeout=30)
    assert isinstance(info.value, RuntimeError) and re.search(wrong, str(info.value))
    with pytest.raises(RuntimeError, match=wrong):
        rpc.rpc_async(rpc_world.next, f.async_not_a_future, timeout=30).wait()
    with pytest.raises(RuntimeError, match=wrong):
        rpc.remote(rpc_world.next, f.async_not_a_future, timeout=30).to_here()
    del info


def test_remote_exception_keeps_type_message_and_traceback(rpc_world):
    with pytest.raises(ValueError, match="bad input 7") as info:
        rpc.rpc_sync(rpc_world.next, f.raise_value_error, args=("bad input 7",), timeout=10)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert f"Remote traceback from {rpc_world.next}" in str(cause)
    assert "raise_value_error" in str(cause)
    fut = rpc.rpc_async(rpc_world.next, f.raise_custom, args=(17,), timeout=10)
    with pytest.raises(f.CustomError) as info:
        fut.wait()
    assert info.value.code == 17 and info.value.detail == "custom detail"


def test_timeout_raises_before_the_reply_and_agent_stays_usable(rpc_world):
    # The callee cannot answer until the test releases it, so the only way these calls
    # end is their timeout: an ordering, not a stopwatch.
    with pytest.raises(RPCTimeoutError, match="timeout") as info:
        rpc.rpc_sync(rpc_world.next, f.wait_for_release, args=("sync", "late"), timeout=0.3)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RuntimeError)
    fut = rpc.rpc_async(rpc_world.next, f.wait_for_release, args=("async", "late"),
                        timeout=0.3)
    with pytest.raises(TimeoutError):
        fut.wait()
    # an un-waited future also fails on its own, through the progress engine
    fut = rpc.rpc_async(rpc_world.next, f.wait_for_release, args=("unwaited", "late"),
                        timeout=0.2)
    deadline = time.monotonic() + 30
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fut.done()
    with pytest.raises(TimeoutError):
        fut.wait()
    assert rpc.rpc_sync(rpc_world.next, f.add, args=(1, 1), timeout=10) == 2
    # the late replies arrive after their callers gave up, and are dropped
    for key in ("sync", "async", "unwaited"):
        assert rpc.rpc_sync(rpc_world.next, f.release, args=(key,), timeout=10)
    assert rpc.rpc_sync(rpc_world.next, f.add, args=(2, 2), timeout=10) == 4


def test_zero_timeout_means_no_timeout(rpc_world):
    assert rpc.rpc_sync(rpc_world.next, f.sleep_then, args=(0.2, "ok"), timeout=0) == "ok"


def test_unknown_workers(rpc_world):
    with pytest.raises(ValueError, match="unknown destination worker 'nobody'") as info:
        rpc.rpc_sync("nobody", f.noop)
    assert isinstance(info.value, RuntimeError)  # what torch raises, too
    with pytest.raises(ValueError, match="unknown destination rank 99"):
        rpc.rpc_async(99, f.noop)
    with pytest.raises(ValueError, match="not a worker of this job"):
        rpc.rpc_sync(rpc.WorkerInfo("worker0", 57), f.noop)
    with pytest.raises(ValueError, match="unknown destination worker"):
        rpc.get_worker_info("nobody")
    with pytest.raises(ValueError, match="Cannot get WorkerInfo from name 1.5: `to` must be a "
                                         "worker name"):  # torch's type and wording
        rpc.rpc_sync(1.5, f.noop)
    with pytest.raises(TypeError, match="callable"):
        rpc.rpc_sync(rpc_world.next, "not callable")


def test_unpicklable_argument_fails_on_caller(rpc_world):
    import threading

    with pytest.raises(SerializationError, match="could not pickle the call of") as info:
        rpc.rpc_sync(rpc_world.next, f.identity, args=(threading.Lock(),), timeout=10)
    assert isinstance(info.value, TypeError)
    with pytest.raises(SerializationError):
        rpc.rpc_async(rpc_world.next, lambda: 1)
    assert rpc.rpc_sync(rpc_world.next, f.add, args=(1, 2), timeout=10) == 3


def test_unpicklable_return_value_and_callee_keeps_serving(rpc_world):
    with pytest.raises(SerializationError, match="could not be sent back from"):
        rpc.rpc_sync(rpc_world.next, f.return_unpicklable, timeout=10)
    assert rpc.rpc_sync(rpc_world.next, f.add, args=(1, 2), timeout=10) == 3


def _defined_only_on_rank_zero():
    return "found"


def test_function_missing_on_callee(rpc_world):
    # rank 0 publishes a function under a module name that only it has
    import sys
    import types

    mod = types.ModuleType("only_on_rank_zero")
    mod.func = _defined_only_on_rank_zero
    _defined_only_on_rank_zero.__module__ = "only_on_rank_zero"
    _defined_only_on_rank_zero.__qualname__ = "func"
    try:
        if rpc_world.rank == 0:
            sys.modules["only_on_rank_zero"] = mod
            with pytest.raises(ModuleNotFoundError, match="must be importable on the callee"
                               ) as info:
                rpc.rpc_sync("worker1", _defined_only_on_rank_zero, timeout=10)
            # torch's RuntimeError and wording (test_function_not_on_callee)
            assert isinstance(info.value, RuntimeError)
            assert "Default RPC pickler does not serialize function code" in str(info.value)
            del info
            assert rpc.rpc_sync("worker0", _defined_only_on_rank_zero, timeout=10) == "found"
            assert rpc.rpc_sync("worker1", f.add, args=(1, 2), timeout=10) == 3
    finally:
        sys.modules.pop("only_on_rank_zero", None)


def test_many_threads_calling_at_once(rpc_world):
    import concurrent.futures as cf

    def work(i):
        t = torch.full((100,), float(i))
        return float(rpc.rpc_sync(i % rpc_world.size, f.add, args=(t, 1), timeout=30).sum())

    with cf.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(work, range(200))) == [100.0 * (i + 1) for i in range(200)]



def test_profiler_ranges_on_caller_and_callee(rpc_world):
    me, nxt, prv = rpc_world.name, rpc_world.next, rpc_world.prev

    def calls():
        assert rpc.rpc_sync(nxt, f.add, args=(1, 2), timeout=10) == 3
        assert rpc.rpc_async(nxt, f.async_add_chained, args=(me, 1, 2, 3), timeout=10).wait() == 6

    names = profiled_names(calls)
    add, chained = "tests.rpc_funcs.add", "tests.rpc_funcs.async_add_chained"
    assert f"mpidag.rpc#{add}({me} -> {nxt})" in names, sorted(names)
    assert f"mpidag.rpc#{chained}({me} -> {nxt})" in names
    # served here for the previous rank, in a pool thread: the callee's side of its calls
    assert f"mpidag.rpc.serve#{add}({prv} -> {me})" in names, sorted(names)
    assert f"mpidag.rpc.serve#{chained}({prv} -> {me})" in names
    # the async function called back into its caller: that nested call is served here too
    assert f"mpidag.rpc#{add}({nxt} -> {me})" not in names  # made on the next rank, not here
    assert f"mpidag.rpc.serve#{add}({nxt} -> {me})" in names


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_legacy_profiler_records_torchs_keys_and_the_callees_events(rpc_world):
    """Under torch's legacy profiler (the one torch profiles RPCs with) a call is a range
    named by torch's key, and what ran on the callee comes back as remote events with the
    callee's rank, nested calls under both keys."""
    from torch.autograd.profiler_legacy import profile

    me, nxt = rpc_world.name, rpc_world.next
    with profile() as prof:
        fut = rpc.rpc_async(nxt, torch.mul, args=(torch.ones(2), 3), timeout=10)
        assert fut.wait().tolist() == [3.0, 3.0]
        assert rpc.rpc_sync(nxt, f.nested_add, args=(me, 1, 2), timeout=10) == 4
    events = prof.function_events
    key = f"rpc_async#aten::mul({me} -> {nxt})"
    ranges = [e for e in events if e.name == key]
    assert len(ranges) == 1 and ranges[0].node_id == rpc_world.rank
    mul = [e for e in events if e.name == f"{key}#remote_op: aten::mul"]
    assert len(mul) == 1 and mul[0].is_remote
    assert mul[0].node_id == (rpc_world.rank + 1) % rpc_world.size
    nested = f"rpc_sync#nested_add({me} -> {nxt})#remote_op: rpc_sync#add({nxt} -> {me})"
    assert nested in {e.name for e in events if e.is_remote}, sorted(e.name for e in events)


@pytest.mark.parametrize("collective", ["barrier", "bcast", "allgather", "Allreduce"])
def test_calls_are_served_while_a_rank_waits_in_its_own_mpi_collective(rpc_world, collective):
    """The user's own MPI calls on COMM_WORLD (mpidag uses a private duplicate) do not stop a
    rank from serving RPCs while it waits in them (docs/quickstart.md)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if rpc_world.rank == 0:  # the others are inside the collective meanwhile
        for dst in range(1, rpc_world.size):
            assert rpc.rpc_sync(dst, f.add, args=(dst, 1), timeout=20) == dst + 1
    if collective == "barrier":
        comm.barrier()
    elif collective == "bcast":
        assert comm.bcast("go" if rpc_world.rank == 0 else None, root=0) == "go"
    elif collective == "allgather":
        assert comm.allgather(rpc_world.rank) == list(range(rpc_world.size))
    else:
        value = np.array([rpc_world.rank], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, value, op=MPI.MIN)
        assert value[0] == 0


def test_torch_private_agent_helpers_all_gather_barrier_and_debug_info(rpc_world):
    agent = rpc._get_current_rpc_agent()
    infos = agent.get_worker_infos()
    assert [w.id for w in infos] == list(range(rpc_world.size))
    assert agent.get_worker_info().id == rpc_world.rank
    assert agent.get_worker_info(rpc_world.next).id == (rpc_world.rank + 1) % rpc_world.size
    gathered = rpc.api._all_gather(rpc_world.rank * 10)
    assert gathered == {f"worker{r}": r * 10 for r in range(rpc_world.size)}
    # a barrier over a subset: the even ranks and the odd ranks each meet on their own
    group = [w.name for w in infos if w.id % 2 == rpc_world.rank % 2]
    rpc.api._barrier(group)
    again = rpc.api._all_gather(f"x{rpc_world.rank}", worker_names=group)
    assert again == {name: f"x{name[len('worker'):]}" for name in group}
    info = rpc._get_debug_info()
    assert info["agent.num_pending_requests"].isdigit()
    agent_keys = agent.get_debug_info().keys()
    assert agent_keys <= info.keys() and all(k.startswith("agent.") for k in agent_keys)
    assert {"num_owner_rrefs", "num_forks", "num_autograd_contexts"} <= info.keys()


# ------------------------------------------- torch's private helpers and wording (issue 21)


def test_default_timeout_get_set_and_torchs_timeout_wording(rpc_world):
    default = rpc.get_rpc_timeout()
    assert default == rpc.constants.DEFAULT_RPC_TIMEOUT_SEC  # the fixture's options
    try:
        rpc._set_rpc_timeout(0.05)
        assert rpc.get_rpc_timeout() == 0.05
        fut = rpc.rpc_async(rpc_world.next, f.sleep_then, args=(0.5, "late"))  # default
        with pytest.raises(RuntimeError, match="RPC ran for more than") as info:
            fut.wait()
        assert isinstance(info.value, RPCTimeoutError) and "50 ms" in str(info.value)
        assert "sleep_then" in str(info.value)  # mpidag's detail follows torch's words
        rpc._set_rpc_timeout(0)  # none
        assert rpc.rpc_sync(rpc_world.next, f.sleep_then, args=(0.1, "ok")) == "ok"
        with pytest.raises(ValueError, match="rpc_timeout must be"):
            rpc._set_rpc_timeout(-1)
    finally:
        rpc._set_rpc_timeout(default)
    assert rpc.get_rpc_timeout() == default
    del info


def test_wait_all_collects_and_waits_rpc_async_futures(rpc_world):
    from mpidag.rpc.api import _thread_local_var, _wait_all

    with _wait_all():
        assert _thread_local_var.future_list == []
        futs = [rpc.rpc_async(rpc_world.next, f.sleep_then, args=(0.05, i)) for i in range(5)]
        assert _thread_local_var.future_list == futs
    assert not hasattr(_thread_local_var, "future_list")
    assert all(fut.done() for fut in futs) and [fut.value() for fut in futs] == list(range(5))
    with pytest.raises(ValueError, match="Expected error"), _wait_all():
        rpc.rpc_async(rpc_world.next, f.raise_value_error, args=("Expected error",))
    assert not hasattr(_thread_local_var, "future_list")
    with pytest.raises(RuntimeError, match="RPC ran for more than"), _wait_all():
        rpc.rpc_async(rpc_world.next, f.sleep_then, args=(0.5, "late"), timeout=0.05)


def test_builtin_with_wrong_arguments_is_torchs_schema_error(rpc_world):
    pattern = "Overloaded torch operator invoked from Python failed to match any schema"
    with pytest.raises(RuntimeError, match=pattern) as info:
        rpc.rpc_sync(rpc_world.next, torch.add, args=(), timeout=10)
    assert isinstance(info.value, TypeError)  # what torch.add() itself raises
    with pytest.raises(RuntimeError, match=pattern):
        rpc.remote(rpc_world.next, torch.add, args=(), timeout=10).to_here()
    del info


def test_remote_exception_that_cannot_be_rebuilt_names_the_original_as_torch_does(rpc_world):
    with pytest.raises(RuntimeError) as info:
        rpc.rpc_sync(rpc_world.next, f.raise_two_argument_error, timeout=10)
    text = str(info.value)
    assert "TwoArgumentError" in text
    assert "Original exception on remote side was built with two arguments" in text
    assert isinstance(info.value.__cause__, RemoteTraceback)


def test_callbacks_that_wait_for_other_rpcs(rpc_world):
    """torch's test_callback_with_ret: a then() callback that makes an RPC and waits for
    it, a done callback that calls rpc_sync, many at once; each deadlocked the rank whose
    progress leader ran the callback."""
    to = rpc_world.next

    def callback(fut0):
        fut2 = rpc.rpc_async(to, torch.add, args=(fut0.wait(), 1)).then(
            lambda fut1: fut1.wait() + 1)
        return fut2.wait()

    fut3 = rpc.rpc_async(to, torch.add, args=(torch.ones(2, 2), 1), timeout=30).then(callback)
    torch.testing.assert_close(fut3.wait(), torch.ones(2, 2) + 3)

    done: list = []
    fut = rpc.rpc_async(to, f.add, args=(1, 2), timeout=30)
    fut.add_done_callback(lambda x: done.append(rpc.rpc_sync(to, f.add, args=(x.value(), 4),
                                                             timeout=30)))
    fut.wait()
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert done == [7]

    chained = [rpc.rpc_async(to, f.add, args=(i, 1), timeout=30).then(
        lambda x: rpc.rpc_sync(to, f.add, args=(x.wait(), 100), timeout=30))
        for i in range(20)]
    assert torch.futures.wait_all(chained) == [i + 101 for i in range(20)]
