"""mpidag's C++ against torch (``_mpidag_torch``): its frame-0 tensors and its records of
distributed autograd, against the Python code they replace.

``frame_tensor`` must make the tensor ``torch.frombuffer`` would (``tests/test_frames.py``
compares every decoded message of the C codec, which calls it, with the Python codec's).

``record_recv`` must make what the Python records make (the same values, tensors that share
the received storage, one recv node per message whose outputs are the tensors that require
grad, in order), and free the record with the node, on whatever thread autograd frees it;
``gradient_edges`` must find the edges torch's ``get_gradient_edge`` finds, ``reach``
walk to what the Python walk of ``Reach`` reaches, and ``run_grad`` give what
``torch.autograd.grad`` gives, with its errors; ``new_future`` and ``set_future_result``
must make and complete the futures torch's bindings make and complete. Graphs with
C++ recv nodes go through the planner in ``tests/test_graph_plan.py`` and through every
in-process and multi-rank test of a compiled agent.
"""

from __future__ import annotations

import gc
import os
import struct
import threading

import pytest
import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from mpidag.agent.futures import RpcFuture
from mpidag.dist_autograd.context import RECV_NODE_TYPES, LiveCount, RecvRecord, RecvRPC
from mpidag.dist_autograd.graph import AccumulateGrad, Reach, edge_of, edges_of
from mpidag.dist_autograd.native import records_module
from mpidag.transport import frames
from mpidag.transport.torch_native import problem
from tests.test_graph_plan import _Double

native = records_module()

if os.environ.get("CI") == "true":  # set-up builds it in CI; a silent fallback is a bug
    assert native is not None, problem()
pytestmark = pytest.mark.skipif(native is None, reason=f"not built here: {problem()}")


def _record(count: LiveCount | None = None) -> RecvRecord:
    return RecvRecord(3, 0x1000000000007, 1, 0, "the arguments of f from worker1", count)


def test_received_tensors_become_outputs_of_one_recv_node_in_order():
    a, b = torch.rand(2, 3, requires_grad=True), torch.rand(4, requires_grad=True)
    plain = torch.arange(3.0)
    record = _record()
    out = native.record_recv(record, (a, plain, b))
    assert out[1] is plain  # a tensor without grad goes through untouched
    node = out[0].grad_fn
    assert type(node) in RECV_NODE_TYPES and node is out[2].grad_fn
    assert node.name() == "torch::distributed::autograd::RecvRpcBackward"
    assert node.next_functions == ()  # as torch's: the engine stops here
    assert node.record is record and record.node() is node and record.n_outputs == 2
    assert [edge_of(t).output_nr for t in (out[0], out[2])] == [0, 1]
    for received, sent in ((out[0], a), (out[2], b)):
        assert received.requires_grad and not received.is_leaf
        assert received.data_ptr() == sent.data_ptr()  # no copy, as the Python records
        assert torch.equal(received, sent)
    # gradients stop at the node: torch's engine captures them there, as the planner does
    (grad,) = torch.autograd.grad((out[0] * 3).sum(), [GradientEdge(node, 0)])
    assert torch.equal(grad, torch.full((2, 3), 3.0))


def test_a_received_tensor_nobody_else_holds_becomes_the_output_itself_others_a_copy():
    """What only its message holds (the decoder's fresh leaf) is made the recv node's output
    in place; a tensor held elsewhere too, or with a hook or a gradient, is detached
    first, as before, and stays as it was. Either way the output is the node's, with the
    values, storage and gradient flow of the received tensor."""
    lone = [torch.ones(2, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)]
    lone_ids = [id(t) for t in lone]
    held = torch.ones(4, requires_grad=True)
    hooked = torch.ones(2, requires_grad=True)
    hooked.register_hook(lambda grad: grad)
    with_grad = torch.ones(2, requires_grad=True)
    with_grad.grad = torch.zeros(2)
    others = [held, hooked, with_grad]
    del hooked, with_grad  # (only the list holds them, but each has its own state)
    record = _record()
    message = lone + others
    del lone  # (the message's list is all that holds the first two now)
    out = native.record_recv(record, message)
    node = record.node()
    assert [id(t) for t in out[:2]] == lone_ids  # the very objects, now outputs
    for received, original in zip(out[2:], others, strict=True):
        assert received is not original and received.data_ptr() == original.data_ptr()
        assert original.is_leaf and original.requires_grad and original.grad_fn is None
    assert others[2].grad is not None and torch.equal(others[2].grad, torch.zeros(2))
    assert all(t.grad_fn is node and not t.is_leaf and t.requires_grad for t in out)
    assert [edge_of(t).output_nr for t in out] == [0, 1, 2, 3, 4] and record.n_outputs == 5
    assert torch.equal(out[1], torch.full((3,), 2.0))
    grads = torch.autograd.grad(sum((t * (i + 1)).sum() for i, t in enumerate(out)),
                                [GradientEdge(node, i) for i in range(5)])
    assert [g.tolist() for g in grads] == [[1.0, 1.0], [2.0] * 3, [3.0] * 4, [4.0] * 2,
                                           [5.0] * 2]


