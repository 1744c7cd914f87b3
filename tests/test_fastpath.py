"""The compiled path of plain calls (``_mpidag_fastpath``, see mpidag/agent/fastpath.py).

Every test here checks that the C path gives what the Python path gives (results, errors
with their types, the bytes on the wire, the message counters of graceful shutdown), that
it is the path plain calls really take, and that what is not plain still takes Python.
The contract suite (tests/contract/) runs every public behaviour on both transports with
the C path where it is built; the test matrix runs it again with ``MPIDAG_COMPILED=0``.
"""

from __future__ import annotations

import logging
import math
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import mpidag.dist_autograd.context
from mpidag._config import Config
from mpidag._runtime import Runtime
from mpidag.agent import compiled, fastpath
from mpidag.agent.futures import RpcFuture
from mpidag.agent.handlers import Handler
from mpidag.agent.messages import CALL, FLAG_FUNCTION_REF, FLAG_PLAIN, RESULT
from mpidag.dist_autograd import native
from mpidag.dist_autograd.context import RecvRecord, SendFunction
from mpidag.errors import RPCTimeoutError
from mpidag.transport import frames
from tests import rpc_funcs as rf
from tests.autograd_funcs import Cube
from tests.test_inproc import TIMEOUT, call, on_every_rank, start_world

pytestmark = pytest.mark.skipif(
    fastpath.compiled_module() is None,
    reason="_mpidag_fastpath is not built here (python -m mpidag.transport.wire_build)")


@pytest.fixture
def world() -> Iterator[list[Runtime]]:
    runtimes = start_world(2)
    yield runtimes
    on_every_rank(2, lambda r: runtimes[r].shutdown(graceful=True, timeout=TIMEOUT))


def sync(runtime: Runtime, dst: int, func, *args, **kwargs):
    """``rpc_sync``'s path: the agent's call_sync, no future."""
    return runtime.agent.call_sync(dst, func, args, kwargs, TIMEOUT)


class PythonCalls:
    """Counts the calls of the agent's Python functions that the C path replaces, in this
    thread (use it with :class:`HandDriven`, whose ranks run here)."""

    NAMES = {"serve_call", "complete", "reply_value", "dispatch", "encode", "decode",
             "serve_notify", "__call__"}  # (Handler.__call__: the C path calls its fn)

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __enter__(self) -> PythonCalls:
        def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
            if event == "call" and frame.f_code.co_name in self.NAMES and \
                    "mpidag/agent" in frame.f_code.co_filename:
                name = frame.f_code.co_name
                self.seen[name] = self.seen.get(name, 0) + 1
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


class HandDriven:
    """Two ranks of an in-process world with no threads: each call is carried through the
    real agents by this thread (as benchmarks/inproc_cost.py does)."""

    def __init__(self, compiled: bool = True) -> None:
        from mpidag.agent.options import MPIRpcBackendOptions
        from mpidag.transport.inproc import InProcWorld
        world = InProcWorld(2)
        options = MPIRpcBackendOptions(num_worker_threads=1, rpc_timeout=TIMEOUT)
        config = Config(gc_freeze=False, compiled=compiled)
        self.runtimes = on_every_rank(2, lambda r: Runtime.connect(
            world.transports[r], options=options, config=config))
        self.world, self.transports = world, world.transports
        self.agents = [runtime.agent for runtime in self.runtimes]

    def call(self, func, *args, **kwargs):
        record = self.agents[0].calls.send_call(1, func, args, kwargs, TIMEOUT, True, False)
        self.world.deliver_all([agent.dispatch for agent in self.agents])
        assert record.done
        if record.error is not None:
            raise record.error
        return record.value

    def close(self) -> None:
        for transport in self.transports:
            transport.close(collective=False)


@pytest.mark.parametrize("tensor_facts", ["read-in-cpp", "python-attributes"])
def test_plain_calls_take_the_compiled_path_on_both_ends(tensor_facts, monkeypatch):
    """(Tensors' layout, device, contiguity and size are read in C++ where _mpidag_torch is
    built, else through their Python attributes: both ways decide alike.)"""
    if tensor_facts == "python-attributes":
        monkeypatch.setattr(compiled, "_tensor_facts", lambda: None)
    ranks = HandDriven()
    try:
        assert ranks.agents[0].core is not None and ranks.agents[1].core is not None
        assert ranks.agents[0].call_path.startswith("compiled call path")
        for func in (rf.add, rf.noop, rf.identity):  # the first calls make the references
            ranks.call(func, *([1, 2][:func.__code__.co_argcount]))
        with PythonCalls() as python:
            for i in range(20):
                assert ranks.call(rf.add, i, 1) == i + 1
                assert ranks.call(rf.noop) is None
                assert ranks.call(rf.add, "a", "b") == "ab"
                assert ranks.call(rf.identity, 2j) == 2j
        assert python.seen == {}, python.seen
        # dense contiguous CPU tensors travel by the C path too, as arguments and results
        x = torch.arange(256, dtype=torch.float32)
        ranks.call(rf.same_object, 1, 1)
        ranks.call(rf.grad_flags, x)
        with PythonCalls() as python:
            assert torch.equal(ranks.call(rf.identity, x), x)
            assert ranks.call(rf.add, x, 1).tolist() == (x + 1).tolist()
            assert ranks.call(rf.same_object, x, x) is True  # sent once, one object there
            assert ranks.call(rf.same_object, x, x.clone()) is False
            assert ranks.call(rf.grad_flags, torch.ones(2, requires_grad=True), x) == \
                (True, False)
            assert ranks.call(rf.identity, torch.ones(0)).shape == (0,)
            # too large for frame 0 (160 KB): in a frame of its own, still by the C path
            big = torch.arange(40_000, dtype=torch.float32)
            assert torch.equal(ranks.call(rf.identity, big), big)
            assert torch.equal(ranks.call(rf.add, big, x[:1]), big + x[:1])
            assert ranks.call(rf.same_object, big, big) is True
        assert python.seen == {}, python.seen
        # a short tuple of plain values is a plain value, beside tensors or not
        ranks.call(rf.ids_and_total, (1,), x)
        with PythonCalls() as python:
            assert ranks.call(rf.identity, (1, "a", None)) == (1, "a", None)
            assert ranks.call(rf.ids_and_total, (7, 8, 9), x, x[:2]) == (7, 8, 9, 32641.0)
            assert ranks.call(rf.ids_and_total, (), x[:3]) == (3.0,)
            # more than 8 arguments (a gradient message of several recv functions)
            parts = [x[i:i + 2].clone() for i in range(12)]
            assert ranks.call(rf.ids_and_total, (5,), *parts) == (5, float(sum(
                p.sum() for p in parts)))
        assert python.seen == {}, python.seen
        # what is not plain takes the Python path, on both ends
        for args, name in [((x[::2],), "a view that is not contiguous"),
                           ((torch.nn.Parameter(torch.ones(2)),), "a parameter"),
                           (([1, 2],), "a list"),
                           ((tuple(range(9)),), "a tuple of more than 8 values"),
                           (((1, (2,)),), "a tuple holding a tuple"),
                           (((1, x[:1]),), "a tuple holding a tensor")]:
            with PythonCalls() as python:
                result = ranks.call(rf.identity, *args)
            assert python.seen.get("encode") == 1 and python.seen.get("serve_call") == 1, name
            assert type(result) is type(args[0]) and str(result) == str(args[0]), name
        many = [x[i:i + 1].clone() + 1 for i in range(70)]  # more than 64 arguments
        with PythonCalls() as python:
            assert ranks.call(rf.ids_and_total, (1,), *many) == (1, 70.0 + sum(range(70)))
        assert python.seen.get("encode") == 1 and python.seen.get("serve_call") == 1
        with PythonCalls() as python:
            assert ranks.call(rf.add, 1, b=2) == 3  # keyword arguments
        assert python.seen["encode"] == 1 and python.seen["serve_call"] == 1
        with PythonCalls() as python:  # an error is answered by the Python server
            with pytest.raises(ValueError, match="boom"):
                ranks.call(rf.raise_value_error, "boom")
            with pytest.raises(ValueError, match="again"):
                ranks.call(rf.raise_value_error, "again")
        assert python.seen["serve_call"] == 1  # (the first call: its reference)
    finally:
        ranks.close()


