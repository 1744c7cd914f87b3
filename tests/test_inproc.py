"""The agent, RRef and autograd protocols over the in-process transport (no mpirun).

Each test starts a world of ranks as threads of this process (the same runtimes, framing
and protocols as under MPI, with queues in place of MPI) and checks real values: results,
remote errors, RRef lifetimes and gradients against plain local autograd. The whole file
runs in seconds; the MPI transport keeps its own multi-rank tests.
"""

from __future__ import annotations

import concurrent.futures
import gc
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from mpidag._config import Config
from mpidag._runtime import Runtime
from mpidag.agent.messages import FLAG_FUNCTION_REF
from mpidag.errors import RemoteTraceback, RPCError, SerializationError
from mpidag.testing import _DelayedSender
from mpidag.transport import frames
from mpidag.transport.frames import Envelope
from mpidag.transport.inproc import InProcWorld
from tests import autograd_funcs as af
from tests import rpc_funcs as rf

TIMEOUT = 20.0
#: no gc.freeze, short spins: many runtimes share this process and its two cores
CONFIG = Config(gc_freeze=False, poll_spin=2e-3)


def on_every_rank(world_size: int, fn: Callable[[int], object]) -> list:
    """Run ``fn(rank)`` in one thread per rank (collectives need every rank at once)."""
    with concurrent.futures.ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(fn, range(world_size), timeout=120))


def start_world(world_size: int, num_worker_threads: int = 4) -> list[Runtime]:
    from mpidag.agent.options import MPIRpcBackendOptions

    world = InProcWorld(world_size)
    options = MPIRpcBackendOptions(num_worker_threads=num_worker_threads, rpc_timeout=TIMEOUT)
    runtimes = on_every_rank(world_size, lambda r: Runtime.connect(
        world.transports[r], options=options, config=CONFIG))
    for runtime in runtimes:
        runtime.serve()
    return runtimes


def quiesce(runtimes: list[Runtime]) -> None:
    on_every_rank(len(runtimes), lambda r: runtimes[r].agent.wait_quiescent(TIMEOUT))


def settle(runtimes: list[Runtime]) -> None:
    """Free RRef handles held by garbage cycles and drain the protocol messages."""
    for _ in range(3):
        gc.collect()
        quiesce(runtimes)


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def world(request) -> Iterator[list[Runtime]]:
    runtimes = start_world(request.param)
    yield runtimes
    on_every_rank(len(runtimes), lambda r: runtimes[r].shutdown(graceful=True,
                                                                 timeout=TIMEOUT))


def call(runtime: Runtime, dst: int, func, *args, **kwargs):
    agent = runtime.agent
    return agent.wait(agent.call(dst, func, args, kwargs, TIMEOUT), TIMEOUT)


# --------------------------------------------------------------------------- transport

