"""torch's RPC profiling over mpidag (mpidag/_remote_profiling.py), in-process worlds.

Under torch's legacy profiler a call is a range named by torch's key and the callee's
events come back into the caller's profile as remote events; ``torch.profiler`` sees
mpidag's own ranges instead; ``_server_process_global_profile`` and GIL profiling observe
the serving side. Each test checks names, node ids, shapes and values of the events.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch.autograd.profiler_legacy import profile as legacy_profile

from mpidag import _remote_profiling as rp
from mpidag._runtime import Runtime
from mpidag.rpc import functions
from mpidag.rpc.server_process_global_profiler import _server_process_global_profile
from tests.test_inproc import TIMEOUT, on_every_rank, settle, start_world

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

#: rank -> agent of the running world, for functions that call on from a callee
_AGENTS: dict[int, object] = {}


def udf_with_ops(scale: float) -> torch.Tensor:
    t = torch.add(torch.ones(2), torch.ones(2))
    return torch.mul(t, scale).relu()


def fail(message: str) -> None:
    raise ValueError(message)


@functions.async_execution
def relay_add(via: int, to: int, x: torch.Tensor, y: torch.Tensor) -> torch.futures.Future:
    """On ``via``: an asynchronous call of ``torch.add`` on ``to``."""
    return _AGENTS[via].call(to, torch.add, (x, y), {}, TIMEOUT)


@pytest.fixture
def world() -> Iterator[list[Runtime]]:
    runtimes = start_world(3)
    _AGENTS.update({rt.agent.rank: rt.agent for rt in runtimes})
    yield runtimes
    _AGENTS.clear()
    settle(runtimes)
    on_every_rank(len(runtimes), lambda r: runtimes[r].shutdown(graceful=True,
                                                                 timeout=TIMEOUT))


def remote_events(prof) -> dict[str, object]:
    return {e.name: e for e in prof.function_events if e.is_remote}


def test_key_is_torchs_format():
    from torch.distributed.rpc.internal import RPCExecMode, _build_rpc_profiling_key

    for mode in RPCExecMode:
        assert rp.rpc_profiling_key(mode.value, "udf", "worker0", "worker1") == \
            _build_rpc_profiling_key(mode, "udf", "worker0", "worker1")
    assert rp.function_name(torch.add, ()) == (None, "aten::add")
    assert rp.function_name(udf_with_ops, ()) == (None, "udf_with_ops")


def test_no_profiler_no_profiling():
    assert not rp.call_profiling()
    assert not rp.legacy_profiling()
    assert not rp.observing()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with legacy_profile():
            assert rp.call_profiling() and rp.legacy_profiling()
    with torch.profiler.profile():
        assert rp.call_profiling() and not rp.legacy_profiling()


def test_rpc_async_records_torchs_key_and_the_callees_events(world):
    agent = world[0].agent
    with legacy_profile(record_shapes=True) as prof:
        fut = agent.call(1, udf_with_ops, (3.0,), {}, TIMEOUT)
        assert torch.equal(fut.wait(), torch.full((2,), 6.0))
    key = "rpc_async#udf_with_ops(worker0 -> worker1)"
    ranges = [e for e in prof.function_events if e.name == key]
    assert len(ranges) == 1 and not ranges[0].is_remote
    remote = remote_events(prof)
    for op in ("aten::ones", "aten::add", "aten::mul", "aten::relu"):
        event = remote[key + rp.REMOTE_OP + op]
        assert event.node_id == 1 and event.is_remote
    assert all(name.startswith(key + rp.REMOTE_OP) for name in remote)
    # the caller's options reach the callee: shapes are recorded there
    assert remote[key + rp.REMOTE_OP + "aten::add"].input_shapes == [[2], [2], []]
    # the callee's block of events lies inside the call's range
    rng = ranges[0].time_range
    for event in remote.values():
        assert rng.start <= event.time_range.start <= event.time_range.end <= rng.end


def test_rpc_sync_remote_and_to_here_keys(world):
    agent, rrefs = world[0].agent, world[0].rrefs
    with legacy_profile(profile_memory=True) as prof:
        assert torch.equal(agent.call_sync(2, torch.mul, (torch.ones(2), 2), {}, TIMEOUT),
                           torch.full((2,), 2.0))
        handle = rrefs.remote(1, torch.add, (torch.ones(2), 1), {}, TIMEOUT)
        assert torch.equal(handle.to_here(), torch.full((2,), 2.0))
        # the owner may answer to_here() before the creation: the remote's range ends with
        # the creation's answer, so wait for it inside the profile (torch's RRef._get_future)
        handle._get_future().wait()
    names = {e.name for e in prof.function_events}
    assert "rpc_sync#aten::mul(worker0 -> worker2)" in names
    assert "rpc_remote#aten::add(worker0 -> worker1)" in names
    assert "rpc_sync#to_here(worker0 -> worker1)" in names
    remote = remote_events(prof)
    assert remote["rpc_sync#aten::mul(worker0 -> worker2)#remote_op: aten::mul"].node_id == 2
    assert remote["rpc_remote#aten::add(worker0 -> worker1)#remote_op: aten::add"].node_id == 1
    # profile_memory reached the callee: the remote ops allocated memory
    assert {e.cpu_memory_usage for e in remote.values()} != {0}
    del handle


def test_nested_call_of_an_async_function_comes_back_under_both_keys(world):
    agent = world[0].agent
    with legacy_profile() as prof:
        fut = agent.call(1, relay_add, (1, 2, torch.ones(2), torch.ones(2)), {}, TIMEOUT)
        assert torch.equal(fut.wait(), torch.full((2,), 2.0))
    outer = "rpc_async#relay_add(worker0 -> worker1)"
    inner = "rpc_async#aten::add(worker1 -> worker2)"
    remote = remote_events(prof)
    assert remote[outer + rp.REMOTE_OP + inner].node_id == 1
    assert remote[outer + rp.REMOTE_OP + inner + rp.REMOTE_OP + "aten::add"].node_id == 2


def test_errors_keep_their_type_under_the_profiler(world):
    agent = world[0].agent
    with legacy_profile() as prof:
        fut = agent.call(1, fail, ("no luck",), {}, TIMEOUT)
        with pytest.raises(ValueError, match="no luck"):
            fut.wait()
        with pytest.raises(ValueError, match="again"):
            agent.call_sync(1, fail, ("again",), {}, TIMEOUT)
    names = {e.name for e in prof.function_events}
    assert "rpc_async#fail(worker0 -> worker1)" in names
    assert "rpc_sync#fail(worker0 -> worker1)" in names


def test_torch_profiler_sees_mpidag_ranges_not_rpc_keys(world):
    agent = world[0].agent
    with torch.profiler.profile() as prof:
        agent.call(1, torch.add, (torch.ones(2), 1), {}, TIMEOUT).wait()
    names = {e.name for e in prof.events()}
    assert "mpidag.rpc#torch.add(worker0 -> worker1)" in names
    assert not any(name.startswith("rpc_") for name in names)


def test_server_process_global_profile_nests(world):
    agent = world[0].agent
    x, y = torch.tensor(1), torch.tensor(2)
    outer = _server_process_global_profile()
    outer.__enter__()
    agent.call_sync(1, torch.add, (x, y), {}, TIMEOUT)
    inner = _server_process_global_profile()
    inner.__enter__()
    agent.call_sync(1, torch.sub, (x, y), {}, TIMEOUT)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert not rp.server_profiling() and not rp.observing()

    def top_level(profile) -> list[str]:
        return sorted(events[0].name for events in profile.process_global_function_events
                      if events)

    assert top_level(inner) == ["aten::sub"]
    assert top_level(outer) == ["aten::add", "aten::sub"]
    assert "aten::add" in {row.key for row in outer.key_averages()}


def test_gil_profiling_reports_an_average_wait(world):
    agent = world[0].agent
    assert rp.gil_average_wait_us() is None
    rp.set_gil_profiling(True)
    try:
        assert rp.observing() and rp.gil_average_wait_us() == 0.0  # nothing measured yet
        agent.call_sync(1, torch.add, (torch.ones(1), 1), {}, TIMEOUT)
        wait = rp.gil_average_wait_us()
        assert isinstance(wait, float) and wait > 0
    finally:
        rp.set_gil_profiling(False)
    assert rp.gil_average_wait_us() is None
    assert not rp.observing()