def _recorded_call(ranks: HandDriven, a: torch.Tensor, b: torch.Tensor,
                   grad_of_result: bool = True) -> dict:
    """One call of ``rf.add(a, b)`` in a new context on rank 0, carried by hand; what both
    ranks recorded, and the gradients a distributed backward pass would send back (each
    recv function's own graph, run locally on its rank)."""
    contexts = [runtime.autograd.container for runtime in ranks.runtimes]
    ctx = contexts[0].new_context()
    previous = contexts[0].enter(ctx)
    try:
        result = ranks.call(rf.add, a, b)
    finally:
        contexts[0].leave(previous)
    there = contexts[1].contexts[ctx.context_id]
    seen = {
        "result": result.detach().tolist(),
        "result_grad_fn": type(result.grad_fn).__name__ if result.grad_fn else None,
        "sends": [(s.peer, len(s.edges), [e.node.name() for e in s.edges])
                  for s in ctx.sends.values()],
        "recvs": [(r.peer, r.n_outputs, r.what) for r in ctx.recvs.values()],
        "sends_there": [(s.peer, len(s.edges), s.what) for s in there.sends.values()],
        "recvs_there": [(r.peer, r.n_outputs, r.what) for r in there.recvs.values()],
        "workers": (ctx._known_worker_ids(), there._known_worker_ids()),
        "ids_pair": ({m for m in ctx.sends} == {m for m in there.recvs},
                     {m for m in there.sends} == {m for m in ctx.recvs}),
    }
    if grad_of_result:
        # the callee's send function reaches the recv node of the arguments: its gradient
        # there is what rank 1 would send back for a and b
        send_there = next(iter(there.sends.values()))
        recv_node = send_there.edges[0].node.next_functions[0][0]
        grads = torch.autograd.grad([send_there.edges[0]], [
            torch.autograd.graph.GradientEdge(recv_node, 0),
            torch.autograd.graph.GradientEdge(recv_node, 1)],
            [torch.full_like(result, 3.0)], allow_unused=True)
        seen["callee_grads"] = [g.tolist() for g in grads]
    return seen


def _release_all(ranks: HandDriven) -> tuple[bool, bool]:
    """Release rank 0's contexts (a message to rank 1 each); whether any is left there."""
    contexts = [runtime.autograd.container for runtime in ranks.runtimes]
    for ctx in list(contexts[0].contexts.values()):
        contexts[0].release(ctx)
    ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
    return bool(contexts[0].contexts), bool(contexts[1].contexts)


def test_calls_in_an_autograd_context_take_the_compiled_path_and_record_what_python_does():
    compiled, python_path = HandDriven(), HandDriven(compiled=False)
    try:
        assert python_path.agents[0].core is None
        a, b = torch.rand(3, 3, requires_grad=True), torch.rand(3, 3, requires_grad=True)
        an = torch.rand(3, 3)
        for ranks in (compiled, python_path):  # the function's reference is made first
            ranks.call(rf.add, an, an)
        with PythonCalls() as python:
            with_grad = _recorded_call(compiled, a, b)
            without_grad = _recorded_call(compiled, an, an, grad_of_result=False)
        assert python.seen == {}, python.seen
        assert with_grad == _recorded_call(python_path, a, b)
        assert without_grad == _recorded_call(python_path, an, an, grad_of_result=False)
        assert _release_all(compiled) == _release_all(python_path) == (False, False)
        assert with_grad["result"] == (a.detach() + b.detach()).tolist()
        assert with_grad["result_grad_fn"] == "torch::distributed::autograd::RecvRpcBackward"
        assert with_grad["sends"] == [(1, 2, ["torch::autograd::AccumulateGrad"] * 2)]
        assert with_grad["recvs"] == [(1, 1, "the result of tests.rpc_funcs.add "
                                             "from worker1")]
        assert with_grad["recvs_there"] == [(0, 2, "the arguments of tests.rpc_funcs.add "
                                                   "from worker0")]
        assert with_grad["ids_pair"] == (True, True)
        assert with_grad["callee_grads"] == [[[3.0] * 3] * 3] * 2
        assert without_grad["sends"] == without_grad["recvs"] == []
        assert without_grad["workers"] == ({1}, {0})
    finally:
        compiled.close()
        python_path.close()


class ContextFrames:
    """The names of the functions of mpidag/dist_autograd/context.py that run in this thread
    (use it with :class:`HandDriven`)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __enter__(self) -> ContextFrames:
        def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
            code = frame.f_code
            if event == "call" and code.co_filename.endswith("dist_autograd/context.py"):
                self.seen[code.co_name] = self.seen.get(code.co_name, 0) + 1
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


#: the container's per-message hooks (and what they call) that the C++ recorder replaces
PER_MESSAGE_HOOKS = {"outgoing", "replying", "received", "serving", "served", "record_send",
                     "record_recv", "prepare_send", "next", "prepare"}
#: and its methods of a context's life
LIFE = {"new_context", "incoming", "release", "release_id", "_remember", "__init__"}


class _Unhashable:
    """A callable that cannot be a key of describe's cache."""

    __hash__ = None  # type: ignore[assignment]

    def __call__(self, *args: Any) -> None:
        pass


def test_the_compiled_message_names_are_the_agents_python_names_asked_for_when_read():
    ranks = HandDriven()
    try:
        agent = ranks.agents[0]
        core, calls, server = agent.core, agent.calls, agent.server
        described: list[tuple] = []
        handler = Handler("test.proxy", print,
                          describe=lambda *a: described.append(a) or f"a proxy of {a[0]} (π)")
        funcs = [rf.add, torch.add, handler, _Unhashable(), lambda x: x]
        python = {
            "arguments_sent": calls.arguments_sent,
            "arguments_served": server.arguments_served,
            "result_sent": lambda func, args, rank: server.result_sent((func, args), rank),
            "result_from": calls.result_from,
        }
        for func in funcs:
            for kind, name_of in python.items():
                for rank in (0, 1):
                    name = core.message_name(kind, func, ("x", 2), rank)
                    assert callable(name) and "worker" in repr(name)
                    assert name() == name_of(func, ("x", 2), rank), (kind, func)
        assert core.message_name("arguments_from", None, None, 1)() == \
            server.arguments_from(1) == "the arguments of a call from worker1"
        assert core.message_name("result_sent", rf.add, None, 0)() == \
            "the result of tests.rpc_funcs.add sent to worker0"
        described.clear()
        lazy = core.message_name("arguments_sent", handler, ("y",), 1)
        assert described == []  # named when read, not when made
        assert lazy() == "the arguments of a proxy of y (π) sent to worker1"
        assert described == [("y",)]
        with pytest.raises(ValueError, match="no message name of kind 'result'"):
            core.message_name("result", rf.add, (), 1)
        with pytest.raises(IndexError, match="no worker name for rank 2"):
            core.message_name("result_from", rf.add, (), 2)
        with pytest.raises(TypeError, match="takes no arguments"):
            lazy(1)
    finally:
        ranks.close()