def test_transport_moves_frames_tensors_numpy_and_large_payloads():
    world = InProcWorld(2)
    t0, t1 = world.transports
    big = torch.arange(20_000, dtype=torch.float64)            # its own frame
    small = torch.ones(3, requires_grad=True)                   # inline
    array = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2]  # out of band, strided
    blob = bytes(range(256)) * (frames.PAYLOAD_FRAME_LIMIT // 256 + 10)  # payload frame
    payload, tensors = frames.dumps({"big": big, "small": small, "array": array, "blob": blob})
    assert len(tensors) == 3 and len(payload) > frames.PAYLOAD_FRAME_LIMIT
    t0.send(1, Envelope(kind=1, request_id=9, payload=payload, tensors=tensors),
            ["cpu"] * len(tensors))
    env = t1.poll()
    assert env is not None and env.src == 0 and env.request_id == 9 and t1.poll() is None
    got = frames.loads(env.payload, env.tensors)
    assert torch.equal(got["big"], big) and got["big"].data_ptr() != big.data_ptr()
    assert got["small"].requires_grad and torch.equal(got["small"], small.detach())
    assert isinstance(got["array"], np.ndarray) and np.array_equal(got["array"], array)
    assert got["blob"] == blob


def test_collectives_of_an_in_process_world():
    world = InProcWorld(3)
    gathered = on_every_rank(3, lambda r: world.transports[r].allgather(r * 10))
    assert gathered == [[0, 10, 20]] * 3

    def reduce(r: int) -> list[int]:
        def wait(done):
            while not done():
                time.sleep(1e-4)
        return world.transports[r].allreduce_sum([r, 1], wait)

    assert on_every_rank(3, reduce) == [[3, 3]] * 3


# ------------------------------------------------------------------------------- agent

def test_calls_results_and_remote_errors(world):
    last = len(world) - 1
    assert call(world[0], last, rf.add, torch.ones(2), 3).tolist() == [4.0, 4.0]
    assert call(world[last], 0, rf.add, "a", b="b") == "ab"
    with pytest.raises(ValueError, match="from rank 0") as info:
        call(world[0], 1, rf.raise_value_error, "from rank 0")
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "worker1" in info.value.__cause__.text


def test_base_exceptions_are_answers_and_the_pool_survives():
    runtimes = start_world(2, num_worker_threads=1)
    try:
        with pytest.raises(SystemExit):
            call(runtimes[0], 1, rf.raise_system_exit, 2)
        with pytest.raises(rf.Interrupted):
            call(runtimes[0], 1, rf.raise_base_exception, "x")
        assert call(runtimes[0], 1, rf.add, 1, 1) == 2  # the only pool thread still serves
    finally:
        on_every_rank(2, lambda r: runtimes[r].shutdown(timeout=TIMEOUT))


#: the runtimes of test_the_pool_grows_for_nested_calls_and_reports_its_size, by rank
_CHAIN_WORLD: list[Runtime] = []


def chain(path: list[int], x: int) -> int:
    """Runs on rank ``path[0]``: calls itself on ``path[1]`` (and so on) and adds 1 at the end."""
    if len(path) == 1:
        return x + 1
    return call(_CHAIN_WORLD[path[0]], path[1], chain, path[1:], x * 2)


def test_the_pool_grows_for_nested_calls_and_reports_its_size():
    """One pool thread per rank, and a chain 0 -> 1 -> 0 -> 1: rank 1's only pool thread
    waits in the first hop while the last one is queued, so rank 1 starts a second pool
    thread; the state the inspector shows counts it."""
    from mpidag._debug import state_snapshot

    runtimes = start_world(2, num_worker_threads=1)
    _CHAIN_WORLD[:] = runtimes
    try:
        assert call(runtimes[0], 1, chain, [1, 0, 1], 1) == ((1 * 2) * 2) + 1
        assert runtimes[0].agent.engine.pool_size == 1
        assert runtimes[1].agent.engine.pool_size == 2
        assert state_snapshot(runtimes[1])["engine"]["pool_threads"] == 2
    finally:
        _CHAIN_WORLD.clear()
        on_every_rank(2, lambda r: runtimes[r].shutdown(timeout=TIMEOUT))


def test_internal_messages_name_handlers_not_functions(world):
    agent = world[0].agent
    payload, _, flags = agent._encode_call(1, world[0].rrefs._fetch, (7,), {})
    assert flags and b"rref.fetch" in payload and b"_on_fetch" not in payload


def test_module_functions_travel_as_cached_references(world, monkeypatch):
    agent = world[0].agent
    payload, tensors, flags = agent._encode_call(1, rf.noop, (), {})
    assert flags == FLAG_FUNCTION_REF and b"noop" in payload and tensors == []
    payload, tensors, flags = agent._encode_call(1, rf.add, (torch.ones(2), 1), {})
    assert flags == FLAG_FUNCTION_REF and len(tensors) == 1
    assert call(world[0], 1, rf.noop) is None
    assert call(world[0], 1, rf.add, 2, 3) == 5  # plain arguments: plain pickle
    assert call(world[0], 1, rf.add, torch.ones(2), b=torch.ones(2)).tolist() == [2.0, 2.0]
    assert call(world[0], 1, torch.add, torch.ones(2), 1).tolist() == [2.0, 2.0]  # builtin
    # other callables travel pickled with their call, as before
    _, _, flags = agent._encode_call(1, rf.Adder(5).plus, (2,), {})
    assert flags == 0
    assert call(world[0], 1, rf.Adder(5).plus, 2) == 7
    with pytest.raises(SerializationError, match="could not pickle the call"):
        call(world[0], 1, lambda: 1)

    # a function replaced in its module is looked up again on the callee
    def doubled(x):
        return 2 * x

    doubled.__qualname__, doubled.__module__ = "identity", rf.__name__
    assert call(world[0], 1, rf.identity, 4) == 4
    monkeypatch.setattr(rf, "identity", doubled)
    assert call(world[0], 1, rf.identity, 4) == 8


def test_a_call_naming_an_unknown_handler_gets_a_clear_error(world):
    from mpidag.agent.agent import Handler

    stranger = Handler("no.such.handler", rf.noop)
    with pytest.raises(RPCError, match="no internal handler 'no.such.handler'"):
        call(world[0], 1, stranger)


# -------------------------------------------------------------------------------- RRef

def fetch_from(rref):
    """Runs on another rank: fetches through that rank's own RRef layer."""
    return rref.to_here() + 1


def test_rref_create_fork_fetch_and_free(world):
    owner = len(world) - 1
    rrefs = world[0].rrefs
    handle = rrefs.remote(owner, torch.add, (torch.ones(2), 1), {}, TIMEOUT)
    assert not handle.is_owner() and handle.owner().id == owner
    assert handle.to_here().tolist() == [2.0, 2.0]
    # forked to every rank (the owner included) as an argument
    for rank in range(len(world)):
        assert call(world[0], rank, fetch_from, handle).tolist() == [3.0, 3.0]
    assert handle.rpc_sync().sum().item() == 4.0                  # proxy on the owner
    assert handle.remote().mul(2).to_here().tolist() == [4.0, 4.0]
    assert world[owner].rrefs.debug_info()["num_owner_rrefs"] >= 1
    del handle
    settle(world)
    for runtime in world:
        info = runtime.rrefs.debug_info()
        assert info["num_owner_rrefs"] == 0 and info["num_user_rrefs"] == 0, info


def test_rref_protocol_with_delayed_reordered_control_messages(world):
    senders = [_DelayedSender(rt.transport, max_delay=0.005, seed=rt.agent.rank)
               for rt in world]
    for rt, sender in zip(world, senders, strict=True):
        rt.transport.send_hook = sender.hook
    try:
        handles = [world[r].rrefs.remote((r + 1) % len(world), torch.ones, (r + 1,), {},
                                         TIMEOUT) for r in range(len(world))]
        for r, handle in enumerate(handles):
            nxt = (r + 2) % len(world)
            assert call(world[r], nxt, fetch_from, handle).sum().item() == 2 * (r + 1)
        del handles, handle
        settle(world)
    finally:
        for rt, sender in zip(world, senders, strict=True):
            rt.transport.send_hook = None
            sender.stop()
    settle(world)
    assert sum(s.delayed for s in senders) > 0
    for runtime in world:
        info = runtime.rrefs.debug_info()
        assert not any(info.values()), info


# ---------------------------------------------------------------------------- autograd

def test_distributed_backward_matches_local_autograd(world):
    rt = world[0]
    contexts = rt.autograd.container
    x = torch.rand(4, requires_grad=True)
    w = torch.rand(4, requires_grad=True)
    ctx = contexts.new_context()
    previous = contexts.enter(ctx)
    try:
        y = call(rt, 1, af.mul_sin, x, w)                    # recorded: send + recv
        handle = rt.rrefs.remote(len(world) - 1, af.square, (x,), {}, TIMEOUT)
        loss = (y * handle.to_here()).sum()
    finally:
        contexts.leave(previous)
    rt.autograd.backward(ctx.context_id, [loss])
    grads = ctx.gradients.snapshot()
    ex, ew = torch.autograd.grad((af.mul_sin(x, w) * af.square(x)).sum(), [x, w])
    torch.testing.assert_close(grads[x], ex)
    torch.testing.assert_close(grads[w], ew)
    assert x.grad is None
    contexts.release(ctx)
    del handle, y, loss
    settle(world)
    for runtime in world:
        info = runtime.autograd.container.debug_info()
        assert info["num_autograd_contexts"] == 0 and info["num_live_send_functions"] == 0, \
            info


def test_tensor_subclass_takes_part_in_distributed_autograd(world):
    rt = world[0]
    contexts = rt.autograd.container
    x = torch.rand(3, requires_grad=True)
    ctx = contexts.new_context()
    previous = contexts.enter(ctx)
    try:
        back = call(rt, 1, af.scale_tagged, af.tagged(x * 2, "metres"), 3.0)
    finally:
        contexts.leave(previous)
    assert type(back) is af.TaggedTensor and back.tag == "scaled"
    rt.autograd.backward(ctx.context_id, [(back * x).sum()])
    (expected,) = torch.autograd.grad((af.scale_tagged(af.tagged(x * 2, "metres"), 3.0)
                                       * x).sum(), [x])
    torch.testing.assert_close(ctx.gradients.snapshot()[x], expected)
    contexts.release(ctx)


# ---------------------------------------------------------------------------- progress

def test_leader_tells_a_waiting_main_thread_from_a_computing_one():
    """The idle leader naps only while the main thread computes; a main thread blocked
    outside mpidag (torch.futures.wait_all, a join) counts as waiting."""
    import threading

    from mpidag.transport.progress import MainThreadCPU

    cpu = MainThreadCPU(interval=1e-3)
    if cpu._fd is None:
        pytest.skip("this kernel has no /proc/self/task/<tid>/schedstat")
    seen: dict[str, bool] = {}

    def probe(key: str) -> None:
        time.sleep(0.005)
        cpu.busy()  # starts a measuring interval
        time.sleep(0.03)
        seen[key] = cpu.busy()

    waiter = threading.Thread(target=probe, args=("waiting",))
    waiter.start()
    waiter.join()  # the main thread is blocked here
    assert seen == {"waiting": False}
    # computing: on a loaded machine the main thread may get less than half a core during
    # one 30 ms interval (seen with a load average of 20), so it has a few tries
    for _ in range(5):
        computer = threading.Thread(target=probe, args=("computing",))
        computer.start()
        end = time.monotonic() + 0.1
        while time.monotonic() < end:  # the main thread computes
            sum(range(1000))
        computer.join()
        if seen["computing"]:
            break
    assert seen == {"waiting": False, "computing": True}


def test_a_failing_after_poll_hook_does_not_stop_the_leader(caplog):
    """An error in the leader's after-poll hook (the agent's timeout scan) is logged and the
    leader goes on receiving: a leader that died left the rank deaf (seen as a hang)."""
    import threading

    from mpidag.transport.progress import ProgressEngine

    failures = [3]
    arrived = threading.Event()
    inbox = [Envelope(kind=4, request_id=i) for i in range(5)]

    def poll():
        return inbox.pop() if inbox and failures[0] == 0 else None

    def on_idle():
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("dictionary changed size during iteration")

    def dispatch(env):
        if not inbox:
            arrived.set()

    engine = ProgressEngine(poll, dispatch, on_idle, num_threads=1)
    engine.start()
    try:
        assert arrived.wait(10), "the leader stopped polling after its hook failed"
    finally:
        engine.stop()
    assert failures == [0]
    assert "after-poll hook failed" in caplog.text
