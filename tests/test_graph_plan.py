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


# ------------------------------------------------- the C++ plan of disjoint sources
NATIVE = records_module()
needs_native = pytest.mark.skipif(NATIVE is None, reason="the C++ records module is not built")


def _disjoint_graphs(received):
    """Graphs whose sources reach no node in common: name -> (each source's tensors, their
    gradients, the leaves and received tensors whose gradients are compared)."""
    torch.manual_seed(3)
    a, w1, w2 = (torch.randn(4, requires_grad=True) for _ in range(3))
    x = received(torch.randn(4))
    stage = torch.tanh(x * w1 + a)  # a pipeline stage: received, computed, sent on
    shared_w = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    h = (b * shared_w).exp()
    one = torch.tensor(1.0)
    return {
        "pipeline stage and its loss": ([[(w2 * 2).sum()], [stage]],
                                        [[one], [torch.randn(4)]], [a, w1, w2, x]),
        "a leaf two sources reach": ([[(shared_w * 3).sum()], [(b * shared_w).tanh()]],
                                     [[one], [torch.randn(4)]], [b, shared_w]),
        "sources that are a leaf and a received tensor": (
            [[a], [x]], [[torch.randn(4)], [torch.randn(4)]], [a, x]),
        "one tensor sent twice in one message": (
            [[(w2 * 2).sum()], [h, h, None]], [[one], [torch.randn(4), torch.randn(4), None]],
            [b, shared_w, w2]),
    }


def _gradients(plan, batches, grads_of, retain_graph=False):
    """Feed ``batches`` of source indices to ``plan``; the leaves' and recv functions'
    gradients it gave, summed, and the recv nodes in the order they fired."""
    leaves: dict[torch.Tensor, torch.Tensor] = {}
    fired_nodes = []
    recv_grads: dict = {}
    for batch in batches:
        got, fired = plan.arrive_many([(i, grads_of[i]) for i in batch], retain_graph)
        for var, g in got:
            leaves[var] = g if var not in leaves else leaves[var] + g
        for node, slots in fired:
            fired_nodes.append(node)
            recv_grads[node] = slots
    return leaves, recv_grads, fired_nodes


@needs_native
@pytest.mark.parametrize("batches", [[[0], [1]], [[1], [0]], [[0, 1]], [[1, 0]]])
@pytest.mark.parametrize("graph_name", ["pipeline stage and its loss", "a leaf two sources reach",
                                        "sources that are a leaf and a received tensor",
                                        "one tensor sent twice in one message"])
def test_the_cpp_plan_of_disjoint_sources_gives_the_gradients_of_local_autograd(
        graph_name, batches, received):
    from mpidag.dist_autograd.graph import make_plan

    tensors, grads_of, watched = _disjoint_graphs(received)[graph_name]
    pairs = [(t, g) for ts, gs in zip(tensors, grads_of, strict=True)
             for t, g in zip(ts, gs, strict=True) if t is not None]
    expected = torch.autograd.grad([t for t, _ in pairs], watched, [g for _, g in pairs],
                                   retain_graph=True, allow_unused=True)
    sources = [[None if t is None else edge_of(t) for t in ts] for ts in tensors]
    plan = make_plan(sources, RECV_NODE_TYPES, native=NATIVE)
    assert type(plan).__name__ == "DisjointPlan"
    assert plan.n_sources == 2 and not plan.complete and plan.arrived == 0
    leaves, recvs, fired = _gradients(plan, batches, grads_of, retain_graph=True)
    assert plan.complete and plan.arrived == 0b11 and plan.waiting_sources() == []
    python_plan = Plan(sources, RECV_NODE_TYPES, native=NATIVE)
    py_leaves, py_recvs, py_fired = _gradients(python_plan, batches, grads_of, True)
    assert set(fired) == set(py_fired) == set(plan.fired) == set(plan.recv_mask)
    assert len(fired) == len(set(fired))  # each recv function fires once
    for tensor, want in zip(watched, expected, strict=True):
        if type(tensor.grad_fn) in RECV_NODE_TYPES:
            got = recvs[tensor.grad_fn].get(0)
            assert got is not None or want is None
            torch.testing.assert_close(py_recvs[tensor.grad_fn].get(0), want)
        else:
            got = leaves.get(tensor)
            torch.testing.assert_close(py_leaves.get(tensor), want)
        torch.testing.assert_close(got, want)


@needs_native
def test_the_cpp_plan_stops_at_a_recv_function_and_sums_its_parts(received):
    from mpidag.dist_autograd.graph import make_plan

    x = received(torch.randn(3))
    sent = x * 2 + x.exp()  # two paths into the recv node
    plan = make_plan([[edge_of(sent)]], RECV_NODE_TYPES, native=NATIVE)
    g = torch.randn(3)
    leaves, fired = plan.arrive(0, [g], retain_graph=False)
    assert leaves == [] and [node for node, _ in fired] == [x.grad_fn]
    torch.testing.assert_close(fired[0][1][0], g * 2 + g * x.detach().exp())
    assert plan.recv_mask == {x.grad_fn: 1} and plan.fired == {x.grad_fn}


