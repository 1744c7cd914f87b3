"""Distributed autograd across 2 and 3 ranks, always against plain local autograd.

Every rank drives its own forward/backward towards the next rank at the same time, so each
test also runs several contexts concurrently on every rank. Contract tests: each runs
in-process and under MPI (tests/contract/harness.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag import _runtime
from mpidag.agent.agent import RpcAgent
from tests import autograd_funcs as af
from tests import rpc_funcs
from tests.contract.harness import python_encodes

close = torch.testing.assert_close


def _seeded(rank: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.rand(s, generator=gen, requires_grad=True) for s in shapes]


def test_design_document_example(world):
    t1, t2, t4 = _seeded(world.rank, (3, 3), (3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        t3 = rpc.rpc_sync(world.next, af.my_add, args=(t1, t2))
        loss = torch.mul(t3, t4).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    expected = torch.autograd.grad(torch.mul(af.my_add(t1, t2), t4).sum(), [t1, t2, t4])
    assert set(grads) == {t1, t2, t4}
    for t, e in zip([t1, t2, t4], expected, strict=True):
        close(grads[t], e)
    assert t1.grad is None and t4.grad is None  # gradients live in the context only


@pytest.fixture
def engine_order(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """``(thread, "send" | "store")`` of every gradient message a backward pass sends and
    every leaf gradient it stores in a context, in order (patched once for all the ranks
    of an in-process world)."""
    from mpidag.agent.agent import RpcAgent
    from mpidag.dist_autograd import context

    order: list[tuple[int, str]] = []
    add = context.GradientMap.add

    def logged(method):  # noqa: ANN001, ANN202 - a gradient message leaving, either way
        def sending(self, dst, func, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if getattr(func, "name", None) == "autograd.gradients":
                order.append((threading.get_ident(), "send"))
            return method(self, dst, func, *args, **kwargs)
        return sending

    def logged_add(self, *args):  # noqa: ANN001, ANN002, ANN202
        order.append((threading.get_ident(), "store"))
        return add(self, *args)

    # (the engine's C++ PassCore and Python's PassState send through the agent alike)
    monkeypatch.setattr(RpcAgent, "call", logged(RpcAgent.call))
    monkeypatch.setattr(RpcAgent, "notify", logged(RpcAgent.notify))
    monkeypatch.setattr(context.GradientMap, "add", logged_add)
    return order


def test_gradients_for_other_ranks_leave_before_the_leaves_are_stored(world, engine_order):
    """The roots' part of the design document's example: t3's gradient goes to the rank
    that computed t3 before t4's gradient is stored here (that rank's work waits for it;
    the stored one is read only once the pass has ended). The roots' event runs in the
    thread that calls backward()."""
    t1, t2, t4 = _seeded(world.rank, (3, 3), (3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        t3 = rpc.rpc_sync(world.next, af.my_add, args=(t1, t2))
        dist_autograd.backward(context_id, [torch.mul(t3, t4).sum()])
        grads = dist_autograd.get_gradients(context_id)
    here = [what for thread, what in list(engine_order) if thread == threading.get_ident()]
    assert here[:2] == ["send", "store"]
    close(grads[t4], af.my_add(t1, t2).detach())


def test_gradient_messages_take_the_compiled_call_path(world, monkeypatch):
    """A backward pass's messages (gradients, and the answers of the termination protocol)
    are plain calls of small contiguous CPU tensors, even the loss's expanded gradient:
    where the compiled path is built, none is pickled by the Python encoder."""
    from mpidag._runtime import current

    agent = current().agent
    encoded: list[str] = []
    t1, t2 = _seeded(world.rank, (3, 3), (3, 3))
    for step in range(2):  # (the first calls of a handler make its reference: Python)
        if step:
            encoded = python_encodes(monkeypatch)
        with dist_autograd.context() as context_id:
            t3 = rpc.rpc_sync(world.next, af.my_add, args=(t1, t2))
            dist_autograd.backward(context_id, [t3.sum()])
            grads = dist_autograd.get_gradients(context_id)
        close(grads[t1], torch.ones(3, 3))
    if agent.core is not None:
        assert "autograd.gradients" not in encoded, encoded


def test_a_broadcast_gradient_travels_as_its_element_and_arrives_expanded(world, monkeypatch):
    """The gradient of a received tensor's ``sum()`` is one element expanded to its shape:
    it travels as that element and the shape (no copy and no message the size of the
    tensor), by the compiled call path where it is built, and the sender's graph gets it
    expanded, as in local autograd (a tensor hook there sees the same strides); the
    gradients are local autograd's."""
    from mpidag._runtime import current
    from mpidag.dist_autograd import engine

    (x,) = _seeded(world.rank, (64, 128))
    assert x.numel() >= engine.COMPACT_MIN_NUMEL
    key = ("broadcast", world.rank)
    for step in range(2):  # (the first calls of a handler make its reference: Python)
        encoded = python_encodes(monkeypatch) if step else []
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync(world.next, af.double_seeing_gradient, args=(x, key))
            dist_autograd.backward(context_id, [y.sum()])
            grads = dist_autograd.get_gradients(context_id)
        remote = rpc.rpc_sync(world.next, af.seen_gradient, args=(key,))
        here = ("local", key)
        (expected,) = torch.autograd.grad(af.double_seeing_gradient(x, here).sum(), [x])
        local = af.seen_gradient(here)
        assert remote == local == ((0, 0), (64, 128))
        close(grads[x], expected)
    if current().agent.core is not None:
        assert "autograd.gradients" not in encoded, encoded