def test_the_record_lives_as_long_as_the_node_whatever_thread_frees_it():
    count = LiveCount()
    record = _record(count)
    out = native.record_recv(record, [torch.ones(2, requires_grad=True)])
    weak_node = record.node
    del record
    assert count.live == 1  # the node holds the record
    loss = (out[0] * 2).sum()
    del out
    freed = threading.Thread(target=lambda: loss_holder.clear())
    loss_holder = [loss]
    del loss
    freed.start()
    freed.join()
    gc.collect()
    assert count.live == 0  # freed with the graph, on the other thread
    assert weak_node() is None  # the weak reference does not keep the record


def test_a_local_backward_that_reaches_the_node_raises_the_records_text():
    record = _record()
    (x,) = native.record_recv(record, [torch.ones(2, requires_grad=True)])
    with pytest.raises(RuntimeError) as error:
        (x * 2).sum().backward()
    assert str(error.value) == record.local_backward_error()
    assert "the arguments of f from worker1" in str(error.value)


@pytest.mark.parametrize("grad_mode", [True, False])
def test_gradient_edges_are_torchs_and_leave_python_nodes_to_python(grad_mode):
    leaf = torch.rand(4, 3, requires_grad=True)
    sparse_leaf = torch.eye(3).to_sparse().requires_grad_()
    with torch.enable_grad():
        product = leaf * 2
        second_output = torch.unbind(leaf)[2]  # output_nr 2 of one native node
        python_output = _Double.apply(leaf)
        received = native.record_recv(_record(), [torch.ones(2, requires_grad=True),
                                                  torch.zeros(3, requires_grad=True)])[1]
    tensors = [leaf, sparse_leaf, product, second_output, python_output, received,
               torch.ones(2)]
    with torch.set_grad_enabled(grad_mode):
        found = native.gradient_edges(tensors, GradientEdge)
        assert found[4] is None and found[6] is None  # Python node, no grad: Python's way
        for edge, tensor in zip(found[:4] + found[5:6], tensors[:4] + tensors[5:6],
                                strict=True):
            # edge_of: torch's get_gradient_edge (tests/test_graph_plan.py), which has no
            # edge for a sparse leaf (it makes a view)
            ours = edge_of(tensor)
            assert (edge.node, edge.output_nr) == (ours.node, ours.output_nr)
        assert found[5].output_nr == 1 and found[5].node is received.grad_fn
        assert found[2] == GradientEdge(product.grad_fn, 0)  # a GradientEdge like torch's
        assert type(found[2]) is GradientEdge and found[2].ownership_token is None
        mixed = edges_of(tensors[:6], native)
        assert [(e.node, e.output_nr) for e in mixed] == \
            [(e.node, e.output_nr) for e in edges_of(tensors[:6])]
        assert mixed[4].ownership_token is not None  # the native graph behind it stays
        with pytest.raises(RuntimeError, match="does not require gradients"):
            edges_of([torch.ones(2)], native)  # torch's own error, as edge_of


def test_a_leafs_edge_keeps_its_gradient_accumulator_alive():
    leaf = torch.rand(3, requires_grad=True)
    (edge,) = native.gradient_edges([leaf], GradientEdge)
    gc.collect()
    assert get_gradient_edge(leaf).node is edge.node  # the same accumulator, still alive
    (grad,) = torch.autograd.grad((leaf * 5).sum(), [edge])
    assert torch.equal(grad, torch.full((3,), 5.0))


def _python_reach(edges: list) -> Reach:
    return Reach(edges, RECV_NODE_TYPES)  # no native: the Python walk


def _same_reach(ours: Reach, theirs: Reach) -> None:
    assert ours.succ == theirs.succ  # every node reached, with its next_functions
    assert ours.leaf_edges == theirs.leaf_edges and ours.recv_edges == theirs.recv_edges
    assert ours.recv_nodes == theirs.recv_nodes