def test_a_compiled_container_records_each_message_without_its_python_hooks():
    if native.records_module() is None:
        pytest.skip(f"needs mpidag's C++ records: {native.problem()}")
    ranks = HandDriven()
    try:
        containers = [runtime.autograd.container for runtime in ranks.runtimes]
        assert all(isinstance(c, native.records_module().ContextRecorder) for c in containers)
        assert all(runtime.agent.observer is c for runtime, c in zip(ranks.runtimes,
                                                                       containers, strict=True))
        a, b = torch.rand(2, requires_grad=True), torch.rand(2, requires_grad=True)
        ranks.call(rf.add, a.detach(), b.detach())
        _recorded_call(ranks, a, b)  # (the first release message makes its handler's
        assert _release_all(ranks) == (False, False)  # reference, in Python)
        with ContextFrames() as first:  # a context new on the callee: its Python incoming()
            seen = _recorded_call(ranks, a, b)
        ctx_id = max(containers[0].contexts)
        ctx = containers[0].contexts[ctx_id]
        previous = containers[0].enter(ctx)
        try:
            with ContextFrames() as later:  # both ranks know the context now
                result = ranks.call(rf.add, a, b)
        finally:
            containers[0].leave(previous)
        # (nor the records' own __init__: the C++ makes them through their slots)
        assert not set(first.seen) & (PER_MESSAGE_HOOKS | LIFE), first.seen
        assert not set(later.seen) & (PER_MESSAGE_HOOKS | LIFE), later.seen
        # what was recorded: the SendFunction/RecvRecord objects Python reads
        assert seen["ids_pair"] == (True, True)
        assert len(ctx.sends) == len(ctx.recvs) == 2
        send = ctx.sends[max(ctx.sends)]
        assert isinstance(send, SendFunction) and send.peer == 1
        assert send.reach is not None  # walked right after it was sent ("sent")
        assert send.message_id == max(ctx.sends) and send._tensors is None
        assert [edge.node.variable is t for edge, t in zip(send.edges, (a, b),
                                                           strict=True)] == [True, True]
        assert send.what == "the arguments of tests.rpc_funcs.add sent to worker1"
        record = ctx.recvs[max(ctx.recvs)]
        assert isinstance(record, RecvRecord) and record.peer == 1 and record.n_outputs == 1
        assert (record.context_id, record.message_id) == (ctx_id, max(ctx.recvs))
        assert record.node() is result.grad_fn and result.grad_fn.record is record
        assert containers[0].debug_info()["num_live_recv_functions"] >= 2
        assert containers[0].debug_info()["num_send_functions"] == 2
        assert type(result.grad_fn).__name__ == "torch::distributed::autograd::RecvRpcBackward"
        assert result.grad_fn.record.what == "the result of tests.rpc_funcs.add from worker1"
        # a custom Function's output: its send function is walked by Python's prepare()
        previous = containers[0].enter(ctx)
        try:
            with ContextFrames() as custom:
                cubed = ranks.call(rf.identity, Cube.apply(a))
        finally:
            containers[0].leave(previous)
        assert custom.seen.get("prepare") == 1, custom.seen
        send = ctx.sends[max(ctx.sends)]
        assert send.reach is not None and send.what.startswith("the arguments of ")
        assert [edge.node.name() for edge in send.edges] == ["CubeBackward"]
        assert torch.equal(cubed, a ** 3)
        with ContextFrames() as released:  # the release and its message: all C++
            assert _release_all(ranks) == (False, False)
        assert released.seen == {}, released.seen
        assert containers[0].contexts == containers[1].contexts == {}
        assert not containers[0].active and not containers[1].active
        assert ctx.released and ctx.sends == ctx.recvs == {}
        assert ctx_id in containers[0]._released_set and ctx_id in containers[1]._released_set
        del send
        assert containers[0].debug_info()["num_live_send_functions"] == 0
    finally:
        ranks.close()


def test_the_compiled_recorder_refuses_to_run_unbound_and_leaves_rare_cases_to_python(
        monkeypatch, caplog):
    module = native.records_module()
    if module is None:
        pytest.skip(f"needs mpidag's C++ records: {native.problem()}")
    with pytest.raises(RuntimeError, match="never bound"):
        module.ContextRecorder().outgoing(1, [], lambda: "a call")
    with pytest.raises(TypeError, match=r"outgoing\(dst, tensors, what\) takes 3"):
        module.ContextRecorder().outgoing(1)
    ranks = HandDriven()
    try:
        containers = [runtime.autograd.container for runtime in ranks.runtimes]
        a = torch.rand(2, requires_grad=True)
        ranks.call(rf.identity, a.detach())
        # a released context records nothing; a context of another container neither
        ctx = containers[0].new_context()
        containers[0].release(ctx, from_rank=None)
        containers[0].release(ctx)  # (again: nothing left to do)
        with pytest.raises(TypeError, match="ctx must be a DistAutogradContext"):
            containers[0].release(ctx.context_id)
        with pytest.raises(TypeError, match=r"release\(ctx, from_rank=None\)"):
            containers[0].release(ctx, rank=1)
        containers[1].release_id(12345, 0)  # an id this rank never saw: remembered
        assert 12345 in containers[1]._released_set
        assert containers[1].incoming(12345, 0) is None  # its late messages: not recorded
        assert 12345 not in containers[1].contexts
        previous = containers[0].enter(ctx)
        try:
            assert containers[0].outgoing(1, [a], lambda: "x") == (0, 0)
            assert containers[0].replying(ctx.context_id, 1, [a], lambda: "x") == 0
            assert containers[1].outgoing(0, [a], lambda: "x") == (0, 0)
        finally:
            containers[0].leave(previous)
        # under a functorch transform the Python records (RecvRPC.apply) are made
        context_module = mpidag.dist_autograd.context
        functorch_active = context_module._functorch_active
        monkeypatch.setattr(context_module, "_functorch_active", lambda: True)
        for container in containers:
            container._start_recording()  # (bound again: with the check above)
        ctx = containers[0].new_context()
        previous = containers[0].enter(ctx)
        try:
            with ContextFrames() as frames:
                result = ranks.call(rf.identity, a)
        finally:
            containers[0].leave(previous)
            monkeypatch.setattr(context_module, "_functorch_active", functorch_active)
            for container in containers:
                container._start_recording()
        assert frames.seen.get("record_recv") == 2, frames.seen
        assert result.grad_fn.name() == "torch::distributed::autograd::RecvRpcBackward"
        assert torch.equal(result, a)
        containers[0].release(ctx)
        ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
        # a walk that fails after the send is logged, not raised
        monkeypatch.setattr(context_module, "_walking_lock", _BrokenLock)
        containers[0]._start_recording()  # (bound to the broken locks)
        ctx = containers[0].new_context()
        previous = containers[0].enter(ctx)
        try:
            with caplog.at_level(logging.DEBUG, logger="mpidag.dist_autograd.context"):
                assert torch.equal(ranks.call(rf.identity, a), a)
        finally:
            containers[0].leave(previous)
            monkeypatch.undo()
            containers[0]._start_recording()
        assert "could not walk the graph of SendRpcBackward" in caplog.text
        assert "RuntimeError: the walk broke" in caplog.text
        containers[0].release(ctx)
        ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
    finally:
        ranks.close()