def test_a_gradient_for_the_engaging_rank_is_handed_over_without_an_answer(
        world, monkeypatch):
    """The next rank is engaged by this rank's gradient call; the gradient it sends back is
    a notification that this rank waits for in its place (the next rank's answer says so),
    so no answer travels after this rank processed the last gradient."""
    messages = _gradient_messages(monkeypatch)
    x, w = _seeded(world.rank, (4,), (4,))
    with dist_autograd.context() as context_id:
        t = rpc.rpc_sync(world.next, af.my_add, args=(x * w, w))
        dist_autograd.backward(context_id, [(t * x).sum()])
        grads = dist_autograd.get_gradients(context_id)
    local = (af.my_add(x * w, w) * x).sum()
    ex, ew = torch.autograd.grad(local, [x, w])
    close(grads[x], ex)
    close(grads[w], ew)
    ids = _runtime.current().agent.ids
    # the root calls; the rank it engaged hands its gradient back
    seen = [(sender, args[1], kind) for sender, kind, args in list(messages)]
    assert all(kind == ("call" if ids.creator(pass_id) == sender else "notify")
               for sender, pass_id, kind in seen), seen
    assert (world.rank, "call") in {(sender, kind) for sender, _, kind in seen}, seen


def _gradient_messages(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, tuple]]:
    """(sender rank, "call" | "notify", its arguments) of every gradient message sent, as
    the agent sends it (the engine's C++ PassCore and Python's PassState alike)."""
    sent: list[tuple[int, str, tuple]] = []

    def logged(method, kind):  # noqa: ANN001, ANN202
        def sending(self, dst, func, args=(), *rest, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if getattr(func, "name", None) == "autograd.gradients":
                sent.append((self.rank, kind, args))
            return method(self, dst, func, args, *rest, **kwargs)
        return sending

    monkeypatch.setattr(RpcAgent, "call", logged(RpcAgent.call, "call"))
    monkeypatch.setattr(RpcAgent, "notify", logged(RpcAgent.notify, "notify"))
    return sent


def _calls(messages: list[tuple[int, str, tuple]]) -> list[tuple[int, object]]:
    """(sender rank, message id or tuple of ids) of the gradient messages sent as calls."""
    return [(sender, args[2]) for sender, kind, args in list(messages) if kind == "call"]


def test_gradients_for_one_rank_that_fire_together_travel_in_one_message(
        world, monkeypatch):
    """A parameter server's step: an RPC's result and two fetched RRefs of the next rank
    get their gradients in the roots' region; one gradient message carries all three (its
    ids a tuple, one gradient 64 KiB), every gradient equals local autograd's, and the
    message is a plain call: where the compiled path is built, the Python encoder pickles
    none (before, a tuple beside tensors sent it through the Python pickler on the sender
    and its decoder on the receiver)."""
    from mpidag._runtime import current

    messages = _gradient_messages(monkeypatch)
    encoded: list[str] = []
    x, w = _seeded(world.rank, (256, 64), (64,))
    for step in range(2):  # (the first calls of a handler make its reference: Python)
        if step:
            encoded = python_encodes(monkeypatch)
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync(world.next, af.my_add, args=(x, w))
            a = rpc.remote(world.next, af.square, args=(w,)).to_here()
            b = rpc.remote(world.next, af.mul_sin, args=(x, w)).to_here()
            dist_autograd.backward(context_id, [(y * a + b).sum()])
            grads = dist_autograd.get_gradients(context_id)
        ex, ew = torch.autograd.grad(
            (af.my_add(x, w) * af.square(w) + af.mul_sin(x, w)).sum(), [x, w])
        close(grads[x], ex)
        close(grads[w], ew)
    sent = _calls(messages)
    mine = [ids for sender, ids in sent if sender == world.rank]
    assert len(mine) == 2 and all(type(ids) is tuple and len(ids) == 3 for ids in mine), sent
    if current().agent.core is not None:
        assert "autograd.gradients" not in encoded, encoded


def test_more_recv_functions_than_one_message_takes(world, monkeypatch):
    """Ten results of the next rank fire together: MAX_BATCH of them go in one message and
    the rest in the next, and the gradients are local autograd's."""
    from mpidag.dist_autograd.engine import MAX_BATCH

    messages = _gradient_messages(monkeypatch)
    x, w = _seeded(world.rank, (3,), (3,))
    scales = [float(k + 1) for k in range(10)]
    with dist_autograd.context() as context_id:
        parts = [rpc.rpc_sync(world.next, af.my_add, args=(x * s, w)) for s in scales]
        dist_autograd.backward(context_id, [sum(p.sin().sum() for p in parts)])
        grads = dist_autograd.get_gradients(context_id)
    local = sum(af.my_add(x * s, w).sin().sum() for s in scales)
    ex, ew = torch.autograd.grad(local, [x, w])
    close(grads[x], ex)
    close(grads[w], ew)
    sent = _calls(messages)
    mine = [ids for sender, ids in sent if sender == world.rank]
    assert [len(ids) for ids in mine] == [MAX_BATCH, 10 - MAX_BATCH], sent


def test_tensor_subclass_travels_as_tensor_and_gets_gradients(world):
    """A torch.Tensor subclass (not an nn.Parameter) arrives as its class with its
    attributes, and takes part in distributed autograd both ways (before: it was pickled
    with its bytes, got no send function, and no gradient reached x)."""
    x, w = _seeded(world.rank, (5,), (5,))
    with dist_autograd.context() as context_id:
        sent = af.tagged(x * w, "metres")
        back = rpc.rpc_sync(world.next, af.scale_tagged, args=(sent, 3.0), timeout=20)
        assert type(back) is af.TaggedTensor and back.tag == "scaled"
        loss = (back * x).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    local = (af.scale_tagged(af.tagged(x * w, "metres"), 3.0) * x).sum()
    ex, ew = torch.autograd.grad(local, [x, w])
    close(grads[x], ex)
    close(grads[w], ew)


def test_every_rpc_path_records(world):
    """rpc_async, remote + to_here, and the proxies of an RRef."""
    x, w = _seeded(world.rank, (4,), (4,))
    with dist_autograd.context() as context_id:
        fut = rpc.rpc_async(world.next, af.mul_sin, args=(x, w))
        rref = rpc.remote(world.next, af.square, args=(x,))
        held = rpc.remote(world.next, af.my_add, args=(x, w))
        via_proxy = held.rpc_sync().mul(2)  # runs value.mul(2) on the owner
        loss = (fut.wait() * rref.to_here()).sum() + via_proxy.sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    local = (af.mul_sin(x, w) * af.square(x)).sum() + (af.my_add(x, w) * 2).sum()
    ex, ew = torch.autograd.grad(local, [x, w])
    close(grads[x], ex)
    close(grads[w], ew)


def test_shared_tensors_and_several_rpcs_to_one_rank(world):
    """A non-leaf tensor used locally and sent twice; a weight used everywhere."""
    a, w = _seeded(world.rank, (2, 3), (3,))

    def forward(call):
        x = a * w  # non-leaf, sent and used locally
        y1 = call(af.mul_sin, x, w)
        y2 = call(af.square, x)
        return (y1 * y2).sum() + (x * w).sum()

    with dist_autograd.context() as context_id:
        loss = forward(lambda f, *args: rpc.rpc_sync(world.next, f, args=args))
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    ea, ew = torch.autograd.grad(forward(lambda f, *args: f(*args)), [a, w])
    close(grads[a], ea)
    close(grads[w], ew)


def test_chain_through_every_rank_and_back(world):
    """Nested calls around the ring, back to the caller and once more round (cycles)."""
    (x,) = _seeded(world.rank, (5,))
    x_small = x * 0.1
    ring = [world.worker(world.rank + i) for i in range(1, world.size + 1)]
    route = ring + ring[:1]  # ends past this rank: A -> B (-> C) -> A -> B
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync(world.next, af.chain, args=(route[1:], x_small))
        loss = out.sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    (expected,) = torch.autograd.grad(af.chain_local(route[1:], x * 0.1).sum(), [x])
    close(grads[x], expected)


def test_call_back_into_the_caller(world):
    (x,) = _seeded(world.rank, (3, 2))
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync(world.next, af.call_back, args=(world.name, x))
        dist_autograd.backward(context_id, [(out * x).sum()])
        grads = dist_autograd.get_gradients(context_id)
    (expected,) = torch.autograd.grad((af.call_back_local(x) * x).sum(), [x])
    close(grads[x], expected)


def test_custom_function_and_inplace_ops_on_the_callee(world):
    (x,) = _seeded(world.rank, (6,))
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync(world.next, af.cube_inplace, args=(x * 1,))
        y.mul_(3)  # in place on a received tensor here too
        dist_autograd.backward(context_id, [y.sum()])
        grads = dist_autograd.get_gradients(context_id)
    local = af.cube_inplace(x * 1)
    local.mul_(3)
    (expected,) = torch.autograd.grad(local.sum(), [x])
    close(grads[x], expected)


def test_tensors_inside_containers(world):
    a, b, s = _seeded(world.rank, (3,), (3,), (2,))
    arg = {"pair": af.Pair(a * 2, b), "scale": [s[0], s[1]]}
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync(world.next, af.containers, args=(arg,))
        loss = (out["out"][0] * out["out"][1].first).sum() + out["out"][1].second
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    ref = af.containers({"pair": af.Pair(a * 2, b), "scale": [s[0], s[1]]})
    expected = torch.autograd.grad(
        (ref["out"][0] * ref["out"][1].first).sum() + ref["out"][1].second, [a, b, s])
    for t, e in zip([a, b, s], expected, strict=True):
        close(grads[t], e)


def test_retain_graph_accumulates(world):
    x, w = _seeded(world.rank, (4,), (4,))
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(world.next, af.mul_sin, args=(x, w)).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        first = dist_autograd.get_gradients(context_id)[x].clone()
        dist_autograd.backward(context_id, [loss])
        second = dist_autograd.get_gradients(context_id)[x]
    (expected,) = torch.autograd.grad(af.mul_sin(x, w).sum(), [x])
    close(first, expected)
    close(second, 2 * expected)


def test_parameters_of_a_remote_module(world):
    """Leaves on the owner: their gradients are in the owner's part of the context."""
    owner = world.next
    module = rpc.remote(owner, af.make_module, args=(world.rank,))
    batch = torch.randn(6, 4)
    with dist_autograd.context() as context_id:
        out = module.rpc_sync().forward(batch)
        loss = out.pow(2).mean()
        dist_autograd.backward(context_id, [loss])
        remote_grads = rpc.rpc_sync(owner, af.module_grads, args=(module, context_id))
    local = af.make_module(world.rank)
    local.load_state_dict(rpc.rpc_sync(owner, af.module_state, args=(module,)))
    local(batch).pow(2).mean().backward()
    assert set(remote_grads) == {n for n, _ in local.named_parameters()}
    for name, p in local.named_parameters():
        close(remote_grads[name], p.grad)


def test_parameters_travel_as_in_torch(world):
    """torch pickles the arguments and results of Python functions, and an nn.Parameter
    pickles as its detached data (a new leaf on arrival, gradients stay there); builtin ops
    and tensor-typed RRefs travel as TorchScript values, the Parameter attached."""
    nxt = world.next
    mine = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 3))
    with dist_autograd.context() as context_id:
        # the result of a Python function: a new leaf here; no gradient for the callee's
        p = rpc.rpc_sync(nxt, af.get_param)
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf and p.requires_grad
        # an argument of a Python function: a new leaf there; no gradient back for `mine`
        assert rpc.rpc_sync(nxt, af.is_parameter_leaf, args=(mine,))
        y = rpc.rpc_sync(nxt, af.my_add, args=(mine, p.detach()))
        # an argument of a builtin op: attached, its gradient comes back for `mine`
        z = rpc.rpc_sync(nxt, torch.mul, args=(mine, 3.0))
        # to_here() of RRef(parameter) on the owner: attached, the owner's gets a gradient
        fetched = rpc.rpc_sync(nxt, af.param_rref).to_here()
        assert not fetched.is_leaf and type(fetched) is torch.Tensor
        dist_autograd.backward(context_id, [(2 * p).sum() + y.sum() + z.sum() + fetched.sum()])
        grads = dist_autograd.get_gradients(context_id)
        theirs = rpc.rpc_sync(nxt, af.param_gradient, args=(context_id,))
    close(grads[p], torch.full((3,), 2.0))
    close(grads[mine], torch.full((3,), 3.0))  # from torch.mul only, not from my_add
    close(theirs, torch.ones(3))  # from to_here only, not from get_param