def test_the_walk_in_cpp_reaches_what_the_python_walk_reaches():
    a, b = torch.rand(3, requires_grad=True), torch.rand(3, requires_grad=True)
    received = native.record_recv(_record(), [torch.ones(3, requires_grad=True),
                                              torch.ones(3, requires_grad=True)])
    python_recv = RecvRPC.apply(torch.empty(0, requires_grad=True), _record(),
                                [torch.ones(3)])[0]
    shared = a * b  # reached twice (a diamond), its leaves twice
    diamond = shared.sin() + shared.cos()
    through_python = _Double.apply(a + received[0])  # a custom Function node mid-graph
    mixed = diamond * received[1] + through_python * python_recv + torch.ones(3)
    graphs = {
        "leaves only": [a, b],
        "a recv node's outputs": [received[0], received[1]],
        "diamond": [diamond],
        "everything": [mixed, a, received[0]],
        "two sources sharing nodes": [mixed, diamond],
        "no grad, leaf": [torch.ones(2), a],
        "unbind (several outputs of one node)": list(torch.unbind(mixed * 2)),
    }
    for name, tensors in graphs.items():
        edges = [None if not t.requires_grad else edge_of(t) for t in tensors]
        ours = Reach(edges, RECV_NODE_TYPES, native)
        _same_reach(ours, _python_reach(edges))
        if name == "everything":
            assert len(ours.succ) > 6 and len(ours.leaf_edges) == 2
            assert {n.name() for n in ours.recv_nodes} == \
                {"torch::distributed::autograd::RecvRpcBackward"}
            assert len(ours.recv_nodes) == 2 and len(ours.recv_edges) == 3
    # a walk that starts at a custom Function's node is Python's (the edge's ownership
    # token keeps the graph behind it): the C++ walk declines it
    start = [edge_of(through_python)]
    assert native.reach(start, RECV_NODE_TYPES, AccumulateGrad) is None
    _same_reach(Reach(start, RECV_NODE_TYPES, native), _python_reach(start))


def test_the_walk_in_cpp_refuses_what_is_not_a_list_of_edges():
    a = torch.rand(3, requires_grad=True)
    with pytest.raises(TypeError, match="reach"):
        native.reach((edge_of(a),), RECV_NODE_TYPES, AccumulateGrad)
    with pytest.raises(TypeError, match="reach"):
        native.reach([edge_of(a)], set(RECV_NODE_TYPES), AccumulateGrad)
    with pytest.raises(TypeError, match="GradientEdge or None"):
        native.reach([a], RECV_NODE_TYPES, AccumulateGrad)


def _torch_grad(outputs, grads, inputs, retain_graph=False):  # noqa: ANN001, ANN202
    return torch.autograd.grad([GradientEdge(*k) for k in outputs],
                               [GradientEdge(*k) for k in inputs], grads,
                               retain_graph=retain_graph, allow_unused=True)


def test_one_engine_call_gives_what_torch_autograd_grad_gives():
    w = torch.rand(5, requires_grad=True)
    b = torch.rand(5, requires_grad=True)
    unreached = torch.rand(2, requires_grad=True)
    h = torch.tanh(torch.rand(5) * w) + b
    mid = h * w
    out = (mid.exp() * 2).sum()
    acc_w, acc_b = get_gradient_edge(w), get_gradient_edge(b)
    stops = [(acc_w.node, 0), (mid.grad_fn, 0), (get_gradient_edge(unreached).node, 0),
             (acc_b.node, 0)]
    expected = _torch_grad([(out.grad_fn, 0)], [torch.tensor(1.5)], stops, retain_graph=True)
    got = native.run_grad([(out.grad_fn, 0)], [torch.tensor(1.5)], stops, False)
    assert isinstance(got, tuple) and len(got) == 4
    assert got[2] is None and expected[2] is None  # allow_unused
    for ours, theirs in zip(got, expected, strict=True):
        if theirs is not None:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert w.grad is None and b.grad is None  # captured, never accumulated
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        native.run_grad([(out.grad_fn, 0)], [torch.tensor(1.5)], stops, False)


def test_one_engine_call_keeps_the_graph_when_asked():
    w = torch.rand(3, requires_grad=True)
    y = w.sin() * 4
    acc = [(get_gradient_edge(w).node, 0)]
    first = native.run_grad([(y.grad_fn, 0)], [torch.ones(3)], acc, True)
    second = native.run_grad([(y.grad_fn, 0)], [torch.ones(3)], acc, False)
    torch.testing.assert_close(first[0], 4 * w.detach().cos())
    torch.testing.assert_close(second[0], first[0], rtol=0, atol=0)


