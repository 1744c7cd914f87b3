"""Single-process tests of the region planner behind the FAST engine.

A "source" stands for a send function whose gradient arrives later from another rank; the
planner must give every leaf and every recv function exactly the gradient of a plain
``torch.autograd.grad`` over all sources at once, whatever order the sources arrive in, and
run every node once. Received tensors are made by both kinds of recv node: the Python
records' ``RecvRPC`` and, where it is built, the C++ records' ``RecvRpcBackward``.
"""

from __future__ import annotations

import gc
import itertools
import threading

import pytest
import torch

from mpidag.dist_autograd.context import RECV_NODE_TYPE, RECV_NODE_TYPES, RecvRecord, RecvRPC
from mpidag.dist_autograd.graph import Plan, edge_of
from mpidag.dist_autograd.native import records_module
from tests import autograd_funcs as af

RECORDS = ["python"] + (["c++"] if records_module() is not None else [])


@pytest.fixture(params=RECORDS)
def received(request):
    """``received(value)``: ``value`` as a tensor received from rank 1 (a recv node's output),
    through the Python or the C++ records; ``received.native``: the module that walks the
    graph for plans of those (``None``: Python)."""
    anchor = torch.empty(0, requires_grad=True)

    def receive(value: torch.Tensor) -> torch.Tensor:
        record = RecvRecord(1, 7, peer=1, n_outputs=1, what="test recv")
        if request.param == "c++":
            (out,) = records_module().record_recv(record, [value.detach().requires_grad_()])
        else:
            (out,) = RecvRPC.apply(anchor, record, [value.detach()])
        assert type(out.grad_fn) in RECV_NODE_TYPES and out.grad_fn.record is record
        return out
    receive.native = records_module() if request.param == "c++" else None
    return receive


def _run(plan: Plan, order: list[int], grads: list[list[torch.Tensor]]):
    leaves: dict[torch.Tensor, torch.Tensor] = {}
    recvs: dict = {}
    for i in order:
        got, fired = plan.arrive(i, grads[i], retain_graph=False)
        for var, g in got:
            leaves[var] = g if var not in leaves else leaves[var] + g
        for node, slots in fired:
            assert node not in recvs, "a recv function fired twice"
            recvs[node] = slots
    return leaves, recvs


def _shared_graph(received):
    torch.manual_seed(0)
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    x = received(torch.randn(4))  # a tensor that came from another rank
    h = a * b + x  # reached from all three sources
    s1 = h.exp()  # "sent" to another rank
    s2 = h.sin() * b  # "sent" too
    root = (h * 3).sum() + (b * b).sum()
    return a, b, x, [root, s1, s2]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_shared_node_runs_once_with_the_sum_of_all_sources(order, received):
    a, b, x, outs = _shared_graph(received)
    grads = [[torch.tensor(1.0)], [torch.randn(4)], [torch.randn(4)]]
    expected = torch.autograd.grad(outs, [a, b, x], [g[0] for g in grads], retain_graph=True)
    plan = Plan([[edge_of(o)] for o in outs], RECV_NODE_TYPES, native=received.native)
    leaves, recvs = _run(plan, list(order), grads)
    torch.testing.assert_close(leaves[a], expected[0])
    torch.testing.assert_close(leaves[b], expected[1])
    (slots,) = recvs.values()
    torch.testing.assert_close(slots[0], expected[2])
    assert plan.complete and plan.waiting_sources() == []


class _Counting:
    """The C++ records module, counting its ``run_grad`` calls and their answers."""

    def __init__(self, module) -> None:  # noqa: ANN001
        self.module, self.calls = module, []

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.module, name)

    def run_grad(self, *args):  # noqa: ANN002, ANN201
        result = self.module.run_grad(*args)
        self.calls.append(result is not None)
        return result