class _FailingCount:
    """A live count whose ticket refuses: making a record that it counts fails."""

    def ticket(self):
        raise RuntimeError("recording broke")


class _BrokenLock:
    """A send function's walking lock that breaks its walk."""

    def acquire(self, *args):
        raise RuntimeError("the walk broke")

    __enter__ = acquire

    def release(self):
        pass

    def __exit__(self, *exc):
        pass


def test_a_failing_recording_in_a_context_is_the_calls_error_on_the_compiled_path(
        monkeypatch):
    ranks = HandDriven()
    try:
        a = torch.ones(2, requires_grad=True)
        ranks.call(rf.identity, torch.ones(2))
        contexts = [runtime.autograd.container for runtime in ranks.runtimes]
        # a recv record's count refuses: the Python and the C++ hooks both count it
        counts = [container.live_recvs for container in contexts]
        failing = {"rank": 1}

        def refuse(container: Any, rank: int) -> None:
            container.live_recvs = _FailingCount() if rank == failing["rank"] \
                else counts[rank]
            container._start_recording()  # (the compiled container: bound to it)
        # the callee's failure: the Python server answers with the error, which the caller's
        # Python completes; the caller's: the C path completes the call with its error
        python_answers = {"serve_call": 1, "dispatch": 1, "complete": 1}
        for rank, error, seen in ((1, "recording broke", python_answers),
                                  (0, "could not unpickle the result of "
                                      "tests.rpc_funcs.identity from worker1: recording "
                                      "broke", {})):
            failing["rank"] = rank
            for r, container in enumerate(contexts):
                refuse(container, r)
            ctx = contexts[0].new_context()
            previous = contexts[0].enter(ctx)
            try:
                with PythonCalls() as python, pytest.raises(Exception, match=error):
                    ranks.call(rf.identity, a)
            finally:
                contexts[0].leave(previous)
            assert ranks.agents[0].calls.table == {}
            assert python.seen == seen
            contexts[0].release(ctx)
            ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
        sent, processed = ranks.agents[0].sender.counters.totals(set())
        sent1, processed1 = ranks.agents[1].sender.counters.totals(set())
        assert (sent, processed) == (processed1, sent1)  # every message handled
    finally:
        ranks.close()


def test_plain_notifications_take_the_compiled_path_in_order_and_failures_are_logged(
        caplog):
    ranks = HandDriven()
    try:
        seen: list[tuple] = []
        handlers = {}
        for agent in ranks.agents:  # a handler is found by its name on the receiver
            handlers["control"] = agent.register_handler(
                "test.control", lambda *a: seen.append(("control", a)), mode="control")
            handlers["notify"] = agent.register_handler(
                "test.notify", lambda *a: seen.append(("notify", a)), mode="notify")
            handlers["fails"] = agent.register_handler(
                "test.fails", rf.raise_value_error, mode="control")
        sender = ranks.agents[0]
        for name in ("control", "notify"):  # the first of each makes its reference
            sender.notify(1, handlers[name], (0,))
        sender.notify(1, rf.noop, ())
        ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
        seen.clear()
        x = torch.arange(3.0)
        with PythonCalls() as python:
            sender.notify(1, handlers["control"], (1, "a"))
            sender.notify(1, handlers["notify"], (2, x))
            sender.notify(1, handlers["control"], (3,))
            sender.notify(1, rf.noop, ())  # a plain function: a NOTIFY
            # a control message runs at its dispatch; a NOTIFY is a work item
            env = ranks.transports[1].poll()
            assert ranks.agents[1].dispatch(env) is None and seen == [("control", (1, "a"))]
            work = ranks.agents[1].dispatch(ranks.transports[1].poll())
            assert callable(work) and len(seen) == 1
            work()
            ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
        assert python.seen == {}, python.seen
        assert [kind for kind, _ in seen] == ["control", "notify", "control"]
        assert seen[1][1][0] == 2 and torch.equal(seen[1][1][1], x)
        with caplog.at_level("ERROR", logger="mpidag.agent.agent"):
            sender.notify(1, handlers["fails"], ("refused",))
            sender.notify(1, handlers["fails"], ("refused again",))
            ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
        failures = [r for r in caplog.records if "notification from rank 0 failed" in
                    r.getMessage()]
        assert [str(r.exc_info[1]) for r in failures] == ["refused", "refused again"]
        sent, processed = sender.sender.counters.totals(set())
        sent1, processed1 = ranks.agents[1].sender.counters.totals(set())
        assert (sent, processed) == (processed1, sent1)  # every message handled
        with PythonCalls() as python:  # arguments that are not plain: the Python path
            sender.notify(1, handlers["control"], ([4],))
            ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
        assert python.seen.get("encode") == 1 and python.seen.get("serve_notify") == 1
        assert seen[-1] == ("control", ([4],))
    finally:
        ranks.close()


def test_the_compiled_path_sends_the_bytes_the_python_path_sends(world, monkeypatch):
    agent = world[0].agent
    transport = agent.transport
    sent: list[tuple[int, bytes]] = []
    send_frame0 = transport.send_frame0

    def record(dst, frame0):
        sent.append((dst, bytes(frame0)))
        send_frame0(dst, frame0)

    monkeypatch.setattr(transport, "send_frame0", record)
    assert sync(world[0], 1, rf.add, 2, 3) == 5  # the reference is made: Python
    assert sync(world[0], 1, rf.add, 2, 3) == 5  # C
    core, agent.calls.core = agent.calls.core, None
    try:
        assert sync(world[0], 1, rf.add, 2, 3) == 5  # Python again
    finally:
        agent.calls.core = core
    envs = [frames.decode_header(bytearray(frame), 0)[0] for _, frame in sent]
    assert [dst for dst, _ in sent] == [1, 1, 1]
    assert {(env.kind, env.flags, bytes(env.payload)) for env in envs} == \
        {(CALL, FLAG_FUNCTION_REF | FLAG_PLAIN, bytes(envs[0].payload))}
    assert envs[1].request_id == envs[0].request_id + 1 == envs[2].request_id - 1


def test_the_message_counters_add_up_as_on_the_python_path(world):
    sender0, sender1 = world[0].agent.sender, world[1].agent.sender
    assert isinstance(sender0.counters, fastpath.compiled_module().Counters)
    sync(world[0], 1, rf.noop)
    on_every_rank(2, lambda r: world[r].agent.wait_quiescent(TIMEOUT))
    before = (sender0.sent, sender0.processed, sender1.sent, sender1.processed)
    for _ in range(10):
        sync(world[0], 1, rf.noop)
    with pytest.raises(ValueError, match="boom"):
        sync(world[0], 1, rf.raise_value_error, "boom")
    # each call: one request and one answer, each handled once
    after = (sender0.sent, sender0.processed, sender1.sent, sender1.processed)
    assert [b - a for a, b in zip(before, after, strict=True)] == [11, 11, 11, 11]
    on_every_rank(2, lambda r: world[r].agent.wait_quiescent(TIMEOUT))  # terminates