def test_one_engine_call_raises_what_the_graph_raises_with_its_type():
    class Refuses(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            raise ValueError("no gradient for you")

    w = torch.rand(3, requires_grad=True)
    y = Refuses.apply(w.exp()) * 2  # a native root; the Python node runs inside the engine
    with pytest.raises(ValueError, match="no gradient for you"):
        native.run_grad([(y.grad_fn, 0)], [torch.ones(3)], [(get_gradient_edge(w).node, 0)],
                        False)
    z = w * 2
    with pytest.raises(RuntimeError, match=r"invalid gradient at index 0 - got \[4\]"):
        native.run_grad([(z.grad_fn, 0)], [torch.ones(4)], [(get_gradient_edge(w).node, 0)],
                        False)


def test_one_engine_call_leaves_python_nodes_to_torch_autograd_grad():
    w = torch.rand(3, requires_grad=True)
    y = _Double.apply(w)
    acc = [(get_gradient_edge(w).node, 0)]
    assert native.run_grad([(y.grad_fn, 0)], [torch.ones(3)], acc, False) is None
    z = w * 2
    assert native.run_grad([(z.grad_fn, 0)], [torch.ones(3)], [(y.grad_fn, 0)], False) is None


def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError, match="every item must be a tensor"):
        native.record_recv(_record(), [torch.ones(1), 5])
    with pytest.raises(TypeError, match="must be a sequence"):
        native.record_recv(_record(), 5)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        native.record_recv(_record())
    with pytest.raises(TypeError, match="gradient_edges"):
        native.gradient_edges((torch.ones(1),), GradientEdge)
    with pytest.raises(TypeError, match="must be a tuple type"):
        native.gradient_edges([torch.ones(1, requires_grad=True)], dict)
    w = torch.rand(2, requires_grad=True)
    y, acc = w * 2, (get_gradient_edge(w).node, 0)
    with pytest.raises(TypeError, match="run_grad"):
        native.run_grad(((y.grad_fn, 0),), [torch.ones(2)], [acc], False)
    with pytest.raises(TypeError, match="every edge must be a"):
        native.run_grad([y.grad_fn], [torch.ones(2)], [acc], False)
    with pytest.raises(TypeError, match="every gradient must be a tensor"):
        native.run_grad([(y.grad_fn, 0)], [1.0], [acc], False)
    with pytest.raises(ValueError, match="one gradient per output"):
        native.run_grad([(y.grad_fn, 0)], [], [acc], False)
    with pytest.raises(ValueError, match="no inputs"):
        native.run_grad([(y.grad_fn, 0)], [torch.ones(2)], [], False)


def test_the_c_codec_makes_its_inline_tensors_here():
    assert frames.compiled_codec() is None or frames.compiled_codec().uses_torch_native()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.complex64, torch.int64, torch.bool, torch.uint8])
@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 0, 4), (1, 1, 1, 1, 2)])
def test_a_frame_tensor_is_a_view_of_the_frames_bytes_as_frombuffer_makes_it(dtype, shape):
    value = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).to(dtype)
    frame = bytearray(b"head" + value.numpy().tobytes() if dtype is not torch.bfloat16
                      else b"head" + value.view(torch.int16).numpy().tobytes())
    grad = dtype.is_floating_point or dtype.is_complex
    made = native.frame_tensor(frame, 4, dtype, shape, grad)
    assert made.dtype == dtype and made.shape == shape and made.requires_grad == grad
    assert torch.equal(made.detach(), value) and made.is_leaf
    if value.numel():
        expected = torch.frombuffer(frame, dtype=dtype, count=value.numel(), offset=4)
        assert made.data_ptr() == expected.data_ptr()  # no copy: frame 0's bytes


def test_a_frame_tensor_keeps_its_frame_exported_until_its_storage_goes():
    frame = bytearray(16)
    made = native.frame_tensor(frame, 0, torch.float32, (4,), False)
    made[1] = 2.5
    assert struct.unpack_from("<f", frame, 4)[0] == 2.5
    with pytest.raises(BufferError):
        frame.extend(b"x")  # a frame a tensor reads cannot move
    view = made[2:]
    del made
    with pytest.raises(BufferError):
        frame.extend(b"x")  # a view of it still holds the storage
    del view
    gc.collect()
    frame.extend(b"x")