@pytest.mark.skipif(records_module() is None, reason="the C++ records module is not built")
def test_every_region_of_native_nodes_is_one_cpp_engine_call():
    native = _Counting(records_module())
    received = records_module().record_recv
    a, b, x, outs = _shared_graph(lambda v: received(
        RecvRecord(1, 7, peer=1, n_outputs=1, what="test recv"), [v.detach().requires_grad_()])[0])
    grads = [[torch.tensor(1.0)], [torch.randn(4)], [torch.randn(4)]]
    expected = torch.autograd.grad(outs, [a, b, x], [g[0] for g in grads], retain_graph=True)
    plan = Plan([[edge_of(o)] for o in outs], RECV_NODE_TYPES, native=native)
    leaves, recvs = _run(plan, [1, 0, 2], grads)
    torch.testing.assert_close(leaves[a], expected[0])
    torch.testing.assert_close(leaves[b], expected[1])
    assert native.calls and all(native.calls), native.calls  # none fell back to Python
    inside = _Double.apply(a) * 2  # a Python node inside the region: still one C++ call
    native.calls.clear()
    plan = Plan([[edge_of(inside)]], RECV_NODE_TYPES, native=native)
    leaves, _ = plan.arrive(0, [torch.ones(4)], retain_graph=False)
    torch.testing.assert_close(dict(leaves)[a], torch.full((4,), 4.0))
    assert native.calls == [True]
    entry = _Double.apply(a)  # a region entered at a Python node: torch.autograd.grad
    plan = Plan([[edge_of(entry)]], RECV_NODE_TYPES, native=native)
    leaves, _ = plan.arrive(0, [torch.ones(4)], retain_graph=False)
    torch.testing.assert_close(dict(leaves)[a], torch.full((4,), 2.0))
    assert native.calls == [True, False]


def test_recv_fires_only_when_every_source_reaching_it_arrived(received):
    a, b, x, outs = _shared_graph(received)
    plan = Plan([[edge_of(o)] for o in outs], RECV_NODE_TYPES, native=received.native)
    _, fired = plan.arrive(0, [torch.tensor(1.0)], retain_graph=False)
    assert fired == []
    assert plan.waiting_sources() == [1, 2]  # what FAST mode reports if they never come
    _, fired = plan.arrive(2, [torch.ones(4)], retain_graph=False)
    assert fired == []
    _, fired = plan.arrive(1, [torch.ones(4)], retain_graph=False)
    assert len(fired) == 1


