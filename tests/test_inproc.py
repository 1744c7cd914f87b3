"""The agent, RRef and autograd protocols over the in-process transport (no mpirun).

Each test starts a world of ranks as threads of this process (the same runtimes, framing
and protocols as under MPI, with queues in place of MPI) and checks real values: results,
remote errors, RRef lifetimes and gradients against plain local autograd. The whole file
runs in seconds.

The public protocol behaviour (RPC, RRefs, distributed autograd, the optimizer,
RemoteModule) is tested once, on both transports, by the contract suite in tests/contract/;
what stays here needs this transport's internals: the transport itself, a runtime's own
objects (a one-thread pool, the encoded messages, the progress engine) or this process's
logging.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from mpidag._config import Config
from mpidag._runtime import Runtime
from mpidag.agent.messages import FLAG_FUNCTION_REF, FLAG_PLAIN
from mpidag.errors import RPCError, SerializationError
from mpidag.transport import frames
from mpidag.transport.frames import Envelope
from mpidag.transport.inproc import InProcWorld
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

# in-process only: a one-thread pool (tests/contract/test_rpc.py has the public behaviour)
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
        # torch's agent.thread_pool_size: the same figure, not the configured 1
        assert runtimes[1].debug_info()["thread_pool_size"] == 2
        assert runtimes[0].debug_info()["thread_pool_size"] == 1
    finally:
        _CHAIN_WORLD.clear()
        on_every_rank(2, lambda r: runtimes[r].shutdown(timeout=TIMEOUT))


def test_internal_messages_name_handlers_not_functions(world):
    agent = world[0].agent
    payload, _, flags = agent.calls.codec.encode(1, world[0].rrefs._fetch, (7,), {})
    assert flags and b"rref.fetch" in payload and b"_on_fetch" not in payload


def test_module_functions_travel_as_cached_references(world, monkeypatch):
    agent = world[0].agent
    payload, tensors, flags = agent.calls.codec.encode(1, rf.noop, (), {})
    assert flags == FLAG_FUNCTION_REF | FLAG_PLAIN and b"noop" in payload and tensors == []
    payload, tensors, flags = agent.calls.codec.encode(1, rf.add, (torch.ones(2), 1), {})
    assert flags == FLAG_FUNCTION_REF and len(tensors) == 1
    assert call(world[0], 1, rf.noop) is None
    assert call(world[0], 1, rf.add, 2, 3) == 5  # plain arguments: plain pickle
    assert call(world[0], 1, rf.add, torch.ones(2), b=torch.ones(2)).tolist() == [2.0, 2.0]
    assert call(world[0], 1, torch.add, torch.ones(2), 1).tolist() == [2.0, 2.0]  # builtin
    # other callables travel pickled with their call, as before
    _, _, flags = agent.calls.codec.encode(1, rf.Adder(5).plus, (2,), {})
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


# ---------------------------------------------------------------------- debug counters
# (per runtime: what only an in-process world, with several runtimes in one process, shows)

def live_functions(runtime: Runtime) -> tuple[int, int]:
    info = runtime.debug_info()
    return info["num_live_send_functions"], info["num_live_recv_functions"]


def test_live_send_and_recv_functions_are_counted_by_the_rank_that_made_them(world):
    """A tensor that requires grad goes from rank 0 to rank 1 and a float comes back: one
    send function on rank 0, one recv function on rank 1, none elsewhere (the counts were
    process-wide: every rank of an in-process world reported the others' too)."""
    rt = world[0]
    contexts = rt.autograd.container
    x = torch.rand(4, requires_grad=True)
    ctx = contexts.new_context()
    previous = contexts.enter(ctx)
    try:
        assert call(rt, 1, rf.checksum, x)[0] == pytest.approx(float(x.sum()))
    finally:
        contexts.leave(previous)
    assert [live_functions(r) for r in world] == [(1, 0), (0, 1)] + [(0, 0)] * (len(world) - 2)
    assert set(contexts.torch_debug_info()) == {"num_current_backward_passes",
                                                "num_autograd_contexts"}
    contexts.release(ctx)
    settle(world)  # rank 1 lets go of the context when rank 0's release reaches it
    assert [live_functions(r) for r in world] == [(0, 0)] * len(world)


#: held shut by test_a_call_in_an_autograd_context_is_recorded_when_dispatched
_GATE = threading.Event()


def _wait_at_gate() -> bool:
    return _GATE.wait(TIMEOUT)


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def test_a_call_in_an_autograd_context_is_recorded_when_dispatched():
    """Rank 1's only pool thread is held, so a call of rank 0 in an autograd context waits in
    rank 1's queue: its context and recv function are on rank 1 already, recorded when the
    leader dispatched it, in arrival order. (Recorded by the pool thread, SMART mode's later
    question about that recv function could be served first and find nothing.)"""
    runtimes = start_world(2, num_worker_threads=1)
    engine1 = runtimes[1].agent.engine
    contexts = runtimes[0].autograd.container
    _GATE.clear()
    try:
        held = runtimes[0].agent.call(1, _wait_at_gate, (), {}, TIMEOUT)
        _until(lambda: engine1.snapshot().running_requests == 1, "rank 1 runs the gate")
        x = torch.rand(4, requires_grad=True)
        ctx = contexts.new_context()
        previous = contexts.enter(ctx)
        try:
            queued = runtimes[0].agent.call(1, rf.checksum, (x,), {}, TIMEOUT)
        finally:
            contexts.leave(previous)
        _until(lambda: engine1.snapshot().queued_requests == 1, "the call is queued on rank 1")
        assert not queued.done()
        assert live_functions(runtimes[1]) == (0, 1)  # its recv function, before it runs
        assert ctx.context_id in runtimes[1].autograd.container.contexts
        _GATE.set()
        assert held.wait() is True
        assert runtimes[0].agent.wait(queued, TIMEOUT)[0] == pytest.approx(float(x.sum()))
        contexts.release(ctx)
        settle(runtimes)
        assert [live_functions(r) for r in runtimes] == [(0, 0), (0, 0)]
    finally:
        _GATE.set()
        on_every_rank(2, lambda r: runtimes[r].shutdown(timeout=TIMEOUT))


def test_live_count_is_exact_while_threads_count_and_read_at_once():
    from mpidag.dist_autograd.context import LiveCount

    count = LiveCount()
    seen: list[int] = []

    def work(thread: int) -> None:
        for _ in range(20_000):
            count.made()
            if thread % 2:
                seen.append(count.live)  # readers too: they must not shift the figure
            count.freed()

    on_every_rank(4, work)
    assert count.live == 0 and min(seen) >= 1 and max(seen) <= 4
    for _ in range(5):
        count.made()
    assert count.live == 5


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
    # one 30 ms interval (seen with a load average of 20, and in CI while the other venvs'
    # set-up compiles and unpacks torch beside this stage), so it tries until it is seen
    # computing once, for up to 30 s
    give_up = time.monotonic() + 30
    while True:
        computer = threading.Thread(target=probe, args=("computing",))
        computer.start()
        end = time.monotonic() + 0.1
        while time.monotonic() < end:  # the main thread computes
            sum(range(1000))
        computer.join()
        if seen["computing"] or time.monotonic() > give_up:
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


# ------------------------------------------------------------------------ sparse tensors

def test_sparse_gradients_are_kept_or_copied_like_torch_accumulates_them():
    """torch's ``test_no_grad_copy_sparse``: a sparse gradient with contiguous parts is
    stored as it is, a non-contiguous one (or one reaching two leaves) is copied; later ones
    accumulate, sparse or dense."""
    from mpidag.dist_autograd.context import GradientMap

    a, b = torch.randn(10, 3, requires_grad=True), torch.randn(10, 3, requires_grad=True)

    def sparse_grad() -> torch.Tensor:  # a fresh engine buffer each time
        return torch.sparse_coo_tensor([[1, 4]], torch.ones(2, 3), (10, 3))

    grads = GradientMap()
    first = sparse_grad()
    grads.add(a, first)
    assert grads.snapshot()[a] is first                # contiguous parts: no copy
    shared = torch.sparse_coo_tensor(torch.ones(1, 1, dtype=torch.long).expand(1, 8),
                                     torch.rand(1, 3).expand(8, 3), (10, 3))
    grads.add(b, shared)                               # non-contiguous parts: copied
    assert grads.snapshot()[b]._values().data_ptr() != shared._values().data_ptr()
    one = sparse_grad().to_dense()
    grads.add(a, sparse_grad())                        # sparse + sparse: stays sparse
    assert grads.snapshot()[a].is_sparse
    torch.testing.assert_close(grads.snapshot()[a].to_dense(), 2 * one)
    grads.add(a, torch.ones(10, 3))                    # sparse + dense: a dense sum
    assert not grads.snapshot()[a].is_sparse
    torch.testing.assert_close(grads.snapshot()[a], 2 * one + 1)
    grads.add(a, sparse_grad())                        # dense + sparse
    torch.testing.assert_close(grads.snapshot()[a], 3 * one + 1)
    both = sparse_grad()                               # one buffer reaching two leaves
    c, d = torch.zeros(10, 3, requires_grad=True), torch.zeros(10, 3, requires_grad=True)
    grads.add(c, both)
    grads.add(d, both)
    assert grads.snapshot()[c]._values().data_ptr() != grads.snapshot()[d]._values().data_ptr()


# ------------------------------------------------------------------ issue 21: small ones

# in-process only: reads the callee's log record, which under MPI is in another process
def test_a_failing_call_is_logged_on_the_callee_as_torch_prints_it(world, caplog):
    """torch's _run_function prints ``On <WorkerInfo>:``, the exception's repr and its
    traceback on the callee (test_py_raise_in_user_func reads it there): one record."""
    import logging

    with caplog.at_level(logging.ERROR, logger="mpidag.agent.agent"), \
            pytest.raises(ValueError, match="logged here"):
        call(world[0], 1, rf.raise_value_error, "logged here")
    records = [r for r in caplog.records if r.name == "mpidag.agent.agent"]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    message = records[0].getMessage()
    assert message.startswith("On WorkerInfo(id=1, name=worker1):\nValueError('logged here')"
                              "\nTraceback (most recent call last):\n")
    assert "in raise_value_error" in message
    assert message.rstrip().endswith("ValueError: logged here")
    assert records[0].exc_info is None  # text only: no frames kept alive by the record
    assert all(isinstance(arg, str) for arg in records[0].args[1:])
    caplog.clear()
    assert call(world[0], 1, rf.add, 1, 2) == 3  # a call that succeeds logs nothing
    assert not [r for r in caplog.records if r.name == "mpidag.agent.agent"]


def test_a_waiter_that_leaves_without_leading_hands_the_leadership_on():
    """A user thread waits (a pool thread leads), the leader hands it the leadership, but its
    reply is already there and it leaves without leading. Someone must poll after that:
    with the pool thread parked and the sentinel asleep (it parks while a leader holds the
    lead), nobody did, and the rank never received another message until one of its own
    threads waited again (seen as a call to rank 0 unanswered for 60 s while rank 0's test
    thread waited on an Event in ``_all_gather``)."""
    import threading

    from mpidag.transport.progress import ProgressEngine

    in_poll = threading.Event()
    poll_may_return = threading.Event()
    poll_may_return.set()
    hold_next_poll = threading.Event()
    inbox: list[Envelope] = []
    received = threading.Event()

    def poll():
        if hold_next_poll.is_set():  # once: keep the leader here while the user registers
            hold_next_poll.clear()
            in_poll.set()
            poll_may_return.wait(10)
        return inbox.pop() if inbox else None

    def dispatch(env):
        received.set()

    engine = ProgressEngine(poll, dispatch, lambda: None, num_threads=1)

    def until(condition, what):
        deadline = time.monotonic() + 10
        while not condition(engine.snapshot()):
            assert time.monotonic() < deadline, f"{what}: {engine.snapshot()}"
            time.sleep(0.001)

    engine.start()
    try:
        until(lambda s: s.leader_busy and s.sentinel_parked, "a pool leader, sentinel parked")
        poll_may_return.clear()
        hold_next_poll.set()
        assert in_poll.wait(10)
        checks = []

        def reply_arrived():
            checks.append(None)
            if len(checks) == 1:
                return False  # the first look, before the thread registers as a waiter
            # the leader sees this waiter, hands it the leadership and parks itself; the
            # reply is here by then, so the waiter leaves without leading
            poll_may_return.set()
            until(lambda s: not s.leader_busy and s.idle_pool_threads == 1,
                  "the pool leader handed over and parked")
            return True

        assert engine.wait_until(reply_arrived, deadline=None)
        inbox.append(Envelope(kind=4, request_id=1))
        assert received.wait(10), f"nobody polls after the waiter left: {engine.snapshot()}"
    finally:
        poll_may_return.set()
        engine.stop()


def test_a_leading_user_thread_naps_beside_a_computing_work_item_while_another_waits():
    """Two user threads wait for replies (one leads, one waits for the lead) while a work
    item computes on the pool thread: the leader naps, as a lone waiting thread does. It
    skipped every nap while another user thread waited (a pool leader's rule, which hands
    over to waiters; a user leader never does), so it spun at a full core beside the work
    item: a first ``torch.optim.SGD`` in a pool thread (an import of ``torch._dynamo``,
    0.8 s alone) took over 60 s while two trainer threads waited for it in-process."""
    import threading

    from mpidag.transport.progress import ProgressEngine

    engine = ProgressEngine(lambda: None, lambda env: None, lambda: None, num_threads=1,
                            spin=1e-3, min_sleep=1e-5, max_sleep=1e-4)
    work_started, release = threading.Event(), threading.Event()
    skipped: list[bool] = []  # per nap a user thread asked for: skipped (True) or taken
    user_threads: set[int] = set()
    nap = engine._naps.nap

    def recording_nap(seconds, skip):
        # a user thread's naps while the other user thread waits for the lead
        if threading.get_ident() in user_threads and engine.snapshot().waiting_user_threads:
            skipped.append(skip())
            if not skipped[-1] or len(skipped) >= 20_000:  # a nap taken, or only skips
                release.set()
        nap(seconds, skip)

    engine._naps.nap = recording_nap

    def computing_work_item():
        work_started.set()
        release.wait(60)  # counts as computing: it is not waiting inside the engine

    results = []
    engine.start()
    try:
        engine.submit(computing_work_item)
        assert work_started.wait(10)

        def wait_for_reply():
            user_threads.add(threading.get_ident())
            results.append(engine.wait_until(release.is_set, deadline=time.monotonic() + 60))

        waiters = [threading.Thread(target=wait_for_reply) for _ in range(2)]
        for thread in waiters:
            thread.start()
        for thread in waiters:
            thread.join(60)
    finally:
        release.set()
        engine.stop()
    assert results == [True, True]
    assert False in skipped, f"the leader skipped all {len(skipped)} naps beside the work item"
    assert skipped.count(True) < 100, "the leader skipped its naps while another thread waited"


def test_a_leader_waiting_outside_python_is_interrupted_when_a_user_thread_wants_to_lead():
    """A pool leader that spins through ``poll_wait`` (the compiled MPI path: a probe loop
    in C without the GIL) hands the lead to a user thread that starts waiting for a reply:
    registering as a waiter interrupts the wait, and so does ``stop()``. Here ``poll_wait``
    ends only when interrupted (60 s guard), so without the interrupt the user thread would
    not lead within its 30 s deadline."""
    from mpidag.transport.progress import ProgressEngine

    interrupted, in_wait, polled_by_me = threading.Event(), threading.Event(), threading.Event()
    me = threading.current_thread()
    interrupts = []

    def poll():
        if threading.current_thread() is me:
            polled_by_me.set()

    def poll_wait(seconds):
        assert seconds > 0
        in_wait.set()
        interrupted.wait(60)
        interrupted.clear()

    def interrupt():
        interrupts.append(threading.current_thread().name)
        interrupted.set()

    engine = ProgressEngine(poll, lambda env: None, lambda: None, num_threads=1,
                            poll_wait=poll_wait, interrupt=interrupt)
    try:
        with engine.parked():  # this thread waits: the leader spins (it naps beside work)
            engine.start()
            assert in_wait.wait(30)  # the pool leader spins in poll_wait
        assert engine.wait_until(polled_by_me.is_set, time.monotonic() + 30)
        assert interrupts  # from this thread, as it registered to lead
    finally:
        engine.stop(timeout=30)
    assert not any(t.is_alive() for t in engine._threads)


def test_a_failing_leader_step_is_logged_and_the_leader_goes_on(caplog):
    """A step given with ``set_step`` (the agent's compiled one) that raises is logged, its
    hook runs, and the leader keeps stepping: a leader that died left the rank deaf."""
    import threading

    from mpidag.transport.progress import ProgressEngine

    failures = [3]
    hooks = []
    done = threading.Event()

    def step(wait):
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("dispatch of a message of kind 1 from rank 0 failed")
        done.set()
        return False

    engine = ProgressEngine(lambda: None, lambda env: None, lambda: hooks.append(1),
                            num_threads=1)
    engine.set_step(step)
    engine.start()
    try:
        assert done.wait(10), "the leader stopped after its step failed"
    finally:
        engine.stop()
    assert failures == [0] and len(hooks) >= 3
    assert caplog.text.count("the progress leader's step failed") == 3


def test_parking_wakes_the_thread_that_parked_last():
    """Three threads park one after the other; each ``notify`` wakes the newest still
    parked (``threading.Condition`` would wake the oldest), ``notify_all`` the rest."""
    from mpidag.transport.parking import Parking

    lock = threading.Lock()
    parking = Parking(lock)
    woken: list[int] = []

    def park(i: int) -> None:
        with lock:
            parking.wait()
            woken.append(i)

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=park, args=(i,), daemon=True))
        threads[-1].start()
        _until(lambda n=i + 1: len(parking) == n, f"thread {i} parked")
    with lock:
        parking.notify()
    threads[2].join(10)
    assert woken == [2] and len(parking) == 2
    with lock:
        parking.notify()
    threads[1].join(10)
    assert woken == [2, 1] and len(parking) == 1
    with lock:
        parking.notify_all()
    threads[0].join(10)
    assert woken == [2, 1, 0] and len(parking) == 0