def test_frame_tensor_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit in a frame of 8 bytes"):
        native.frame_tensor(bytearray(8), 4, torch.float32, (2,), False)
    with pytest.raises(ValueError, match="negative size"):
        native.frame_tensor(bytearray(8), 0, torch.float32, (-1,), False)
    with pytest.raises(ValueError, match="too many elements"):
        native.frame_tensor(bytearray(8), 0, torch.float32, (2**40, 2**40), False)
    with pytest.raises(ValueError, match="do not fit"):
        native.frame_tensor(bytearray(8), 0, torch.float64, (2**61,), False)
    with pytest.raises(ValueError, match="do not fit"):
        native.frame_tensor(bytearray(8), 9, torch.uint8, (0,), False)
    with pytest.raises(TypeError, match="torch.dtype"):
        native.frame_tensor(bytearray(8), 0, "float32", (2,), False)
    with pytest.raises(TypeError):
        native.frame_tensor(42, 0, torch.float32, (2,), False)  # no buffer


class _Logged(torch.Tensor):
    """A tensor subclass of the user's (its attributes may be its own)."""


@pytest.mark.parametrize("make", [
    lambda: torch.rand(2, 3), lambda: torch.rand(2, 3, requires_grad=True) * 2,
    lambda: torch.ones(()), lambda: torch.zeros(0, 4), lambda: torch.ones(4, 4).t(),
    lambda: torch.ones(9)[::2], lambda: torch.ones(3, dtype=torch.complex64).conj(),
    lambda: torch._neg_view(torch.ones(3)), lambda: torch.nn.Parameter(torch.ones(2)),
    lambda: torch.arange(6, dtype=torch.int16).view(2, 3)[1:], lambda: torch.ones([1] * 8),
], ids=["plain", "non-leaf", "0-dim", "empty", "transposed", "strided", "conj", "neg",
        "parameter", "offset", "8-dims"])
def test_tensor_facts_are_what_the_tensors_python_attributes_say(make):
    """What the C codec and call path read of a tensor they send, in C++, against the
    attributes they read without it."""
    t = make()
    copyable = t.is_contiguous() and not t.is_conj() and not t.is_neg()
    assert native.tensor_facts(t) == (
        t.dtype, t.nbytes, tuple(t.shape), int(t.requires_grad), int(t.is_contiguous()),
        int(copyable),
        t.data_ptr() if copyable and t.nbytes else 0)


@pytest.mark.parametrize("make", [
    lambda: torch.ones(2).as_subclass(_Logged), lambda: torch.ones([1] * 9),
    lambda: torch.ones(2, device="meta"), lambda: torch.ones(2, 2).to_sparse(),
    lambda: 42, lambda: None,
], ids=["subclass", "9-dims", "meta", "sparse", "int", "None"])
def test_tensor_facts_leave_everything_else_to_the_python_attributes(make):
    assert native.tensor_facts(make()) is None


def test_a_build_for_another_torch_is_not_even_imported(monkeypatch):
    from mpidag.transport import torch_native

    assert torch_native._built_against() == torch.__version__  # wire_build's stamp
    monkeypatch.setattr(torch_native, "_built_against", lambda: "1.0.0")
    module, why = torch_native._load()
    assert module is None
    assert why == (f"Python torch calls: _mpidag_torch was built against torch 1.0.0, this "
                   f"environment has {torch.__version__}; rebuild it with "
                   f"'python -m mpidag.transport.wire_build'")


@pytest.mark.parametrize("cls", [torch._C.Future, torch.futures.Future, RpcFuture])
def test_a_future_made_in_cpp_is_the_one_torchs_init_makes(cls):
    """``new_future(type)`` makes what ``type()`` makes with ``torch._C.Future.__init__(self,
    [])``: an unfinished future of no devices, which callbacks, ``then``, ``collect_all`` and
    ``wait`` use as torch's; ``set_future_result`` completes it as ``set_result`` does."""
    fut = native.new_future(cls)
    assert type(fut) is cls and not fut.done()
    seen: list = []
    fut.add_done_callback(lambda f: seen.append(f.value()))
    chained = fut.then(lambda f: f.value() + 1)
    together = torch.futures.collect_all([fut])
    assert native.set_future_result(fut, 41) is None
    assert fut.done() and fut.value() == 41 and fut.wait() == 41 and seen == [41]
    assert chained.wait() == 42 and together.wait()[0].value() == 41
    tensor = native.new_future(cls)
    native.set_future_result(tensor, torch.ones(2))
    assert torch.equal(tensor.wait(), torch.ones(2))