def test_end_to_end_remote_leaves_and_rref_backward(world):
    """The design document's end-to-end example, plus RRef.backward both ways."""
    owner = world.next
    with dist_autograd.context() as context_id:
        rref1 = rpc.remote(owner, af.leaf_on_owner, args=(world.rank,))
        rref2 = rpc.remote(owner, af.leaf_on_owner, args=(world.rank + 100,))
        loss = (rref1.to_here() + rref2.to_here() * 2).sum()
        dist_autograd.backward(context_id, [loss])
        got = rpc.rpc_sync(owner, af.context_gradients, args=(context_id,))
    v1 = af.leaf_on_owner(world.rank).detach()
    v2 = af.leaf_on_owner(world.rank + 100).detach()
    assert len(got) == 2
    for value, grad in got:
        scale = 1.0 if torch.equal(value, v1) else 2.0 if torch.equal(value, v2) else None
        assert scale is not None, "a gradient for a tensor this test did not make"
        close(grad, torch.full((3, 3), scale))
    (x,) = _seeded(world.rank, (4,))
    with dist_autograd.context() as context_id:
        total = rpc.remote(owner, torch.sum, args=(x * 3,))
        total.backward(context_id)
        close(dist_autograd.get_gradients(context_id)[x], torch.full((4,), 3.0))
    mine = rpc.RRef(torch.sum(x * 2))
    mine.backward()  # local: only the owner may, and it fills .grad
    close(x.grad, torch.full((4,), 2.0))
    with pytest.raises(RuntimeError, match="only the owner") as info:
        total.backward()
    assert str(info.value).startswith(
        "User RRefs require 'dist_autograd_ctx_id' to be specified")  # torch's words first
    with dist_autograd.context() as context_id:  # torch's test_user_rref_backward errors
        text = rpc.remote(owner, rpc_funcs.identity, args=("foo",))
        with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for .backward\(\)"):
            text.backward(context_id)
    with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for .backward\(\)"):
        rpc.RRef("foo").backward()  # torch's test_owner_rref_backward errors
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar"):
        rpc.RRef(torch.rand(10, requires_grad=True)).backward()
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        rpc.RRef(torch.rand(10)).backward()
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
        rpc.RRef(torch.rand(10, requires_grad=True).sum()).backward(100)
    del rref1, rref2, total, mine, info, text