def test_disjoint_sources_need_no_waiting():
    a = torch.randn(8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    stage1 = torch.tanh(a * w)  # sent to the next stage
    root = (w * 2).sum()
    g = torch.randn(8)
    expected = torch.autograd.grad([root, stage1], [a, w], [torch.tensor(1.0), g],
                                   retain_graph=True)
    plan = Plan([[edge_of(root)], [edge_of(stage1)]], RECV_NODE_TYPE)
    assert len(plan.regions) == 2
    leaves, _ = plan.arrive(0, [torch.tensor(1.0)], retain_graph=False)
    assert [v is w for v, _ in leaves] == [True]  # w's part from the root, at once
    leaves2, _ = plan.arrive(1, [g], retain_graph=False)
    got = {}
    for var, grad in leaves + leaves2:
        got[var] = grad if var not in got else got[var] + grad
    torch.testing.assert_close(got[a], expected[0])
    torch.testing.assert_close(got[w], expected[1])


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_weight_used_locally_and_behind_a_sent_tensor(order):
    # x is used locally and sent; w is used by both: the root's region reaches w directly
    # and through x's node, which must wait for the send's gradient
    torch.manual_seed(2)
    a = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    x = a * w
    root = (x * w).sum()
    g = torch.randn(2, 3)
    expected = torch.autograd.grad([root, x], [a, w], [torch.tensor(1.0), g],
                                   retain_graph=True)
    plan = Plan([[edge_of(root)], [edge_of(x)]], RECV_NODE_TYPE)
    leaves, _ = _run(plan, order, [[torch.tensor(1.0)], [g]])
    torch.testing.assert_close(leaves[a], expected[0])
    torch.testing.assert_close(leaves[w], expected[1])
    with pytest.raises(RuntimeError, match="second time"):  # retain_graph=False honoured
        torch.autograd.grad(x.sum(), [a])


def test_linear_layers_reduce_broadcast_bias_gradients():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    x = torch.randn(6, 5)
    hidden = model[1](model[0](x))
    out = model[2](hidden)
    loss = out.pow(2).sum() + hidden.sum()
    expected = torch.autograd.grad([loss, out], list(model.parameters()),
                                   [torch.tensor(1.0), torch.ones(6, 3)], retain_graph=True)
    plan = Plan([[edge_of(loss)], [edge_of(out)]], RECV_NODE_TYPE)
    leaves, _ = _run(plan, [1, 0], [[torch.tensor(1.0)], [torch.ones(6, 3)]])
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(leaves[p], e)


def test_custom_function_and_inplace_ops(received):
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t ** 3

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            return 3 * t * t * g

    a = torch.randn(3, requires_grad=True)
    x = received(torch.randn(3))
    x.mul_(2)  # in place on a received tensor
    y = Cube.apply(a + x)
    y.add_(1)
    sent = y * 2
    root = y.sum()
    g = torch.randn(3)
    ea, ex = torch.autograd.grad([root, sent], [a, x], [torch.tensor(1.0), g],
                                 retain_graph=True)
    plan = Plan([[edge_of(root)], [edge_of(sent)]], RECV_NODE_TYPES)
    leaves, recvs = _run(plan, [0, 1], [[torch.tensor(1.0)], [g]])
    torch.testing.assert_close(leaves[a], ea)
    (slots,) = recvs.values()
    # x was doubled in place after it was received: the recv output is before the doubling
    torch.testing.assert_close(slots[0], ex * 2)


def test_unused_source_is_reported_waiting():
    a = torch.randn(3, requires_grad=True)
    h = a * 2
    root = h.sum()
    unused = h.exp()  # an RPC result the loss does not use
    plan = Plan([[edge_of(root)], [edge_of(unused)]], RECV_NODE_TYPE)
    leaves, _ = plan.arrive(0, [torch.tensor(1.0)], retain_graph=False)
    assert leaves == []  # h waits for the gradient of `unused`, which never comes
    assert plan.waiting_sources() == [1]


def test_no_source_is_waiting_once_all_arrived_and_none_gets_gradients_twice():
    a = torch.randn(3, requires_grad=True)
    h = a * 2
    root, sent = h.sum(), h.exp()
    plan = Plan([[edge_of(root)], [edge_of(sent)]], RECV_NODE_TYPE)
    with pytest.raises(RuntimeError, match="source 1 of this backward pass got gradients twice"):
        plan.arrive_many([(0, [torch.tensor(1.0)]), (1, [torch.ones(3)]), (1, [torch.ones(3)])],
                         retain_graph=False)
    assert plan.arrived == 0  # checked before any was taken
    assert plan.waiting_sources() == []  # (nothing arrived: nothing waits for a part)
    leaves, _ = plan.arrive_many([(1, [torch.ones(3)]), (0, [torch.tensor(1.0)])],
                                 retain_graph=False)
    assert plan.complete and plan.waiting_sources() == []
    torch.testing.assert_close(leaves[0][1], 2 + 2 * (a * 2).exp().detach())
    with pytest.raises(RuntimeError, match="source 0 of this backward pass got gradients twice"):
        plan.arrive(0, [torch.tensor(1.0)], retain_graph=False)


def test_local_backward_through_a_recv_function_is_a_clear_error(received):
    x = received(torch.randn(2))
    expected = x.grad_fn.record.local_backward_error()
    assert "test recv" in expected and "back to rank 1" in expected
    with pytest.raises(RuntimeError) as error:
        x.sum().backward()
    assert str(error.value) == expected


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x * 2

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g * 2


@pytest.mark.parametrize("grad_mode", [True, False])
def test_edge_of_gives_torchs_gradient_edge_for_every_kind_of_tensor(grad_mode):
    from torch.autograd.graph import get_gradient_edge

    leaf = torch.rand(4, 3, requires_grad=True)
    with torch.enable_grad():
        native = leaf * 2
        second_output = torch.unbind(leaf)[2]  # output_nr 2 of one native node
        python_output = _Double.apply(leaf)
        anchor = torch.empty(0, requires_grad=True)
        received = RecvRPC.apply(anchor, RecvRecord(1, 2, 1, 2, "m"),
                                 [torch.ones(2), torch.zeros(3)])[1]
    with torch.set_grad_enabled(grad_mode):
        for tensor in (leaf, native, second_output, python_output, received):
            ours, torchs = edge_of(tensor), get_gradient_edge(tensor)
            assert (ours.node, ours.output_nr) == (torchs.node, torchs.output_nr)
            assert (ours.ownership_token is None) == (torchs.ownership_token is None)
            if ours.ownership_token is not None:  # a native node behind the Python one
                assert ours.ownership_token.next_functions[0][0] is not None
        assert edge_of(received).output_nr == 1
        with pytest.raises(RuntimeError, match="does not require gradients"):
            edge_of(torch.ones(2))


def test_edge_of_a_python_node_output_keeps_the_graph_behind_it_alive():
    import gc

    leaf = torch.rand(3, requires_grad=True)
    middle = leaf * 3
    python_output = _Double.apply(middle)
    edge = edge_of(python_output)
    del middle, python_output  # only the edge holds the graph now
    gc.collect()
    (grad,) = torch.autograd.grad([edge], [leaf], [torch.ones(3)])
    assert torch.equal(grad, torch.full((3,), 6.0))


def test_disjoint_reaches_are_told_from_overlapping_ones_whatever_their_order():
    from mpidag.dist_autograd.graph import Reach, _disjoint

    a, b = torch.rand(3, requires_grad=True), torch.rand(3, requires_grad=True)
    shared = a.exp()
    own_a, own_b = (a * 2).sin(), (b * 3).cos()
    first, second = shared * 2, shared.sin()  # both behind `shared`'s node
    reach = {name: Reach([edge_of(t)], RECV_NODE_TYPE)
             for name, t in [("a", own_a), ("b", own_b), ("1", first), ("2", second)]}
    assert _disjoint([reach["a"], reach["b"], reach["1"]])
    for order in itertools.permutations(["b", "1", "2"]):
        assert not _disjoint([reach[name] for name in order])
    assert _disjoint([]) and _disjoint([reach["1"]])


class _Alive:
    """Counts the objects alive that a graph's Python nodes keep."""

    count = 0

    def __init__(self) -> None:
        _Alive.count += 1

    def __del__(self) -> None:
        _Alive.count -= 1


class _Kept(torch.autograd.Function):
    """A node that keeps an :class:`_Alive` for as long as it lives."""

    @staticmethod
    def forward(ctx, t):
        ctx.alive = _Alive()
        return t * 1

    @staticmethod
    def backward(ctx, g):
        return g


@pytest.mark.parametrize("dropped", [True, False])
def test_a_failed_engine_call_leaves_no_node_queued_on_its_thread(dropped, monkeypatch):
    """Three nodes are ready when the one built last raises: torch's engine leaves them in
    the thread's ready queue, and ``engine_grad`` frees them before it raises (a pool thread
    that runs no other engine call would keep them, and a failed pass's recv functions,
    alive). The thread stays alive while the count is read, as a pool thread does."""
    from mpidag.dist_autograd import graph

    if not dropped:  # the same without the drop: the test can tell
        monkeypatch.setattr(graph, "drop_unrun_tasks", lambda: None)
    before = _Alive.count
    failed: list[str] = []
    read, done = threading.Event(), threading.Event()

    def pool_thread() -> None:
        a = torch.ones(3, requires_grad=True)
        kept = [_Kept.apply(a) for _ in range(3)]
        bad = af.fails_in_backward(a)
        root = sum(k.sum() for k in kept) + bad.sum()
        try:
            graph.engine_grad(None, [edge_of(root)], [torch.tensor(1.0)],
                              [edge_of(a)], False)
        except ValueError as exc:  # (its traceback would keep the graph alive)
            failed.append(str(exc))
        del a, kept, bad, root
        done.set()
        read.wait(10)  # still alive, as a parked pool thread

    thread = threading.Thread(target=pool_thread)
    thread.start()
    try:
        assert done.wait(10)
        gc.collect()
        alive = _Alive.count - before
    finally:
        read.set()
        thread.join()
    assert failed == ["backward of FailingBackward failed on purpose"]
    assert alive == (0 if dropped else 3)


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_a_failed_engine_call_raises_its_own_error_in_any_grad_mode(mode):
    """The drop after a failure runs its tiny engine call whatever the caller's mode, and
    never replaces the caller's error with one of its own."""
    from mpidag.dist_autograd import graph

    a = torch.ones(2, requires_grad=True)
    root = (a * 2).sum()
    out, leaf = edge_of(root), edge_of(a)
    with mode(), pytest.raises(RuntimeError, match="Mismatch in shape"):
        graph.engine_grad(None, [out], [torch.ones(3)], [leaf], False)
    with mode():
        graph.drop_unrun_tasks()  # no error of its own