def test_a_future_completed_twice_raises_torchs_error():
    reference = torch.futures.Future()
    reference.set_result(1)
    with pytest.raises(RuntimeError) as expected:
        reference.set_result(2)
    fut = native.new_future(torch.futures.Future)
    native.set_future_result(fut, 1)
    with pytest.raises(RuntimeError) as got:
        native.set_future_result(fut, 2)
    assert str(got.value) == str(expected.value) and fut.value() == 1


def test_a_future_made_in_cpp_frees_its_value_with_it():
    class Value:
        pass

    value = Value()
    alive = __import__("weakref").ref(value)
    fut = native.new_future(RpcFuture)
    native.set_future_result(fut, value)
    del value
    assert alive() is not None
    del fut
    gc.collect()
    assert alive() is None


def test_the_futures_in_cpp_fit_this_torch_and_the_call_path_takes_them():
    """``futures_problem()`` is ``None`` where pybind11 holds torch's futures in a
    ``std::shared_ptr`` (torch 2.13 and 2.14), and the compiled call path then takes the
    capsule; elsewhere it names the problem and the path keeps torch's bindings."""
    from mpidag.agent import compiled
    assert native.futures_problem() is None
    assert compiled._torch_futures() is native.futures_api


def test_futures_in_cpp_refuse_what_is_not_a_future():
    with pytest.raises(TypeError, match="int is not a torch._C.Future"):
        native.new_future(int)
    with pytest.raises(TypeError, match="a type expected"):
        native.new_future(5)
    with pytest.raises(TypeError, match="a torch._C.Future expected, got int"):
        native.set_future_result(3, 4)
    with pytest.raises(TypeError, match=r"set_future_result\(future, value\)"):
        native.set_future_result(native.new_future(RpcFuture))


@pytest.mark.parametrize("make", [threading.Lock, lambda: native.Lock()],
                         ids=["threading.Lock", "_mpidag_torch.Lock"])
def test_the_modules_lock_behaves_as_threading_lock(make):
    """``_mpidag_torch.Lock`` (the context container's and its contexts' lock where the
    recorder is built) answers every call as ``threading.Lock`` does: both run here."""
    lock = make()
    assert lock.acquire() is True and lock.locked()
    assert lock.acquire(False) is False and lock.acquire(blocking=False) is False
    assert lock.acquire(timeout=0.01) is False and lock.acquire(True, 0) is False
    lock.release()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        lock.release()
    with pytest.raises(ValueError, match="can't specify a timeout for a non-blocking call"):
        lock.acquire(False, 1)
    with pytest.raises(ValueError, match="timeout value must be (positive|a non-negative number)"):
        lock.acquire(timeout=-2)
    with lock:
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(KeyError), lock:  # released on the way out of an error
        raise KeyError("inside")
    assert not lock.locked()
    # a waiter blocks without the GIL until another thread releases it
    lock.acquire()
    ran, taken = threading.Event(), []
    waiter = threading.Thread(target=lambda: (ran.set(), taken.append(lock.acquire())))
    waiter.start()
    assert ran.wait(10)
    assert taken == [] and waiter.is_alive()  # still waiting, and this thread runs
    lock.release()
    waiter.join(10)
    assert taken == [True] and lock.locked()
    lock.release()


def test_the_compiled_container_and_its_contexts_use_the_modules_lock():
    """The compiled context container binds its recorder to a ``_mpidag_torch.Lock``, and
    the contexts and send functions the recorder makes get one too: the C++ takes them
    with a C call."""
    from tests import rpc_funcs as rf
    from tests.test_fastpath import HandDriven
    ranks = HandDriven()
    try:
        container = ranks.runtimes[0].autograd.container
        assert type(container.lock) is native.Lock
        ctx = container.new_context()
        assert type(ctx.lock) is native.Lock and not ctx.lock.locked()
        previous = container.enter(ctx)
        try:
            x = torch.ones(3, requires_grad=True)
            assert torch.equal(ranks.call(rf.identity, x), x)
        finally:
            container.leave(previous)
        sends = list(ctx.sends.values())
        assert len(sends) == 1 and type(sends[0]._walking) is native.Lock
        assert not any(lock.locked() for lock in (container.lock, ctx.lock, sends[0]._walking))
        container.release(ctx)
        ranks.world.deliver_all([agent.dispatch for agent in ranks.agents])
        assert not container.lock.locked()
    finally:
        ranks.close()