def test_errors_keep_their_type_message_and_remote_traceback(world):
    for _ in range(2):  # the first call makes the reference, the second is C's
        with pytest.raises(rf.CustomError) as info:
            sync(world[0], 1, rf.raise_custom, 7)
        assert info.value.code == 7
        cause = "".join(str(c) for c in [info.value.__cause__])
        assert "raise_custom" in cause  # the callee's traceback names the function
    with pytest.raises(ValueError, match="no such thing"):
        sync(world[0], 1, rf.raise_value_error, "no such thing")


def test_a_plain_call_still_times_out_and_its_late_answer_is_dropped(world):
    agent = world[0].agent
    assert sync(world[0], 1, rf.sleep_then, 0, 1) == 1
    with pytest.raises(RPCTimeoutError, match="sleep_then"):
        agent.call_sync(1, rf.sleep_then, (0.5, 2), {}, 0.05)
    assert len(agent.calls) == 0
    assert sync(world[0], 1, rf.add, 1, 1) == 2  # the late answer did not disturb this one
    on_every_rank(2, lambda r: world[r].agent.wait_quiescent(TIMEOUT))


def test_futures_of_plain_calls_complete_with_and_without_callbacks(world):
    agent = world[0].agent
    sync(world[0], 1, rf.add, 1, 1)
    futures = [agent.call(1, rf.add, (i, i), {}, TIMEOUT) for i in range(50)]
    assert [agent.wait(fut, TIMEOUT) for fut in futures] == [2 * i for i in range(50)]
    fut = agent.call(1, rf.add, (2, 2), {}, TIMEOUT)
    chained = fut.then(lambda f: f.value() * 10)  # completed off the leader (Python)
    assert chained.wait() == 40 and fut.wait() == 4


def test_a_function_replaced_in_its_module_is_found_again(world, monkeypatch):
    assert sync(world[0], 1, rf.identity, 4) == 4
    assert sync(world[0], 1, rf.identity, 4) == 4

    def doubled(x):
        return 2 * x

    doubled.__qualname__, doubled.__module__ = "identity", rf.__name__
    monkeypatch.setattr(rf, "identity", doubled)
    assert sync(world[0], 1, rf.identity, 4) == 8


def test_results_that_are_not_plain_are_answered_by_python(world):
    sync(world[0], 1, rf.make_big, 8)
    t = sync(world[0], 1, rf.make_big, 8)
    assert isinstance(t, torch.Tensor) and t.tolist() == [0, 1]
    with pytest.raises(Exception, match="could not be sent back"):
        sync(world[0], 1, rf.return_unpicklable)


def test_without_the_compiled_path_the_agent_counts_in_python():
    runtimes = start_world(2)
    try:
        assert runtimes[0].agent.core is not None
    finally:
        on_every_rank(2, lambda r: runtimes[r].shutdown(graceful=True, timeout=TIMEOUT))
    from mpidag.agent.options import MPIRpcBackendOptions
    from mpidag.transport.inproc import InProcWorld
    world = InProcWorld(2)
    options = MPIRpcBackendOptions(num_worker_threads=2, rpc_timeout=TIMEOUT)
    config = Config(gc_freeze=False, poll_spin=2e-3, compiled=False)
    runtimes = on_every_rank(2, lambda r: Runtime.connect(world.transports[r],
                                                          options=options, config=config))
    for runtime in runtimes:
        runtime.serve()
    try:
        assert runtimes[0].agent.core is None
        assert runtimes[0].agent.call_path == "Python call path: MPIDAG_COMPILED=0"
        assert isinstance(runtimes[0].agent.sender.counters, fastpath.PythonCounters)
        assert call(runtimes[0], 1, rf.add, 2, 3) == 5
    finally:
        on_every_rank(2, lambda r: runtimes[r].shutdown(graceful=True, timeout=TIMEOUT))


def test_compiled_and_python_counters_agree():
    module = fastpath.compiled_module()
    steps = [("sent", 1), ("sent", 2), ("answered", 0), ("processed", 2), ("unsent", 1),
             ("answered", 2), ("processed", 1)]
    both = [module.Counters(3), fastpath.PythonCounters(3)]
    for name, rank in steps:
        for counters in both:
            getattr(counters, name)(rank)
    for failed in (set(), {2}, {0, 1, 2}, [1], frozenset({0})):
        assert both[0].totals(failed) == both[1].totals(failed)
    assert (both[0].sent_total, both[0].processed_total) == \
        (both[1].sent_total, both[1].processed_total) == (3, 4)
    with pytest.raises(IndexError, match="outside the world of size 3"):
        both[0].sent(3)
    with pytest.raises(ValueError, match="at least 1"):
        module.Counters(0)


@pytest.mark.parametrize("value", [
    None, True, 3, 2.5, "s", b"b", 1j, (), (1, "a", None), tuple(range(8)),
    tuple(range(9)), [1], {"a": 1}, (1, [2]), torch.ones(1), (torch.ones(1),), object(),
    ((1, 2),), frozenset({1}),
])
def test_is_plain_in_c_agrees_with_python(value):
    assert fastpath.compiled_module().is_plain(value) is frames.is_plain(value)


PICKLED_AS_PICKLE_DOES = [
    None, True, False, 0, 1, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, 2**31,
    -2**31 - 1, 2**63 - 1, -2**63, 0.0, -0.0, 1.5, float("inf"), -1e300, "", "a", "é" * 200,
    "x" * 300, b"", b"ab", b"x" * 300, {}, (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4),
    ((1, "a"), {}, (0, -1)), ((1,), ()),
]


@pytest.mark.parametrize("value", PICKLED_AS_PICKLE_DOES)
def test_plain_values_are_written_as_pickle_reads_them(value):
    written = fastpath.compiled_module().plain_pickle(value)
    back = pickle.loads(written)
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)  # -0.0 stays -0.0
    assert written.startswith(b"\x80\x05") and len(written) < len(pickle.dumps(value, 5)) + 1


def test_integers_of_every_size_are_written_exactly():
    module = fastpath.compiled_module()
    values = [(1 << bits) + delta for bits in range(64) for delta in (-1, 0, 1)]
    values += [-v for v in values]
    for value in values:
        written = module.plain_pickle(value)
        if -2**63 <= value < 2**63:
            assert pickle.loads(written) == value, value
        else:  # beyond 64 bits: left to pickle.dumps
            assert written is None, value


@pytest.mark.parametrize("value", PICKLED_AS_PICKLE_DOES)
def test_plain_values_are_read_back_as_pickle_reads_them(value):
    """The compiled path reads a plain pickle itself (``plain_load``) where it would call
    ``pickle.loads``: the same value, type and ``repr`` as pickle's, for what the writer
    wrote; a ``pickle.dumps`` of the same value (FRAME, MEMOIZE) is left to pickle."""
    module = fastpath.compiled_module()
    written = module.plain_pickle(value)
    read, back = module.plain_load(written)
    assert read and back == value and type(back) is type(value) and repr(back) == repr(value)
    assert module.plain_load(memoryview(b"xy" + written)[2:]) == (True, back)
    dumped = pickle.dumps(value, 5)
    if dumped != written:
        assert module.plain_load(dumped) == (False, None)