def test_requests_one_at_a_time_stay_on_the_threads_that_parked_last():
    """Work queued one item at a time wakes the idle pool thread that parked last (its
    memory is warm), not the one idle longest. With four pool threads (one leading, three
    parked) every item runs on the thread that ran the one before it, or on the leader,
    which then swaps roles with it: two threads at most. Woken oldest first
    (``threading.Condition``) the items went round all of them. The sentinel wakes a pool
    thread only for a lead vacant a whole interval (a second here: only a thread starved that
    long would let it), so no wake-up but ``submit``'s is in play, and each item is queued
    only once every thread is back in its place: one leading, three parked, none woken and
    on its way (such a thread counts as idle but is no longer parked: the next ``submit``
    would wake another)."""
    from mpidag.transport.progress import ProgressEngine

    ran: list[str] = []
    done = threading.Semaphore(0)

    def work():
        ran.append(threading.current_thread().name)
        done.release()

    def settled():
        s = engine.snapshot()
        return (s.leader_busy and s.idle_pool_threads == s.parked_pool_threads == 3
                and not s.queued_requests and not s.running_requests)

    engine = ProgressEngine(lambda: None, lambda env: None, lambda: None, num_threads=4,
                            sentinel_interval=1.0)
    engine.start()
    try:
        for i in range(12):
            _until(settled, f"every pool thread in its place before request {i}")
            engine.submit(work)
            assert done.acquire(timeout=10), f"request {i} did not run: {engine.snapshot()}"
    finally:
        engine.stop()
    assert len(ran) == 12
    assert len(set(ran)) <= 2, ran