def test_error_in_a_remote_backward_reaches_the_caller(world):
    (x,) = _seeded(world.rank, (3,))
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync(world.next, af.fails_in_backward, args=(x,))
        with pytest.raises(ValueError, match="failed on purpose") as info:
            dist_autograd.backward(context_id, [y.sum()])
        # torch's RuntimeError("Error on Node {rank}: ..."), the original as its cause
        assert isinstance(info.value, RuntimeError)
        assert str(info.value) == (f"Error on Node {(world.rank + 1) % world.size}: "
                                   f"backward of FailingBackward failed on purpose")
        assert type(info.value.__cause__) is ValueError
        assert world.next in str(info.value.__cause__.__cause__)  # the remote traceback
        del info
    # every rank goes on working
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(world.next, af.square, args=(x,)).sum()
        dist_autograd.backward(context_id, [loss])
        close(dist_autograd.get_gradients(context_id)[x], 2 * x.detach())


def test_an_error_after_a_hand_over_ends_the_pass(world):
    """The next rank hands one gradient back to this rank (the rank that engaged it) and
    fails on the other: its failed answer says how many it handed over, and the pass ends
    with the error instead of waiting for a count that never came."""
    (x,) = _seeded(world.rank, (3,))
    for _ in range(2):  # (either call's gradient may be the one that engages the next rank)
        with dist_autograd.context() as context_id:
            good = rpc.rpc_sync(world.next, af.square, args=(x,))
            bad = rpc.rpc_sync(world.next, af.fails_in_backward, args=(x,))
            with pytest.raises(ValueError, match="failed on purpose"):
                dist_autograd.backward(context_id, [good.sum() + bad.sum()])
    with dist_autograd.context() as context_id:  # every rank goes on working
        loss = rpc.rpc_sync(world.next, af.square, args=(x,)).sum()
        dist_autograd.backward(context_id, [loss])
        close(dist_autograd.get_gradients(context_id)[x], 2 * x.detach())