def test_the_plain_reader_integers_of_every_size_and_every_broken_pickle():
    module = fastpath.compiled_module()
    values = [(1 << bits) + delta for bits in range(63) for delta in (-1, 0, 1)]
    values += [-v for v in values] + [-2**63, 2**63 - 1]
    for value in values:
        assert module.plain_load(module.plain_pickle(value)) == (True, value), value
    # every cut and every flipped byte of a nested pickle: the same value as pickle.loads
    # gives, or "not plain" (then pickle.loads reads it), never another value or a crash
    written = module.plain_pickle((1, "é", (b"x" * 3, None, 2.5, (True, -7, 1, 2)), {}))
    broken = [written[:cut] for cut in range(len(written))]
    broken += [written[:i] + bytes([b]) + written[i + 1:]
               for i in range(len(written)) for b in (0, 0x2e, 0x28, 0x74, 0x85, 0xff)]
    for data in broken:
        read, value = module.plain_load(data)
        if read:
            assert value == pickle.loads(data) and type(value) is type(pickle.loads(data))
        else:
            assert value is None
    for data in (b"", b"\x80", b"\x80\x05", b"\x80\x03N.", b"\x80\x05N", b"\x80\x05NN.",
                 b"\x80\x05(N.", b"\x80\x05t.", b"\x80\x05\x86.", b"\x80\x05\x8c\x02\xff\xfe.",
                 b"\x80\x05\x8a\x09" + b"\x00" * 9 + b".", b"\x80\x05" + b"(" * 5 + b"."):
        assert module.plain_load(data) == (False, None), data
    with pytest.raises(TypeError):
        module.plain_load("not a buffer")


@pytest.mark.parametrize("value", [
    2**64, 1j, "\ud800", {"a": 1}, [1], ((((1,),),),), frozenset({1}), torch.ones(1),
])
def test_what_the_writer_does_not_know_is_left_to_pickle(value):
    assert fastpath.compiled_module().plain_pickle(value) is None


def test_an_asynchronous_handler_is_served_and_answered_by_the_compiled_path():
    ranks = HandDriven()
    try:
        agent = ranks.agents[1]
        pending: list[tuple[torch.futures.Future, int]] = []

        def answered_now(x):
            fut = torch.futures.Future()
            fut.set_result((x, "now"))
            return fut

        def answered_later(x):
            fut = torch.futures.Future()
            pending.append((fut, x))
            return fut

        def fails_later(x):
            fut = torch.futures.Future()
            fut.set_exception(ValueError(f"no {x}"))
            return fut

        now = agent.register_handler("test.now", answered_now, asynchronous=True)
        later = agent.register_handler("test.later", answered_later, asynchronous=True)
        fails = agent.register_handler("test.fails", fails_later, asynchronous=True)
        for handler in (now, later, fails):  # (the first call of each: Python)
            ranks.agents[0].calls.send_call(1, handler, (0,), {}, TIMEOUT, True, False)
            ranks.world.deliver_all([a.dispatch for a in ranks.agents])
        for fut, x in pending:
            fut.set_result(x)
        ranks.world.deliver_all([a.dispatch for a in ranks.agents])
        pending.clear()
        with PythonCalls() as python:
            assert ranks.call(now, 7) == (7, "now")
        assert python.seen == {}, python.seen
        with PythonCalls() as python:  # answered when its future completes: still in C
            record = ranks.agents[0].calls.send_call(1, later, (8,), {}, TIMEOUT, True,
                                                     False)
            ranks.world.deliver_all([a.dispatch for a in ranks.agents])
            assert not record.done and len(pending) == 1
            pending[0][0].set_result((8, "later"))
            ranks.world.deliver_all([a.dispatch for a in ranks.agents])
        assert record.done and record.value == (8, "later")
        assert python.seen == {}, python.seen
        with pytest.raises(ValueError, match="no 9"):  # a failed future: its error, typed
            ranks.call(fails, 9)
    finally:
        ranks.close()


def test_plain_results_answered_by_python_carry_the_plain_flag(world, monkeypatch):
    transport = world[1].agent.transport
    sent: list[bytes] = []
    send_frame0 = transport.send_frame0

    def record(dst, frame0):
        sent.append(bytes(frame0))
        send_frame0(dst, frame0)

    monkeypatch.setattr(transport, "send_frame0", record)
    assert sync(world[0], 1, rf.whoami) is not None  # first call: served by Python
    assert sync(world[0], 1, rf.identity, [3]) == [3]  # a list: Python, not plain
    kinds = [frames.decode_header(bytearray(frame), 1)[0] for frame in sent]
    assert [(env.kind, env.flags) for env in kinds] == [(RESULT, FLAG_PLAIN), (RESULT, 0)]


def test_the_python_server_reads_the_tensor_slots_the_compiled_caller_sends():
    from mpidag.agent.agent import RpcAgent
    ranks = HandDriven()
    try:
        x = torch.arange(4.0)
        for func in (rf.same_object, rf.add):
            ranks.call(func, 1, 1)  # the caller's references
        callee = ranks.agents[1]
        callee.dispatch = RpcAgent.dispatch.__get__(callee)  # the callee serves in Python
        with PythonCalls() as python:
            assert ranks.call(rf.same_object, x, x) is True
            assert ranks.call(rf.add, x, 2.0).tolist() == [2.0, 3.0, 4.0, 5.0]
        assert python.seen.get("encode") is None and python.seen["decode"] == 2
    finally:
        ranks.close()