@needs_native
def test_the_cpp_plan_honours_retain_graph_false():
    from mpidag.dist_autograd.graph import make_plan

    a = torch.randn(3, requires_grad=True)
    h = a.exp()
    plan = make_plan([[edge_of(h)]], RECV_NODE_TYPES, native=NATIVE)
    (leaf, grad), = plan.arrive(0, [torch.ones(3)], retain_graph=False)[0]
    assert leaf is a
    torch.testing.assert_close(grad, a.detach().exp())
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(h.sum(), [a])


def _watched_cases():
    """Sources the C++ plan leaves to Plan: name -> (sources, watch)."""
    a = torch.randn(3, requires_grad=True)
    h = a * 2
    hooked = torch.randn(3, requires_grad=True)
    hooked.register_hook(lambda g: g * 2)
    post = torch.randn(3, requires_grad=True)
    post.register_post_accumulate_grad_hook(lambda t: None)
    ddp = torch.randn(3, requires_grad=True)
    return {
        "a node two sources reach": ([[edge_of(h.sum())], [edge_of(h.exp())]], None),
        "a leaf with a tensor hook": ([[edge_of((hooked * 2).sum())]], None),
        "a leaf sent as it is, with a tensor hook": ([[edge_of(hooked)]], None),
        "a leaf with a post-accumulate-grad hook": ([[edge_of((post * 2).sum())]], None),
        "a leaf the caller watches (DDP)": ([[edge_of((ddp * 2).sum())]],
                                            lambda var: var is ddp),
    }


@needs_native
@pytest.mark.parametrize("case", list(_watched_cases()))
def test_what_the_cpp_plan_does_not_take_goes_to_the_python_plan(case):
    from mpidag.dist_autograd.graph import make_plan

    sources, watch = _watched_cases()[case]
    assert type(make_plan(sources, RECV_NODE_TYPES, watch=watch, native=NATIVE)) is Plan
    assert type(make_plan(sources, RECV_NODE_TYPES, watch=watch, native=None)) is Plan


@needs_native
def test_a_recv_function_two_sources_reach_goes_to_the_python_plan(received):
    from mpidag.dist_autograd.graph import make_plan

    x = received(torch.randn(3))
    sources = [[edge_of((x * 2).sum())], [edge_of(x.exp())]]  # no node shared, the recv is
    assert type(make_plan(sources, RECV_NODE_TYPES, native=NATIVE)) is Plan


@needs_native
def test_the_cpp_plan_refuses_gradients_twice_and_wrong_counts_as_plan_does():
    from mpidag.dist_autograd.graph import make_plan

    a = torch.randn(3, requires_grad=True)
    root, sent = (a * 2).sum(), a.exp()
    for make in (lambda s: make_plan(s, RECV_NODE_TYPES, native=NATIVE),
                 lambda s: Plan(s, RECV_NODE_TYPES, native=NATIVE)):
        plan = make([[edge_of(root)], [edge_of(sent)]])
        with pytest.raises(RuntimeError, match="^source 1 of this backward pass got "
                                               "gradients twice$"):
            plan.arrive_many([(1, [torch.ones(3)]), (1, [torch.ones(3)])], True)
        with pytest.raises(RuntimeError, match="^source 0 expects 1 gradients, got 2$"):
            plan.arrive_many([(1, [torch.ones(3)]), (0, [None, None])], True)
        assert plan.arrived == 0  # checked before any was taken
        plan.arrive(1, [torch.ones(3)], True)
        with pytest.raises(RuntimeError, match="^source 1 of this backward pass got "
                                               "gradients twice$"):
            plan.arrive(1, [torch.ones(3)], True)
        assert plan.arrived == 0b10 and not plan.complete


@needs_native
def test_a_failed_engine_call_in_the_cpp_plan_raises_its_error(monkeypatch):
    from mpidag.dist_autograd import graph
    from mpidag.dist_autograd.graph import make_plan

    drops: list[int] = []
    monkeypatch.setattr(graph, "drop_unrun_tasks", lambda: drops.append(1))

    a = torch.ones(3, requires_grad=True)
    bad = af.fails_in_backward(a)  # a Python node: engine_grad runs the region
    plan = make_plan([[edge_of(bad.sum())]], RECV_NODE_TYPES, native=NATIVE)
    assert type(plan).__name__ == "DisjointPlan"
    with pytest.raises(ValueError, match="backward of FailingBackward failed on purpose"):
        plan.arrive(0, [torch.tensor(1.0)], retain_graph=False)
    c = torch.ones(2, requires_grad=True)
    h = c * 2
    h.register_hook(lambda g: 1 / 0)  # raises inside the direct C++ engine call
    wrong = make_plan([[edge_of(h.sum())]], RECV_NODE_TYPES, native=NATIVE)
    with pytest.raises(ZeroDivisionError):
        wrong.arrive(0, [torch.tensor(1.0)], retain_graph=False)
    assert len(drops) == 2  # what each failed engine call left queued was freed