def test_bad_calls_are_clear_errors(world):
    (x,) = _seeded(world.rank, (2,))
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync(world.next, af.square, args=(x,))
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            dist_autograd.backward(context_id, [y])
        with pytest.raises(RuntimeError, match="does not require grad"):
            dist_autograd.backward(context_id, [torch.ones(())])
        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
            dist_autograd.backward(context_id, [])
        with pytest.raises(RuntimeError, match="does not exist"):
            dist_autograd.backward(context_id + 12345, [y.sum()])
        with pytest.raises(RuntimeError, match="do not nest"), dist_autograd.context():
            pass
        with pytest.raises(RuntimeError, match="mpidag.autograd.backward"):
            y.sum().backward()  # a local backward through a recv function
        dist_autograd.backward(context_id, [y.sum()])
    with pytest.raises(RuntimeError, match="was released"):
        dist_autograd.backward(context_id, [y.sum()])
    with pytest.raises(RuntimeError, match="was released"):
        dist_autograd.get_gradients(context_id)
    with pytest.raises(RuntimeError, match="does not exist"):
        dist_autograd.get_gradients(-5)
    with pytest.raises(RuntimeError, match="valid autograd context"):
        dist_autograd._current_context()


def test_concurrent_contexts_in_threads(world):
    results: dict[int, tuple] = {}

    def worker(i: int) -> None:
        x, w = _seeded(world.rank * 10 + i, (8,), (8,))
        for _ in range(5):
            with dist_autograd.context() as context_id:
                y = rpc.rpc_sync(world.next, af.mul_sin, args=(x, w))
                loss = (y * (i + 1)).sum()
                dist_autograd.backward(context_id, [loss])
                grads = dist_autograd.get_gradients(context_id)
        results[i] = (x, w, grads[x], grads[w])

    af.in_threads(worker, 4)
    for i, (x, w, gx, gw) in results.items():
        ex, ew = torch.autograd.grad((af.mul_sin(x, w) * (i + 1)).sum(), [x, w])
        close(gx, ex)
        close(gw, ew)


def test_max_context_id_is_this_workers_last(world):

    ids = _runtime.current().agent.ids
    top = dist_autograd._get_max_id()
    assert ids.creator(top) == world.rank and ids.local_counter(top) == 2**ids.counter_bits - 1
    with dist_autograd.context() as context_id:
        assert ids.creator(context_id) == world.rank and context_id < top