def test_the_api_hands_common_calls_to_the_compiled_path_and_checks_the_rest(world):
    """``rpc_sync``/``rpc_async`` give a call of common arguments to ``Core.rpc``; any other
    argument takes the API's Python checks, with torch's errors."""
    import mpidag.rpc as rpc
    from mpidag._runtime import bind_thread
    from mpidag.errors import InvalidArgumentError, UnknownWorkerError
    core = world[0].agent.core
    bind_thread(world[0])
    try:
        rpc.rpc_sync("worker1", rf.add, args=(1, 2))  # the reference
        for to in ("worker1", 1):
            for timeout in (-1.0, None, 0, 5, 2.5):
                call = core.rpc(to, rf.add, (1, 2), None, timeout, False)
                assert world[0].agent.calls.finish(call) == 3
            fut = core.rpc(to, rf.add, (4, 5), {}, -1.0, True)
            # made in C as RpcFuture.__init__ makes it
            made = RpcFuture(world[0].agent.engine)
            assert type(fut) is RpcFuture and fut.engine is made.engine
            assert vars(fut) == vars(made) == {}  # the engine in its slot, no dict made
            assert fut.wait() == 9
        info = rpc.get_worker_info("worker1")
        for to, args, kwargs, timeout in [
                (info, (1, 2), None, -1.0),  # a WorkerInfo
                ("worker1", [1, 2], None, -1.0),  # a list
                ("worker1", (1,), {"b": 2}, -1.0),  # keyword arguments
                ("worker1", (1, 2), None, float("inf")),  # no timeout, by inf
                (True, (1, 2), None, -1.0)]:  # a bool is not a rank
            assert core.rpc(to, rf.add, args, kwargs, timeout, False) is None
        assert rpc.rpc_sync(info, rf.add, args=[1, 2]) == 3
        assert rpc.rpc_sync("worker1", rf.add, args=(1,), kwargs={"b": 2}) == 3
        assert rpc.rpc_async(1, rf.add, args=(1, 2), timeout=float("inf")).wait() == 3
        with pytest.raises(TypeError, match="args must be a tuple"):
            rpc.rpc_sync("worker1", rf.add, args=5)
        with pytest.raises(TypeError, match="function should be callable, got list"):
            rpc.rpc_sync("worker1", [1, 2], args=(1, 2))  # (unhashable: not a table key)
        with pytest.raises(TypeError, match="function should be callable, got int"):
            rpc.rpc_async("worker1", 7)
        with pytest.raises(InvalidArgumentError, match="timeout=-5"):
            rpc.rpc_async("worker1", rf.add, args=(1, 2), timeout=-5)
        with pytest.raises(InvalidArgumentError, match="timeout=nan"):
            rpc.rpc_sync("worker1", rf.add, args=(1, 2), timeout=float("nan"))
        with pytest.raises(UnknownWorkerError, match="worker7"):
            rpc.rpc_sync("worker7", rf.add, args=(1, 2))
        with pytest.raises(UnknownWorkerError, match="unknown destination rank 5"):
            rpc.rpc_async(5, rf.add, args=(1, 2))
    finally:
        bind_thread(None)


def test_waiting_answers_are_completed_in_one_dispatch_and_the_rest_keeps_its_order():
    ranks = HandDriven()
    try:
        caller, callee = ranks.agents
        ranks.call(rf.add, 1, 1)
        ranks.call(rf.identity, 1)

        def send(func, *args):
            return caller.calls.send_call(1, func, args, {}, TIMEOUT, True, True).future

        futures = [send(rf.add, i, 1) for i in range(10)]
        futures.append(send(rf.identity, [7]))  # a list: answered and completed in Python
        futures += [send(rf.add, i, 100) for i in range(5)]
        while (env := ranks.transports[1].poll()) is not None:  # the callee serves them all
            work = callee.dispatch(env)
            if work is not None:
                work()
        first = ranks.transports[0].poll()
        with PythonCalls() as python:
            assert caller.dispatch(first) is None
        assert python.seen == {}, python.seen
        assert [f.done() for f in futures] == [True] * 10 + [False] * 6
        assert [f.wait() for f in futures[:10]] == [i + 1 for i in range(10)]
        after = ranks.transports[0].poll()  # the list's answer, put back first
        with PythonCalls() as python:
            caller.dispatch(after)
        assert python.seen["complete"] == 1 and futures[10].wait() == [7]
        assert caller.dispatch(ranks.transports[0].poll()) is None  # the next burst
        assert [f.wait() for f in futures[11:]] == [i + 100 for i in range(5)]
        assert ranks.transports[0].poll() is None and len(caller.calls) == 0
    finally:
        ranks.close()


@pytest.mark.parametrize("doorbell", ["C", "Python"])
def test_a_completion_interrupts_the_wait_and_rings_the_doorbell(doorbell, monkeypatch):
    """After a completion the C path does what ``engine.wake_waiters`` does: the engine's
    interrupt always (a leader's ``poll_wait`` window ends), then the engine's doorbell.
    The compiled agent's doorbell is ``_mpidag_fastpath.Doorbell``: the C path rings it
    with a C call, no Python frame, whether a user thread waits or not. With the Python
    doorbell it calls ``wake_waiters`` itself, and only while ``engine.waiting_users`` is
    not 0."""
    from mpidag.agent import agent as agent_module
    from mpidag.transport.doorbell import Doorbell

    if doorbell == "Python":
        monkeypatch.setattr(agent_module, "new_doorbell", lambda compiled: Doorbell())
    ranks = HandDriven()
    try:
        engine = ranks.agents[0].engine
        bell = engine.doorbell
        assert isinstance(bell, Doorbell if doorbell == "Python" else
                          fastpath.compiled_module().Doorbell)
        ranks.call(rf.add, 1, 2)  # (the first call makes the function's reference)
        seen: dict[str, int] = {}

        def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
            name = frame.f_code.co_name
            if event == "call" and name in ("wake_waiters", "interrupt_wait", "ring"):
                seen[name] = seen.get(name, 0) + 1

        rung = []
        sys.setprofile(profile)
        try:
            before = bell.generation
            assert ranks.call(rf.add, 2, 3) == 5
            rung.append(bell.generation - before)
            none_waiting = dict(seen)
            seen.clear()
            engine.waiting_users += 1  # as a user thread parked in wait_until counts itself
            try:
                before = bell.generation
                assert ranks.call(rf.add, 3, 4) == 7
                rung.append(bell.generation - before)
            finally:
                engine.waiting_users -= 1
        finally:
            sys.setprofile(None)
        # the in-process transport's interrupt_wait is Python, so it shows here; the MPI
        # transport's is the wire's C interrupt
        assert none_waiting == {"interrupt_wait": 1}, none_waiting
        if doorbell == "C":
            assert seen == {"interrupt_wait": 1}, seen
            assert rung == [1, 1]
        else:
            assert seen == {"interrupt_wait": 2, "wake_waiters": 1, "ring": 1}, seen
            assert rung == [0, 1]
        assert engine.interrupt == ranks.transports[0].interrupt_wait
    finally:
        ranks.close()


def test_a_build_that_fills_other_slots_is_not_used(monkeypatch):
    """The C path makes Envelope and PendingCall objects through their slots: a build whose
    list of slots differs from the classes' (sources changed without a rebuild) must not
    be used, and the status says why."""
    from mpidag.agent import compiled
    module = fastpath.compiled_module()
    assert compiled.slots_drift(module) == ""
    monkeypatch.setattr(module, "PENDING_CALL_FIELDS", module.PENDING_CALL_FIELDS[:-1])
    assert compiled.slots_drift(module) == "PendingCall"
    ranks = HandDriven()
    try:
        assert ranks.agents[0].core is None
        assert "fills other slots than PendingCall" in ranks.agents[0].call_path
        assert ranks.call(rf.add, 2, 3) == 5  # the Python path
    finally:
        ranks.close()


def test_the_leader_step_polls_dispatches_and_says_what_it_did():
    """``Core.step(wait)``, the progress engine's leader step: ``False`` when nothing
    arrived, the work item of a call, ``None`` for an answer it completed; messages to the
    rank itself (the loopback queue) and messages with frames after frame 0 (a tensor too
    large to travel inline, finished by ``transport.receive_rest``) come through it too."""
    ranks = HandDriven()
    try:
        caller, callee = ranks.agents
        assert callee.core.step(0.0) is False and caller.core.step(0.0) is False
        big = torch.arange(float(1 << 16))  # 256 KiB: its own frame
        for dst, func, args in ((1, rf.add, (2, 3)), (1, rf.identity, (big,)),
                                (0, rf.add, (4, 5))):
            record = caller.calls.send_call(dst, func, args, {}, TIMEOUT, True, False)
            server = ranks.agents[dst].core
            work = server.step(0.0)
            assert callable(work), work
            work()
            if dst == 1:
                assert server.step(0.0) is False  # nothing else arrived
            assert caller.core.step(0.0) is None and record.done, (dst, func)
            expected = big if func is rf.identity else sum(args)
            assert torch.equal(torch.as_tensor(record.value), torch.as_tensor(expected))
        assert caller.core.step(0.0) is False and len(caller.calls) == 0
    finally:
        ranks.close()


