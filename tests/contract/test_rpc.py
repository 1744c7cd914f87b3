"""rpc_sync / rpc_async across ranks: values, tensors, nesting, errors, timeouts.

Contract tests: each runs in-process (2 and 3 ranks as threads) and under MPI (the
``[mpi]`` items, at 2 and 3 ranks); see tests/contract/harness.py.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import mpidag.rpc as rpc
from mpidag.errors import RemoteTraceback, RPCTimeoutError, SerializationError
from tests import rpc_funcs as f
from tests.contract.harness import bound
from tests.test_frames import DTYPES, sample


def test_sync_to_every_rank_by_name_rank_and_workerinfo(world):
    for dst in range(world.size):
        info = rpc.get_worker_info(f"worker{dst}")
        assert info.id == dst and info.name == f"worker{dst}"
        for to in (f"worker{dst}", dst, info):
            assert rpc.rpc_sync(to, f.whoami, timeout=10) == f"worker{dst}"
            got = rpc.rpc_sync(to, f.add, args=(world.rank, 10), timeout=10)
            assert got == world.rank + 10


def test_kwargs_and_builtin_functions(world):
    out = rpc.rpc_sync(world.next, torch.add, args=(torch.ones(3),), kwargs={"other": 2},
                       timeout=10)
    torch.testing.assert_close(out, torch.full((3,), 3.0))


def test_async_many_in_flight_to_all_ranks(world):
    futs = [rpc.rpc_async(i % world.size, f.add, args=(i, 1), timeout=30) for i in range(500)]
    assert isinstance(futs[0], torch.futures.Future)
    assert [fut.wait() for fut in futs] == [i + 1 for i in range(500)]
    futs = [rpc.rpc_async(world.next, f.add, args=(i, 2), timeout=30) for i in range(200)]
    assert torch.futures.wait_all(futs) == [i + 2 for i in range(200)]


def test_future_then_and_callbacks(world):
    fut = rpc.rpc_async(world.next, f.add, args=(1, 2), timeout=10)
    chained = fut.then(lambda x: x.value() * 10)
    assert chained.wait() == 30


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_dtypes_round_trip(world, dtype):
    small, big = sample(dtype), sample(dtype, (300, 120))
    a, b = rpc.rpc_sync(world.next, f.identity, args=((small, big),), timeout=30)
    for sent, got in ((small, a), (big, b)):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8))


def test_views_noncontiguous_zero_size_and_structure(world):
    base = torch.arange(120.0).reshape(10, 12)
    views = {"t": base.t(), "strided": base[::3, 1::4], "row": base[7], "empty": base[:0],
             "scalar": torch.tensor(5.5), "expanded": torch.ones(1, 4).expand(1000, 4)}
    got = rpc.rpc_sync(world.next, f.identity, args=(views,), timeout=30)
    for key, sent in views.items():
        torch.testing.assert_close(got[key], sent)
    t = torch.randn(4, requires_grad=True)
    desc = rpc.rpc_sync(world.next, f.describe_tensors,
                        args=({"a": t, "b": torch.zeros(2), "nested": [t]},), timeout=10)
    assert desc == {"same": True, "shapes": [(4,), (2,)], "requires_grad": [True, False]}


@pytest.mark.parametrize("nbytes", [1024, 1 << 20, 64 << 20])
def test_tensor_echo_sizes(world, nbytes):
    x = torch.randn(nbytes // 4)
    y = rpc.rpc_sync(world.next, f.identity, args=(x,), timeout=60)
    assert torch.equal(x, y)
    y2 = rpc.rpc_sync(world.next, f.identity, args=(x * 2,), timeout=60)  # recycled buffers
    assert torch.equal(x * 2, y2) and torch.equal(x, y)


def test_base_exceptions_reach_the_caller_and_the_rank_keeps_serving(world):
    """SystemExit and other BaseExceptions of a remote function are the call's answer,
    with their type; the serving thread survives (before: it died, the call hung)."""
    with pytest.raises(SystemExit) as info:
        rpc.rpc_sync(world.next, f.raise_system_exit, args=(3,), timeout=20)
    assert info.value.code == 3
    with pytest.raises(f.Interrupted, match="stop here"):
        rpc.rpc_async(world.next, f.raise_base_exception, args=("stop here",),
                      timeout=20).wait()
    # every pool thread of the callee still serves: more concurrent calls than threads
    futs = [rpc.rpc_async(world.next, f.add, args=(i, 1), timeout=20) for i in range(40)]
    assert [fut.wait() for fut in futs] == list(range(1, 41))


def test_calls_to_self(world):
    t = torch.randn(3)
    out = rpc.rpc_sync(world.name, f.identity, args=(t,), timeout=10)
    assert torch.equal(out, t) and out is not t  # copy semantics, as for remote calls
    assert rpc.rpc_async(world.rank, f.add, args=(1, 1), timeout=10).wait() == 2


def test_nested_calls_and_cycles(world):
    assert rpc.rpc_sync(world.next, f.nested_add, args=(world.prev, 2, 3), timeout=30) == 6
    # A -> B -> A -> B -> A: each hop is a nested rpc_sync back to the caller
    path = rpc.rpc_sync(world.next, f.call_back_to, args=(world.name, 4), timeout=60)
    assert path == [world.next, world.name] * 2 + [world.next]


def test_concurrent_cycles_from_every_rank(world):
    futs = [rpc.rpc_async(world.next, f.call_back_to, args=(world.name, 3), timeout=60)
            for _ in range(8)]
    for fut in futs:
        assert fut.wait() == [world.next, world.name, world.next, world.name]


def test_async_execution(world):
    x = torch.ones(2)
    out = rpc.rpc_sync(world.next, f.async_add_chained, args=(world.prev, x, 1, 1),
                       timeout=30)
    torch.testing.assert_close(out, torch.full((2,), 3.0))
    with pytest.raises(ValueError, match="inner failure"):
        rpc.rpc_sync(world.next, f.async_fail, args=(world.prev,), timeout=30)
    # torch's RuntimeError and wording (still a TypeError), through remote() too
    wrong = ("Functions decorated with @rpc\\.async_function must return a "
             "torch\\.futures\\.Future object,")
    with pytest.raises(TypeError, match="must return a torch.futures.Future") as info:
        rpc.rpc_sync(world.next, f.async_not_a_future, timeout=30)
    assert isinstance(info.value, RuntimeError) and re.search(wrong, str(info.value))
    with pytest.raises(RuntimeError, match=wrong):
        rpc.rpc_async(world.next, f.async_not_a_future, timeout=30).wait()
    with pytest.raises(RuntimeError, match=wrong):
        rpc.remote(world.next, f.async_not_a_future, timeout=30).to_here()
    del info


def test_remote_exception_keeps_type_message_and_traceback(world):
    with pytest.raises(ValueError, match="bad input 7") as info:
        rpc.rpc_sync(world.next, f.raise_value_error, args=("bad input 7",), timeout=10)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert f"Remote traceback from {world.next}" in str(cause)
    assert "raise_value_error" in str(cause)
    fut = rpc.rpc_async(world.next, f.raise_custom, args=(17,), timeout=10)
    with pytest.raises(f.CustomError) as info:
        fut.wait()
    assert info.value.code == 17 and info.value.detail == "custom detail"


def test_timeout_raises_before_the_reply_and_agent_stays_usable(world):
    # The callee cannot answer until the test releases it, so the only way these calls
    # end is their timeout: an ordering, not a stopwatch.
    with pytest.raises(RPCTimeoutError, match="timeout") as info:
        rpc.rpc_sync(world.next, f.wait_for_release, args=("sync", "late"), timeout=0.3)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RuntimeError)
    fut = rpc.rpc_async(world.next, f.wait_for_release, args=("async", "late"),
                        timeout=0.3)
    with pytest.raises(TimeoutError):
        fut.wait()
    # an un-waited future also fails on its own, through the progress engine
    fut = rpc.rpc_async(world.next, f.wait_for_release, args=("unwaited", "late"),
                        timeout=0.2)
    deadline = time.monotonic() + 30
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fut.done()
    with pytest.raises(TimeoutError):
        fut.wait()
    assert rpc.rpc_sync(world.next, f.add, args=(1, 1), timeout=10) == 2
    # the late replies arrive after their callers gave up, and are dropped
    for key in ("sync", "async", "unwaited"):
        assert rpc.rpc_sync(world.next, f.release, args=(key,), timeout=10)
    assert rpc.rpc_sync(world.next, f.add, args=(2, 2), timeout=10) == 4


def test_zero_timeout_means_no_timeout(world):
    assert rpc.rpc_sync(world.next, f.sleep_then, args=(0.2, "ok"), timeout=0) == "ok"


def test_unknown_workers(world):
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
        rpc.rpc_sync(world.next, "not callable")


def test_unpicklable_argument_fails_on_caller(world):
    import threading

    with pytest.raises(SerializationError, match="could not pickle the call of") as info:
        rpc.rpc_sync(world.next, f.identity, args=(threading.Lock(),), timeout=10)
    assert isinstance(info.value, TypeError)
    with pytest.raises(SerializationError):
        rpc.rpc_async(world.next, lambda: 1)
    assert rpc.rpc_sync(world.next, f.add, args=(1, 2), timeout=10) == 3


def test_unpicklable_return_value_and_callee_keeps_serving(world):
    with pytest.raises(SerializationError, match="could not be sent back from"):
        rpc.rpc_sync(world.next, f.return_unpicklable, timeout=10)
    assert rpc.rpc_sync(world.next, f.add, args=(1, 2), timeout=10) == 3


def test_many_threads_calling_at_once(world):
    import concurrent.futures as cf

    def work(i):
        t = torch.full((100,), float(i))
        return float(rpc.rpc_sync(i % world.size, f.add, args=(t, 1), timeout=30).sum())

    with cf.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(bound(work), range(200))) == [100.0 * (i + 1) for i in range(200)]



def test_torch_private_agent_helpers_all_gather_barrier_and_debug_info(world):
    agent = rpc._get_current_rpc_agent()
    infos = agent.get_worker_infos()
    assert [w.id for w in infos] == list(range(world.size))
    assert agent.get_worker_info().id == world.rank
    assert agent.get_worker_info(world.next).id == (world.rank + 1) % world.size
    gathered = rpc.api._all_gather(world.rank * 10)
    assert gathered == {f"worker{r}": r * 10 for r in range(world.size)}
    # a barrier over a subset: the even ranks and the odd ranks each meet on their own
    group = [w.name for w in infos if w.id % 2 == world.rank % 2]
    rpc.api._barrier(group)
    again = rpc.api._all_gather(f"x{world.rank}", worker_names=group)
    assert again == {name: f"x{name[len('worker'):]}" for name in group}
    info = rpc._get_debug_info()
    assert info["agent.num_pending_requests"].isdigit()
    agent_keys = agent.get_debug_info().keys()
    assert agent_keys <= info.keys() and all(k.startswith("agent.") for k in agent_keys)
    assert {"num_owner_rrefs", "num_forks", "num_autograd_contexts"} <= info.keys()


# ------------------------------------------- torch's private helpers and wording (issue 21)


def test_default_timeout_get_set_and_torchs_timeout_wording(world):
    default = rpc.get_rpc_timeout()
    assert default == rpc.constants.DEFAULT_RPC_TIMEOUT_SEC  # the fixture's options
    try:
        rpc._set_rpc_timeout(0.05)
        assert rpc.get_rpc_timeout() == 0.05
        fut = rpc.rpc_async(world.next, f.sleep_then, args=(0.5, "late"))  # default
        with pytest.raises(RuntimeError, match="RPC ran for more than") as info:
            fut.wait()
        assert isinstance(info.value, RPCTimeoutError) and "50 ms" in str(info.value)
        assert "sleep_then" in str(info.value)  # mpidag's detail follows torch's words
        rpc._set_rpc_timeout(0)  # none
        assert rpc.rpc_sync(world.next, f.sleep_then, args=(0.1, "ok")) == "ok"
        with pytest.raises(ValueError, match="rpc_timeout must be"):
            rpc._set_rpc_timeout(-1)
    finally:
        rpc._set_rpc_timeout(default)
    assert rpc.get_rpc_timeout() == default
    del info


def test_wait_all_collects_and_waits_rpc_async_futures(world):
    from mpidag.rpc.api import _thread_local_var, _wait_all, _wait_all_blocks

    with _wait_all():
        assert _thread_local_var.future_list == [] and _wait_all_blocks.open >= 1
        futs = [rpc.rpc_async(world.next, f.sleep_then, args=(0.05, i)) for i in range(5)]
        assert _thread_local_var.future_list == futs
    assert not hasattr(_thread_local_var, "future_list")
    assert all(fut.done() for fut in futs) and [fut.value() for fut in futs] == list(range(5))
    with pytest.raises(ValueError, match="Expected error"), _wait_all():
        rpc.rpc_async(world.next, f.raise_value_error, args=("Expected error",))
    assert not hasattr(_thread_local_var, "future_list")
    with pytest.raises(RuntimeError, match="RPC ran for more than"), _wait_all():
        rpc.rpc_async(world.next, f.sleep_then, args=(0.5, "late"), timeout=0.05)


def test_builtin_with_wrong_arguments_is_torchs_schema_error(world):
    pattern = "Overloaded torch operator invoked from Python failed to match any schema"
    with pytest.raises(RuntimeError, match=pattern) as info:
        rpc.rpc_sync(world.next, torch.add, args=(), timeout=10)
    assert isinstance(info.value, TypeError)  # what torch.add() itself raises
    with pytest.raises(RuntimeError, match=pattern):
        rpc.remote(world.next, torch.add, args=(), timeout=10).to_here()
    del info


def test_remote_exception_that_cannot_be_rebuilt_names_the_original_as_torch_does(world):
    with pytest.raises(RuntimeError) as info:
        rpc.rpc_sync(world.next, f.raise_two_argument_error, timeout=10)
    text = str(info.value)
    assert "TwoArgumentError" in text
    assert "Original exception on remote side was built with two arguments" in text
    assert isinstance(info.value.__cause__, RemoteTraceback)


def test_callbacks_that_wait_for_other_rpcs(world):
    """torch's test_callback_with_ret: a then() callback that makes an RPC and waits for
    it, a done callback that calls rpc_sync, many at once; each deadlocked the rank whose
    progress leader ran the callback."""
    to = world.next

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