def test_sparse_embedding_and_sparse_leaves_match_local_autograd(world):
    """An ``nn.Embedding(sparse=True)`` on the next rank and a sparse leaf sent there: their
    gradients stay sparse and equal local autograd's; the embedding gradient fetched back
    is large enough for its values to travel as a frame of their own (above the inline
    limit), the sparse leaf's parts travel inline."""
    owner = world.next
    gen = torch.Generator().manual_seed(world.rank)
    indices = torch.randint(0, 5000, (3000,), generator=gen)
    (w,) = _seeded(world.rank, (3000, 16))
    leaf = torch.sparse_coo_tensor(torch.stack([indices, indices % 7]),
                                   torch.rand(3000, generator=gen), (5000, 7),
                                   requires_grad=True)
    embedding = rpc.remote(owner, torch.nn.Embedding, args=(5000, 16),
                           kwargs={"sparse": True})
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync(owner, af.embedding_lookup, args=(embedding, indices))
        doubled = rpc.rpc_sync(owner, torch.mul, args=(leaf, 2.0))
        assert doubled.is_sparse and not doubled.is_coalesced()
        loss = (out * w).sum() + torch.sparse.sum(doubled * 3.0)
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])  # sparse gradients accumulate
        grads = dist_autograd.get_gradients(context_id)
        weight, remote_grad = rpc.rpc_sync(owner, af.embedding_weight_and_gradient,
                                           args=(embedding, context_id))
    local = torch.nn.Embedding(5000, 16, sparse=True, _weight=weight)
    local_leaf = leaf.detach().requires_grad_()
    local_loss = (local(indices) * w.detach()).sum() + torch.sparse.sum(local_leaf * 6.0)
    local_loss.backward(retain_graph=True)
    local_loss.backward()
    assert remote_grad.is_sparse and grads[leaf].is_sparse
    close(remote_grad.to_dense(), local.weight.grad.to_dense())
    close(grads[leaf].to_dense(), local_leaf.grad.to_dense())
    close(grads[w], 2 * local(indices).detach())


def _hooked_leaf(rank: int, calls: list) -> torch.Tensor:
    (w,) = _seeded(rank, (3,))

    def double(grad: torch.Tensor) -> torch.Tensor:
        calls.append(grad.clone())
        return grad * 2  # the return value replaces the gradient

    w.register_hook(double)
    return w


@pytest.mark.parametrize("shape", ["sent_itself", "behind_a_node", "sent_and_local"])
def test_tensor_hooks_of_leaves_run_once_on_the_whole_gradient(world, shape):
    """A leaf's register_hook runs once, on its complete gradient, and its return value is
    what reaches the context, as in local autograd: also when the leaf itself is sent (no
    native-engine call sees it) and when its gradient comes in two parts (the root's and the
    RPC's). Before, the hook was skipped, resp. ran on each part."""
    def loss_of(w: torch.Tensor, call) -> torch.Tensor:
        if shape == "sent_itself":
            return call(torch.mul, w, 3.0).sum()
        if shape == "behind_a_node":
            return call(torch.mul, w.sin(), 3.0).sum()
        return call(torch.mul, w, 3.0).pow(2).sum() + (w * 5).sum()

    calls: list[torch.Tensor] = []
    w = _hooked_leaf(world.rank, calls)
    with dist_autograd.context() as context_id:
        loss = loss_of(w, lambda f, *args: rpc.rpc_sync(world.next, f, args=args))
        dist_autograd.backward(context_id, [loss])
        grad = dist_autograd.get_gradients(context_id)[w]
    local_calls: list[torch.Tensor] = []
    w_local = _hooked_leaf(world.rank, local_calls)
    loss_of(w_local, lambda f, *args: f(*args)).backward()
    close(grad, w_local.grad)
    assert len(calls) == len(local_calls) == 1
    close(calls[0], local_calls[0])
    assert w.grad is None


def _distributed_and_local_gradient(world, run, w):
    """The gradient of ``run(call)`` with respect to ``w`` through a distributed backward
    (``call`` an rpc_sync to the next rank) and through local autograd (a local call)."""
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [run(
            lambda f, *args: rpc.rpc_sync(world.next, f, args=args))])
        grad = dist_autograd.get_gradients(context_id)[w]
    (expected,) = torch.autograd.grad(run(lambda f, *args: f(*args)), [w])
    return grad, expected


def test_tensor_hook_of_an_intermediate_tensor_in_one_region(world):
    (w,) = _seeded(world.rank, (3,))
    seen: list[torch.Tensor] = []

    def run(call) -> torch.Tensor:
        h = w * 2
        h.register_hook(lambda g: seen.append(g.clone()) or g + 1)
        return (call(torch.mul, h.sin(), 3.0) * w).sum()  # h: behind the send alone

    grad, expected = _distributed_and_local_gradient(world, run, w)
    close(grad, expected)
    assert len(seen) == 2
    close(seen[0], seen[1])


def test_tensor_hook_of_an_intermediate_tensor_split_across_sources(world):
    """The hook's tensor gets its gradient in parts (sent, and used locally; and behind a
    second send through an intermediate that is not sent): the hook runs once per pass, on
    the whole gradient, as in local autograd."""
    (w,) = _seeded(world.rank, (3,))
    seen: list[torch.Tensor] = []

    def run(call) -> torch.Tensor:
        h = w * 2
        h.register_hook(lambda g: seen.append(g.clone()) or g * 2)
        a = h.sin()  # not sent: a region boundary inside this rank's graph
        return (call(torch.mul, h, 3.0) * h).sum() + (call(torch.mul, a, 2.0) * a).sum()

    grad, expected = _distributed_and_local_gradient(world, run, w)
    close(grad, expected)
    assert len(seen) == 2  # once in the distributed pass, once in the local one
    close(seen[0], seen[1])