def _received_from(record: RecvRecord, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the one tensor of a message of ``record`` (the C++ records' node)."""
    (out,) = NATIVE.record_recv(record, [value.detach().requires_grad_()])
    return out


@needs_native
def test_the_cpp_plans_step_is_one_event_of_the_pass():
    """``DisjointPlan.step``: a gradient message's sources found by message id, their
    regions run, and the recv functions that fired grouped into one message a peer (up to
    ``max_batch`` each, ids in a tuple and their gradients one after the other), those of
    another context apart; the gradients are local autograd's."""
    from mpidag.dist_autograd.graph import make_plan

    torch.manual_seed(5)
    records = {mid: RecvRecord(context, mid, peer=peer, n_outputs=1, what=f"msg {mid:x}")
               for mid, peer, context in ((0x11, 1, 1), (0x12, 1, 1), (0x13, 2, 1),
                                          (0x14, 1, 1), (0x15, 1, 9))}
    x = {mid: _received_from(r, torch.randn(3)) for mid, r in records.items()}
    w = torch.randn(3, requires_grad=True)
    root = (x[0x11] * w).sum()                            # source 0: the roots
    sent1 = x[0x12].exp() + x[0x13] * 3 + x[0x14].sin()   # source 1: send 0xA1
    sent2 = x[0x15] * 2                                   # source 2: send 0xA2 (context 9)
    plan = make_plan([[edge_of(root)], [edge_of(sent1)], [edge_of(sent2)]], RECV_NODE_TYPES,
                     native=NATIVE)
    assert type(plan).__name__ == "DisjointPlan"
    g1, g2 = torch.randn(3), torch.randn(3)
    want = dict(zip([w, *x.values()], torch.autograd.grad(
        [root, sent1, sent2], [w, *x.values()], [torch.tensor(1.0), g1, g2],
        retain_graph=True), strict=True))

    assert plan.step(0xA1, [g1], True, 1, 8) is None  # sources not named yet: Python's
    plan.name_sources([None, 0xA1, 0xA2])
    assert plan.step(0xBAD, [g1], True, 1, 8) is None  # unknown id: Python raises
    assert plan.step((0xA1, 0xA2), [g1], True, 1, 8) is None  # too few gradients
    assert plan.step(0xA1, [g1, g2], True, 1, 8) is None  # too many
    assert plan.arrived == 0  # nothing taken

    leaves, sends, foreign = plan.step(None, [torch.tensor(1.0)], True, 1, 8)
    torch.testing.assert_close(dict(leaves)[w], want[w])
    assert foreign is None
    ((peer, mid, grads),) = sends
    assert (peer, mid) == (1, 0x11)
    torch.testing.assert_close(grads[0], want[x[0x11]])

    leaves, sends, foreign = plan.step((0xA1, 0xA2), [g1, g2], True, 1, 2)
    assert leaves == [] and foreign == [records[0x15]]
    by_peer = {peer: (mid, grads) for peer, mid, grads in sends}
    assert set(by_peer) == {1, 2} and len(sends) == 2
    ids, grads = by_peer[1]  # two recv functions of peer 1: one message, ids in a tuple
    assert sorted(ids) == [0x12, 0x14] and len(grads) == 2
    for mid, grad in zip(ids, grads, strict=True):
        torch.testing.assert_close(grad, want[x[mid]])
    assert by_peer[2][0] == 0x13
    torch.testing.assert_close(by_peer[2][1][0], want[x[0x13]])
    assert plan.complete


@needs_native
def test_the_cpp_plans_step_batches_and_says_no_gradient():
    from mpidag.dist_autograd.graph import make_plan

    records = [RecvRecord(1, 0x20 + i, peer=1, n_outputs=1, what="m") for i in range(5)]
    xs = [_received_from(r, torch.randn(2)) for r in records]
    sent = sum(x * (i + 1) for i, x in enumerate(xs))
    plan = make_plan([[edge_of(sent)]], RECV_NODE_TYPES, native=NATIVE)
    plan.name_sources([0xA1])
    leaves, sends, foreign = plan.step(0xA1, None, False, 1, 2)  # SMART: none can come
    assert leaves == [] and foreign is None
    assert [len(ids) if type(ids) is tuple else 1 for _, ids, _ in sends] == [2, 2, 1]
    assert all(g is None for _, _, grads in sends for g in grads)
    assert sorted(i for _, ids, _ in sends
                  for i in (ids if type(ids) is tuple else (ids,))) == [0x20 + i for i in
                                                                        range(5)]
    with pytest.raises(ValueError, match="max_batch is at least 1"):
        plan.step(0xA1, None, False, 1, 0)
    with pytest.raises(RuntimeError, match="^source 0 of this backward pass got gradients "
                                           "twice$"):
        plan.step(0xA1, None, False, 1, 2)