def _engine_with_inbox(num_threads: int, sentinel_interval: float,
                       handle: Callable[[Envelope], Callable[[], None] | None]):
    """A progress engine whose transport is a list (``inbox.append`` delivers an envelope)
    and whose dispatch is ``handle`` (a work item to run on a pool thread, or ``None``:
    handled by the leader)."""
    from mpidag.transport.progress import ProgressEngine

    inbox: list[Envelope] = []
    lock = threading.Lock()

    def poll():
        with lock:
            return inbox.pop(0) if inbox else None

    def deliver(env: Envelope) -> None:
        with lock:
            inbox.append(env)

    engine = ProgressEngine(poll, handle, lambda: None, num_threads=num_threads,
                            sentinel_interval=sentinel_interval)
    return engine, deliver


def test_the_sentinel_looks_only_after_a_vacancy_and_parks_once_a_leader_holds_the_lead():
    """Each request a pool leader runs leaves the lead vacant for a moment. The sentinel looks
    at most twice per such vacancy (when it begins, and an interval later if nobody had
    taken the lead yet) and parks as soon as it finds a leader. It used to look every
    interval until 20 looks in a row found a leader and no new vacancy, which a training
    loop never gives it: 1,000 looks a second, each taking a core from a rank that computes
    (a distributed forward and backward 8-10 % slower on the 2-core VM)."""
    ran = threading.Semaphore(0)

    def handle(env: Envelope) -> Callable[[], None]:
        return ran.release

    engine, deliver = _engine_with_inbox(1, 1e-3, handle)
    engine.start()
    try:
        def settled() -> bool:
            s = engine.snapshot()
            return s.leader_busy and s.sentinel_parked

        requests = 30
        _until(settled, "a pool leader, the sentinel parked")
        looks_before = engine.snapshot().sentinel_looks
        for i in range(requests):
            deliver(Envelope(kind=4, request_id=i))
            assert ran.acquire(timeout=TIMEOUT), f"request {i} did not run: {engine.snapshot()}"
            _until(settled, f"the lead taken back and the sentinel parked after request {i}")
        looks = engine.snapshot().sentinel_looks - looks_before
    finally:
        engine.stop()
    assert 1 <= looks <= 2 * requests, looks