def test_post_accumulate_grad_hooks_run_once_on_the_complete_gradient(world):
    """register_post_accumulate_grad_hook runs once per leaf and backward pass, after the
    leaf's gradient in the context is complete, inside the context (the hook reads it with
    get_gradients; .grad stays unset, as in torch's distributed autograd)."""
    x, w = _seeded(world.rank, (4,), (4,))
    seen: list[tuple] = []

    def hook(param: torch.Tensor) -> None:
        ctx = dist_autograd._current_context()
        grads = dist_autograd.get_gradients(ctx._context_id())
        seen.append((param is w, param.grad, grads[param].clone()))

    w.register_post_accumulate_grad_hook(hook)
    with dist_autograd.context() as context_id:
        # w reaches the loss through the RPC and locally: two parts
        loss = (rpc.rpc_sync(world.next, af.mul_sin, args=(x, w)) * w).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])
        final = dist_autograd.get_gradients(context_id)[w]
    (expected,) = torch.autograd.grad((af.mul_sin(x, w) * w).sum(), [w])
    assert [(is_w, grad) for is_w, grad, _ in seen] == [(True, None), (True, None)]
    close(seen[0][2], expected)  # complete after the first pass, once
    close(seen[1][2], 2 * expected)
    close(final, 2 * expected)


def test_sparse_tensors_as_arguments_results_in_containers_and_rrefs(world):
    for coalesce in (False, True):
        x = af.build_sparse(coalesce)
        y = rpc.rpc_sync(world.next, torch.add, args=(x, x))
        assert y.is_sparse and y.is_coalesced() == coalesce
        close(y.to_dense(), 2 * x.to_dense())
        got = rpc.rpc_sync(world.next, af.sparse_pair,
                           args=({"pair": [x, af.build_sparse(not coalesce)]},))
        assert got["flags"] == (coalesce, not coalesce)
        close(got["sum"][0].to_dense(), 2 * x.to_dense())
        # an RRef of a sparse value, fetched, and forked to every rank as an argument
        rref = rpc.remote(world.prev, torch.mul, args=(x, 3))
        value = rref.to_here()
        assert value.is_sparse and value.is_coalesced() == coalesce
        close(value.to_dense(), 3 * x.to_dense())
        for rank in range(world.size):
            doubled = rpc.rpc_sync(rank, af.fetch_doubled, args=(rref,))
            assert doubled.is_sparse and doubled.is_coalesced() == coalesce
            close(doubled.to_dense(), 6 * x.to_dense())
        del rref
    with pytest.raises(TypeError, match=r"layout torch\.sparse_csr cannot be sent over RPC"):
        rpc.rpc_sync(world.next, torch.neg, args=(torch.eye(2).to_sparse_csr(),))


def test_sparse_leaves_get_sparse_gradients_like_local_autograd(world):
    t1, t2 = af.build_sparse(requires_grad=True), af.build_sparse(coalesce=True).requires_grad_()
    (dense,) = _seeded(world.rank, (3, 3))
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync(world.next, torch.add, args=(t1, t2))
        back = rpc.rpc_sync(world.prev, torch.mul, args=(ret, dense))  # sparse * dense
        loss = torch.sparse.sum(back)
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        dist_autograd.backward(context_id, [loss])  # accumulates
        grads = dist_autograd.get_gradients(context_id)
    l1, l2 = af.build_sparse(requires_grad=True), af.build_sparse(coalesce=True).requires_grad_()
    local_dense = dense.detach().clone().requires_grad_()
    local_loss = torch.sparse.sum(torch.mul(torch.add(l1, l2), local_dense))
    local_loss.backward(retain_graph=True)
    local_loss.backward()
    for leaf, local in ((t1, l1), (t2, l2)):
        assert grads[leaf].is_sparse and local.grad.is_sparse
        close(grads[leaf].to_dense(), local.grad.to_dense())
    close(grads[dense], local_dense.grad)
    assert t1.grad is None


def test_remote_sparse_embedding_bag_gradient_matches_local(world):
    """torch's ``test_embedding_bag_with_no_grad_tensors``: an ``EmbeddingBag(sparse=True)``
    owned by another rank, two backward passes, its sparse gradient in the owner's context
    equal to the local computation's ``.grad``."""
    owner = world.prev
    remote_embedding = rpc.remote(owner, torch.nn.EmbeddingBag, args=(16, 16),
                                  kwargs={"mode": "sum", "sparse": True})
    local_embedding = torch.nn.EmbeddingBag(16, 16, mode="sum", sparse=True)
    with torch.no_grad():
        local_embedding.weight.copy_(rpc.rpc_sync(owner, af.weight_of, args=(remote_embedding,)))
    indices = torch.LongTensor([1, 2, 4, 5, 4, 3, 2, 9])
    (per_sample_weights,) = _seeded(world.rank, (8,))  # records send/recv functions
    offsets = torch.LongTensor([0, 4])
    local_res = local_embedding(indices, offsets, per_sample_weights)
    torch.autograd.backward([local_res.sum()], retain_graph=True)
    torch.autograd.backward([local_res.sum()])
    with dist_autograd.context() as context_id:
        res = rpc.rpc_sync(owner, af.embedding_bag_forward,
                           args=(remote_embedding, indices, offsets, per_sample_weights))
        dist_autograd.backward(context_id, [res.sum()], retain_graph=True)
        dist_autograd.backward(context_id, [res.sum()])
        remote_grad = rpc.rpc_sync(owner, af.gradient_of_weight,
                                   args=(remote_embedding, context_id))
        grads = dist_autograd.get_gradients(context_id)
    assert remote_grad.is_sparse and local_embedding.weight.grad.is_sparse
    close(remote_grad.to_dense(), local_embedding.weight.grad.to_dense())
    (expected,) = torch.autograd.grad(
        local_embedding(indices, offsets, per_sample_weights).sum(), [per_sample_weights])
    close(grads[per_sample_weights], 2 * expected)
    del remote_embedding, res