def test_a_failing_step_names_the_message_and_loses_none_after_a_failing_hook(monkeypatch):
    """A dispatch error leaves ``step`` as "dispatch of a message of kind K from rank R
    failed", raised from the error itself; an after-poll hook that fails raises before the
    poll, so the waiting message is taken by the next step, not lost."""
    import collections

    from mpidag.transport.frames import Envelope
    ranks = HandDriven()
    try:
        caller, callee = ranks.agents

        def refuse(env):
            raise ValueError("no such context")

        monkeypatch.setattr(callee.server, "accept_call", refuse)
        # a call inside an autograd context (context_id != 0) is dispatched by Python
        ranks.transports[0].send(1, Envelope(kind=CALL, request_id=7, context_id=5), [])
        with pytest.raises(RuntimeError, match=r"message of kind 1 from rank 0 failed") as err:
            callee.core.step(0.0)
        assert isinstance(err.value.__cause__, ValueError)
        assert callee.core.step(0.0) is False

        queue = collections.deque([None])
        failures = []

        def tick():
            queue.clear()
            failures.append(1)
            raise RuntimeError("the hook failed")

        callee.add_hooks(tick=tick, tick_queue=queue)
        record = caller.calls.send_call(1, rf.add, (1, 2), {}, TIMEOUT, True, False)
        with pytest.raises(RuntimeError, match="the hook failed"):
            callee.core.step(0.0)
        work = callee.core.step(0.0)  # the call, still there
        work()
        assert caller.core.step(0.0) is None and record.value == 3 and failures == [1]
    finally:
        ranks.close()


def test_the_compiled_step_runs_the_agents_tick_hooks_and_expires_calls():
    """``Core.step`` runs ``RpcAgent._tick`` in C: each layer's hook whose queue holds work
    (read from the live list, so a hook added after the start runs), and the expiry of
    calls past their deadline, as the Python step does."""
    import collections
    import time
    ranks = HandDriven()
    try:
        caller, callee = ranks.agents
        queue, ran = collections.deque(), []
        caller.add_hooks(tick=lambda: ran.append(queue.popleft()), tick_queue=queue)
        assert caller.core.step(0.0) is False and ran == []  # an empty queue: not called
        queue.extend("ab")
        caller.core.step(0.0)
        caller.core.step(0.0)
        assert ran == ["a", "b"] and not queue
        record = caller.calls.send_call(1, rf.add, (1, 2), {}, 0.05, True, False)
        time.sleep(0.1)  # past its deadline, and past the scan interval
        assert caller.core.step(0.0) is False  # nothing arrived, but the call expired
        assert record.done and isinstance(record.error, RPCTimeoutError)
        assert len(caller.calls) == 0
        callee.core.step(0.0)()  # served late: its answer is dropped, not completed twice
        assert caller.core.step(0.0) is None and isinstance(record.error, RPCTimeoutError)
    finally:
        ranks.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_the_table_is_scanned_for_late_calls_only_once_the_earliest_deadline_passed(
        compiled, monkeypatch):
    """Every call added lowers ``OutgoingCalls.earliest_deadline``, on the compiled path and
    in Python; the leader's look for late calls scans the table only once that bound has
    passed (or ``FULL_SCAN_INTERVAL`` after the last scan), and each scan sets the bound to
    the earliest deadline left: a scan of thousands of calls in flight is not repeated every
    5 ms while none of them can be late."""
    import time

    from mpidag.agent import calls as calls_module

    class Clock:
        """The calls' clock, ``ahead`` seconds past the real one (the compiled path's
        deadlines come from the real one): time passes at once."""
        ahead = 0.0

        def monotonic(self) -> float:
            return time.monotonic() + self.ahead

        def __getattr__(self, name: str):
            return getattr(time, name)

    clock = Clock()
    monkeypatch.setattr(calls_module, "time", clock)
    monkeypatch.setattr(calls_module, "EXPIRY_SCAN_INTERVAL", 0.0)  # every look may scan
    monkeypatch.setattr(calls_module, "FULL_SCAN_INTERVAL", 1.0)
    ranks = HandDriven(compiled=compiled)
    try:
        caller = ranks.agents[0]
        calls = caller.calls
        assert ranks.call(rf.add, 1, 2) == 3  # the function's reference: plain from now on
        taken_by = caller.core.send_call if compiled else calls.send_call
        long = taken_by(1, rf.add, (1, 2), {}, 30, True, False)
        short = taken_by(1, rf.add, (3, 4), {}, 0.05, True, False)
        assert long is not None and short is not None  # (None: the compiled path declined)
        assert calls.earliest_deadline == short.deadline < long.deadline
        clock.ahead = 0.1  # past the short call's deadline
        calls.expire_due()  # the bound passed: a scan
        assert short.done and isinstance(short.error, RPCTimeoutError) and not long.done
        assert calls.earliest_deadline == long.deadline
        long.deadline = clock.monotonic() - 1.0  # late behind the bound's back (lost update)
        calls.expire_due()
        assert not long.done  # the bound says none is late, and the last scan was just now
        clock.ahead += 1.0
        calls.expire_due()  # FULL_SCAN_INTERVAL after the last scan: a scan whatever it says
        assert long.done and isinstance(long.error, RPCTimeoutError)
        assert len(calls) == 0 and calls.earliest_deadline == math.inf
        ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])  # late: dropped
        assert ranks.call(rf.add, 5, 6) == 11
    finally:
        ranks.close()


def test_profilers_are_seen_in_c_as_call_profiling_and_observing_see_them(monkeypatch):
    """The caller's check of ``call_profiling()`` and the callee's of ``observing()`` read
    their globals in C: a call made under a profiler (``torch.profiler`` or the legacy one
    on this thread) is left to Python, and so is a call served while the callee observes
    calls (a server-wide profile, GIL profiling); with neither, both ends take C."""
    from mpidag import _remote_profiling
    ranks = HandDriven()
    try:
        caller, callee = ranks.agents
        ranks.call(rf.add, 1, 2)  # the function's reference made
        core = caller.core

        def sent_in_c() -> bool:
            call = core.rpc(1, rf.add, (1, 2), None, TIMEOUT, False)
            ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
            return call is not None

        assert not _remote_profiling.call_profiling() and sent_in_c()
        with torch.profiler.profile():
            assert _remote_profiling.call_profiling() and not sent_in_c()
        with torch.autograd.profiler.profile():
            assert _remote_profiling.call_profiling() and not sent_in_c()
        assert sent_in_c()
        for observed in (False, True):
            monkeypatch.setattr(_remote_profiling, "_observing", observed)
            assert _remote_profiling.observing() is observed
            with PythonCalls() as python:
                assert ranks.call(rf.add, 2, 3) == 5
            assert ("serve_call" in python.seen) is observed, python.seen
    finally:
        ranks.close()