def test_a_stream_of_short_requests_wakes_the_sentinel_at_most_once_per_interval():
    """Requests served back to back leave the lead vacant once each: the sentinel, once it
    watches, looks once per interval however many vacancies begin meanwhile (a version that
    parked after every look and was woken by the next vacancy woke on nearly every request:
    the 1 KiB echo 24 -> 37 us on two ranks)."""
    ran = threading.Semaphore(0)

    def handle(env: Envelope) -> Callable[[], None]:
        return ran.release

    interval = 5e-3
    engine, deliver = _engine_with_inbox(1, interval, handle)
    engine.start()
    try:
        _until(lambda: engine.snapshot().sentinel_parked, "the sentinel parked")
        looks_before, start = engine.snapshot().sentinel_looks, time.monotonic()
        requests = 2000
        for i in range(requests):
            deliver(Envelope(kind=4, request_id=i))
            assert ran.acquire(timeout=TIMEOUT), f"request {i} did not run: {engine.snapshot()}"
        looks = engine.snapshot().sentinel_looks - looks_before
        elapsed = time.monotonic() - start
    finally:
        engine.stop()
    # one look per interval of the stream, and the one after it that parks
    assert looks <= elapsed / interval + 2, (looks, elapsed)


@pytest.mark.parametrize("pool_threads", [2, 1], ids=["an-idle-pool-thread", "the-sentinel"])
def test_a_vacancy_that_lasts_an_interval_is_filled(pool_threads):
    """A request that blocks keeps the lead vacant (its pool thread vacated it to run the
    request) until a message that the leader handles arrives: an interval later the
    sentinel wakes the idle pool thread to lead, or, with the only pool thread busy, leads
    itself, and the message is received."""
    second_seen = threading.Event()
    first_done = threading.Event()

    def first() -> None:
        if second_seen.wait(TIMEOUT):
            first_done.set()

    def handle(env: Envelope) -> Callable[[], None] | None:
        if env.request_id == 1:
            deliver(Envelope(kind=4, request_id=2))  # arrives while the first request runs
            return first
        second_seen.set()  # handled by whoever leads
        return None

    engine, deliver = _engine_with_inbox(pool_threads, 5e-3, handle)
    engine.start()
    try:
        deliver(Envelope(kind=4, request_id=1))
        assert first_done.wait(TIMEOUT), f"nobody received the second message: " \
                                         f"{engine.snapshot()}"
        assert engine.snapshot().sentinel_looks >= 1
    finally:
        engine.stop()