@pytest.fixture
def made_passes(monkeypatch) -> Iterator[list]:
    """Every pass state the engine makes while the test runs (every rank's in-process);
    emptied at the test's end, so the world's leak check finds none of them alive."""
    from mpidag.dist_autograd import engine

    made: list[engine.PassState] = []
    choose = engine._pass_state

    def recorded(ctx):  # noqa: ANN001, ANN202
        cls = choose(ctx)

        def make(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            made.append(state := cls(*args, **kwargs))
            return state
        return make

    monkeypatch.setattr(engine, "_pass_state", recorded)
    yield made
    made.clear()


def test_a_pass_of_a_compiled_context_runs_in_cpp_and_ends_with_nothing_counted(
        world, made_passes):
    """Where the C++ records module is built, a pass's state is ``NativePassState`` (its
    event loop and counts in C++, ``_mpidag_torch.PassCore``), else ``PassState``; either
    way every call it made was answered, every notification it was handed was processed,
    and the gradients are local autograd's (the design document's example, both ways)."""
    from mpidag.dist_autograd import engine

    t1, t2, t4 = _seeded(world.rank, (3, 3), (3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        native = dist_autograd._current_context().container.native is not None
        t3 = rpc.rpc_sync(world.next, af.my_add, args=(t1, t2))
        dist_autograd.backward(context_id, [torch.mul(t3, t4).sum()])
        grads = dist_autograd.get_gradients(context_id)
        mine = [s for s in list(made_passes) if s.agent.rank == world.rank and s.root]
    expected = torch.autograd.grad((af.my_add(t1, t2) * t4).sum(), [t1, t2, t4])
    for t, e in zip([t1, t2, t4], expected, strict=True):
        close(grads[t], e)
    assert len(mine) == 1
    (state,) = mine
    want = engine.NativePassState if native and engine.NativePassState else engine.PassState
    assert type(state) is want
    assert (state.deficit, state.handed_over, state.handed_to_me, state.parent,
            state.running, state.errors) == (0, 0, 0, None, False, [])


@pytest.mark.parametrize("shape", ["disjoint", "shared"])
def test_a_pass_names_its_sources_and_picks_its_plan_as_pythons_make_plan_does(
        world, made_passes, shape):
    """A pass's sources (the roots, then every send function of the context, in order),
    their ids and its plan are those of ``PassState._make_plan`` whichever class made
    them (``NativePassState``'s is C++): a C++ ``DisjointPlan`` where each source reaches
    its own nodes (leaves may be shared: they accumulate), a ``graph.Plan`` where two send
    functions reach one ``t1 * 3`` node; every recv function of the context is reached,
    and the gradients are local autograd's."""
    from mpidag.dist_autograd import graph

    def forward(t1, t2, t4):  # noqa: ANN001, ANN202
        h1 = t1 * 3
        h2 = h1 if shape == "shared" else t1 * 3
        return (t1, t2, t4), (h1, t2), (h2, t4)

    t1, t2, t4 = _seeded(world.rank, (3, 3), (3, 3), (3, 3))
    with dist_autograd.context() as context_id:
        ctx = dist_autograd._current_context()
        _, first, second = forward(t1, t2, t4)
        t3 = rpc.rpc_sync(world.next, af.my_add, args=first)
        t5 = rpc.rpc_sync(world.next, af.my_add, args=second)
        dist_autograd.backward(context_id, [(t3 * t5).sum()])
        grads = dist_autograd.get_gradients(context_id)
        (state,) = [s for s in list(made_passes) if s.agent.rank == world.rank and s.root]
        sends = list(ctx.sends.values())
        assert state.source_send == [None, *sends]
        assert state.source_of == {send.message_id: i + 1 for i, send in enumerate(sends)}
        assert state.plan.n_sources == 1 + len(sends) == 3
        native = ctx.container.native is not None
        assert (type(state.plan) is graph.Plan) == (shape == "shared" or not native)
        assert state._unreached_records() == []
        assert set(state._recv_nodes()) == set(ctx.recvs)
    leaves, first, second = forward(*(t.detach().requires_grad_() for t in (t1, t2, t4)))
    expected = torch.autograd.grad((af.my_add(*first) * af.my_add(*second)).sum(), leaves)
    for t, e in zip([t1, t2, t4], expected, strict=True):
        close(grads[t], e)
