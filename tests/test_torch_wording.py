"""torch's exception types and message texts, and the mirrors of torch's private helpers
that its test suites use (issue 21): each error is torch's type (mostly ``RuntimeError``)
with torch's wording first, the type mpidag raised before kept where it differs.

Single-process tests and in-process worlds (``InProcWorld``: the ranks as threads); the
public API's part (``rpc.get_rpc_timeout``, ``rpc.api._wait_all``, ...) is tested across
MPI ranks in ``test_rpc.py``, ``test_rref.py``, ``test_dist_autograd.py`` and
``test_remote_module.py``.
"""

from __future__ import annotations

import pickle
import re
import typing
from collections.abc import Iterator

import pytest
import torch

import mpidag.rpc as rpc
from mpidag._runtime import Runtime
from mpidag.agent.options import MPIRpcBackendOptions, RpcBackendOptions
from mpidag.errors import (
    RemoteTraceback,
    RPCError,
    RPCNotInitializedError,
    RPCTimeoutError,
    WorkerFailedError,
    WrappedError,
    async_result_error,
    node_error,
    operator_error,
    pack_exception,
    unpack_exception,
)
from mpidag.rpc import backend_registry, constants
from tests import autograd_funcs as af
from tests import rpc_funcs as rf
from tests.test_inproc import TIMEOUT, call, on_every_rank, settle, start_world

TIMEOUT_TEXT = "RPC ran for more than"  # torch's get_timeout_error_regex()


@pytest.fixture
def world() -> Iterator[list[Runtime]]:
    runtimes = start_world(2)
    yield runtimes
    on_every_rank(2, lambda r: runtimes[r].shutdown(graceful=True, timeout=TIMEOUT))


# ------------------------------------------------------------------------ error types


def test_node_error_is_torch_runtime_error_and_the_original_type():
    original = ValueError("bad gradient")
    exc = node_error(original, 3)
    assert str(exc) == "Error on Node 3: bad gradient"
    assert isinstance(exc, RuntimeError) and isinstance(exc, ValueError)
    assert isinstance(exc, WrappedError) and exc.node == 3
    assert exc.__cause__ is original and exc.original is original
    assert node_error(exc, 5) is exc  # reported once, by the rank that met it
    # keeps the attributes of the original (a failed worker's rank and name)
    failed = node_error(WorkerFailedError("worker2 is gone", 2, "worker2"), 0)
    assert isinstance(failed, WorkerFailedError) and failed.rank == 2
    assert failed.worker_name == "worker2"
    # a key error's message reads as given, not quoted
    assert str(node_error(KeyError("k"), 1)) == "Error on Node 1: 'k'"
    assert type(node_error(RuntimeError("plain"), 1)) is WrappedError


def test_wrapped_errors_travel_with_type_cause_and_remote_traceback():
    exc = node_error(ValueError("bad gradient"), 1)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == "Error on Node 1: bad gradient"
    assert back.node == 1 and type(back.__cause__) is ValueError
    remote = unpack_exception(pack_exception(exc, "worker1 (rank 1 of 2)"))
    assert isinstance(remote, ValueError) and isinstance(remote, RuntimeError)
    assert str(remote) == "Error on Node 1: bad gradient"
    assert str(remote.__cause__) == "bad gradient"  # the original stays the cause
    assert isinstance(remote.__cause__.__cause__, RemoteTraceback)
    assert "worker1 (rank 1 of 2)" in remote.__cause__.__cause__.text


def test_operator_error_is_torchs_schema_error_for_builtins_only():
    with pytest.raises(TypeError) as info:
        torch.add()
    exc = operator_error(torch.add, info.value)
    assert isinstance(exc, RuntimeError) and isinstance(exc, TypeError)
    assert str(exc).startswith(
        "Overloaded torch operator invoked from Python failed to match any schema:\naten::add")
    assert "invalid combination of arguments" in str(exc)
    assert operator_error(rf.add, info.value) is info.value  # not a torch operator
    other = ValueError("x")
    assert operator_error(torch.add, other) is other  # not an argument error
    del info


def test_async_result_error_wording():
    exc = async_result_error("rf.async_not_a_future", 42)
    assert isinstance(exc, RuntimeError) and isinstance(exc, TypeError)
    assert re.search("Functions decorated with @rpc\\.async_function must return a "
                     "torch\\.futures\\.Future object,", str(exc))
    assert "but got <class 'int'>" in str(exc) and "rf.async_not_a_future" in str(exc)
    assert str(pickle.loads(pickle.dumps(exc))) == str(exc)


# ------------------------------------------------------------- options and constants


def test_constants_and_backend_registry_as_torch():
    assert constants.DEFAULT_RPC_TIMEOUT_SEC == 60.0
    assert constants.DEFAULT_INIT_METHOD == "env://"
    assert constants.DEFAULT_NUM_WORKER_THREADS == 16
    assert constants.UNSET_RPC_TIMEOUT == -1.0 and constants.DEFAULT_SHUTDOWN_TIMEOUT == 0
    assert rpc.constants is constants and rpc.backend_registry is backend_registry
    backend = backend_registry.BackendType["TENSORPIPE"]
    assert backend is rpc.BackendType.TENSORPIPE
    opts = backend_registry.construct_rpc_backend_options(
        backend, init_method="file:///tmp/x", _transports=["uv"], _channels=["basic"])
    assert type(opts) is MPIRpcBackendOptions and isinstance(opts, rpc.RpcBackendOptions)
    assert opts.init_method == "file:///tmp/x" and opts.rpc_timeout == 60.0
    assert opts.num_worker_threads == 16
    opts = backend_registry.construct_rpc_backend_options(
        backend_registry.BackendType.MPI, rpc_timeout=5, num_worker_threads=3)
    assert (opts.rpc_timeout, opts.num_worker_threads) == (5.0, 3)
    assert backend_registry.backend_registered("MPI")
    assert not backend_registry.backend_registered("GLOO")
    with pytest.raises(RuntimeError, match="^RPC backend TENSORPIPE: already registered$"):
        backend_registry.register_backend("TENSORPIPE", None, None)
    with pytest.raises(RuntimeError, match="cannot register backends"):
        backend_registry.register_backend("MINE", None, None)
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        backend_registry.construct_rpc_backend_options("TENSORPIPE")


def test_rpc_backend_options_base_and_refused_options():
    base = rpc.RpcBackendOptions()
    assert (base.rpc_timeout, base.init_method) == (60.0, "env://")
    assert issubclass(MPIRpcBackendOptions, RpcBackendOptions)

    class FooBackendOptions(rpc.RpcBackendOptions):  # torch's test class
        def __init__(self, init_method):
            rpc.RpcBackendOptions.__init__(self)
            self.init_method = init_method

    with pytest.raises(TypeError, match="Could not infer backend for options") as info:
        MPIRpcBackendOptions.from_any(FooBackendOptions("env://"))
    assert "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`" in str(info.value)
    with pytest.raises(TypeError, match="Argument rpc_backend_options must be an instance of "
                                        "RpcBackendOptions") as info:
        MPIRpcBackendOptions.from_any({"init_method": "env://"})
    assert "got dict" in str(info.value)
    del info


def test_init_rpc_refuses_a_backend_that_is_not_a_backend_type():
    from mpidag.rpc.api import _check_init_arguments

    problem = _check_init_arguments("worker0", "TENSORPIPE", 0, 2)
    assert isinstance(problem, TypeError)
    assert str(problem).startswith("Argument backend must be a member of BackendType")
    assert _check_init_arguments("worker0", rpc.BackendType.TENSORPIPE, 0, 2) is None
    import torch.distributed.rpc as torch_rpc

    assert _check_init_arguments("worker0", torch_rpc.BackendType.TENSORPIPE, 0, 2) is None


def test_wait_all_blocks_are_counted_while_open_and_leave_no_future_list():
    """``rpc_async`` looks for its thread's ``future_list`` only while some ``_wait_all``
    block is open; torch's tests check that the attribute is missing outside one."""
    from mpidag.rpc.api import _thread_local_var, _wait_all, _wait_all_blocks

    before = _wait_all_blocks.open
    with _wait_all():
        assert _wait_all_blocks.open == before + 1 and _thread_local_var.future_list == []
    assert _wait_all_blocks.open == before
    assert not hasattr(_thread_local_var, "future_list")
    with pytest.raises(ZeroDivisionError), _wait_all():
        _ = 1 / 0
    assert _wait_all_blocks.open == before
    assert not hasattr(_thread_local_var, "future_list")


def test_rref_type_is_subscriptable():
    def uses(x: rpc.RRef[int]) -> rpc.RRef[torch.Tensor]:
        return x

    hints = typing.get_type_hints(uses, globalns={"rpc": rpc, "torch": torch})
    assert hints["x"] == rpc.RRef[int] and hints["return"] == rpc.RRef[torch.Tensor]
    assert rpc.RRef[int].__origin__ is rpc.RRef


# ------------------------------------------------------------------ in-process worlds


def test_backward_error_on_another_rank_is_error_on_node(world):
    rt = world[0]
    contexts = rt.autograd.container
    x = torch.rand(3, requires_grad=True)
    for where in (1, 0):  # the function that fails in backward runs on rank 1, then here
        ctx = contexts.new_context()
        previous = contexts.enter(ctx)
        try:
            y = call(rt, 1, af.fails_in_backward, x) if where else af.fails_in_backward(
                call(rt, 1, af.square, x))
        finally:
            contexts.leave(previous)
        with pytest.raises(RuntimeError) as info:
            rt.autograd.backward(ctx.context_id, [y.sum()])
        exc = info.value
        assert str(exc) == f"Error on Node {where}: backward of FailingBackward failed on " \
                           f"purpose"
        assert re.search("Error on Node [0-9]+: backward of FailingBackward", str(exc))
        assert isinstance(exc, ValueError) and exc.node == where
        assert type(exc.__cause__) is ValueError
        if where:
            assert "worker1" in exc.__cause__.__cause__.text  # the remote traceback
        contexts.release(ctx)
        del info, exc, y
    settle(world)


def test_async_function_returning_no_future_fails_every_way(world):
    pattern = ("Functions decorated with @rpc\\.async_function must return a "
               "torch\\.futures\\.Future object,")
    with pytest.raises(RuntimeError, match=pattern) as info:
        call(world[0], 1, rf.async_not_a_future)
    assert isinstance(info.value, TypeError) and "but got <class 'int'>" in str(info.value)
    handle = world[0].rrefs.remote(1, rf.async_not_a_future, (), {}, TIMEOUT)
    with pytest.raises(RuntimeError, match=pattern):
        handle.to_here()  # it used to be the value 42
    own = world[0].rrefs.remote(0, rf.async_not_a_future, (), {}, TIMEOUT)
    with pytest.raises(RuntimeError, match=pattern):
        own.to_here()
    del info, handle, own
    settle(world)


def test_builtin_with_wrong_arguments_is_torchs_schema_error(world):
    pattern = "Overloaded torch operator invoked from Python failed to match any schema"
    with pytest.raises(RuntimeError, match=pattern) as info:
        call(world[0], 1, torch.add)
    assert isinstance(info.value, TypeError)
    handle = world[0].rrefs.remote(1, torch.add, (), {}, TIMEOUT)
    with pytest.raises(RuntimeError, match=pattern):
        handle.to_here()
    assert call(world[0], 1, torch.add, torch.ones(1), 1).tolist() == [2.0]  # still serves
    del info, handle
    settle(world)


def test_rref_backward_errors_are_torchs(world):
    rt = world[0]
    contexts = rt.autograd.container
    ctx = contexts.new_context()
    previous = contexts.enter(ctx)
    try:
        text = rt.rrefs.remote(1, rf.identity, ("foo",), {}, TIMEOUT)
        with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward\(\)"):
            text.backward(ctx.context_id)
        with pytest.raises(RuntimeError,
                           match="User RRefs require 'dist_autograd_ctx_id' to be specified"):
            text.backward()
    finally:
        contexts.leave(previous)
        contexts.release(ctx)
    own = rt.rrefs.create_local("foo")
    with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward\(\)"):
        own.backward()
    vector = rt.rrefs.create_local(torch.rand(3, requires_grad=True))
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar "
                                           "outputs"):
        vector.backward()
    plain = rt.rrefs.create_local(torch.rand(1))
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        plain.backward()
    del text, own, vector, plain
    settle(world)


def test_timeouts_and_rref_creation_timeouts_use_torchs_words(world):
    agent = world[0].agent
    with pytest.raises(RuntimeError, match=TIMEOUT_TEXT) as info:
        agent.wait(agent.call(1, rf.sleep_then, (1.0, "late"), {}, 0.05), TIMEOUT)
    assert isinstance(info.value, RPCTimeoutError) and "pass a larger timeout=" in \
        str(info.value)
    for owner in (1, 0):
        slow = world[0].rrefs.remote(owner, rf.sleep_then, (1.0, "late"), {}, 0.05)
        if owner:  # the user learns of it when the creation call times out
            settle(world)
        with pytest.raises(RuntimeError, match="RRef creation via rpc.remote\\(\\) timed out"
                           ) as info:
            slow.to_here()
        assert isinstance(info.value, TimeoutError) and TIMEOUT_TEXT in str(info.value)
        del slow
    del info
    settle(world)


def test_rref_repr_local_value_and_pickling_as_torch():
    runtimes = start_world(2)  # fresh: this worker's RRef ids count from 0, as torch's
    try:
        rrefs = runtimes[0].rrefs
        own = rrefs.create_local(0)
        assert repr(own) == str(own) == "OwnerRRef(GloballyUniqueId(created_on=0, local_id=0))"
        user = rrefs.remote(1, torch.add, (torch.ones(2, 2), 1), {}, TIMEOUT)
        assert str(user) == ("UserRRef(RRefId = GloballyUniqueId(created_on=0, local_id=1), "
                             "ForkId = GloballyUniqueId(created_on=0, local_id=2))")
        with pytest.raises(RuntimeError, match=(  # torch's test_local_value_not_on_owner
                r"For UserRRef\(rref_id=GloballyUniqueId\(created_on=0, local_id=1\), "
                r"fork_id=GloballyUniqueId\(created_on=0, local_id=2\)\), "
                r"can't call localValue\(\) on user WorkerInfo\(id=0, name=worker0\). "
                r"Call it on owner WorkerInfo\(id=1, name=worker1\)")) as info:
            user.local_value()
        assert isinstance(info.value, RPCError) and "to_here()" in str(info.value)
        for handle in (own, user):
            with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
                pickle.dumps(handle)
        assert user.to_here().tolist() == [[2.0, 2.0], [2.0, 2.0]]
        del info
    finally:
        on_every_rank(2, lambda r: runtimes[r].shutdown(graceful=True, timeout=TIMEOUT))
    with pytest.raises(RPCNotInitializedError,
                       match=r"Cannot call to_here\(\) on it after deletion\.") as info:
        user.to_here()
    assert str(info.value).startswith("UserRRef(RRefId = GloballyUniqueId(created_on=0, "
                                      "local_id=1), ForkId = ")
    del own, user, info


def test_get_type_blocking_non_blocking_owner_and_errors(world):
    rrefs = world[0].rrefs
    user = rrefs.remote(1, torch.add, (torch.ones(2), 1), {}, TIMEOUT)
    assert user._get_type() is torch.Tensor
    fut = user._get_type(blocking=False)
    assert isinstance(fut, torch.futures.Future) and fut.wait() is torch.Tensor
    assert user._get_type(blocking=False) is fut  # kept: asked of the owner once
    own = rrefs.create_local(rf.Adder(1))
    assert own._get_type() is rf.Adder
    assert own._get_type(blocking=False).wait() is rf.Adder
    failing = rrefs.remote(1, rf.raise_value_error, ("Expected error",), {}, TIMEOUT)
    with pytest.raises(ValueError, match="Expected error"):
        failing._get_type()
    with pytest.raises(ValueError, match="Expected error"):
        failing._get_type(blocking=False).wait()
    slow = rrefs.remote(1, rf.sleep_then, (1.0, "late"), {}, TIMEOUT)
    with pytest.raises(RuntimeError, match=TIMEOUT_TEXT):
        slow._get_type(timeout=0.05)
    assert slow._get_type() is str  # a failed ask is not kept
    del user, fut, own, failing, slow
    settle(world)


def test_backward_argument_errors_carry_torchs_types_and_words():
    from mpidag.dist_autograd.engine import check_roots

    with pytest.raises(TypeError, match="incompatible function arguments"):
        check_roots(None)
    with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
        check_roots([])
    with pytest.raises(RuntimeError, match="requires_grad not set on"):
        check_roots([torch.rand(3, 3)])
    with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
        check_roots([torch.rand(3, 3, requires_grad=True)])
    with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
        check_roots([torch.rand(1, requires_grad=True)])
    root = (torch.rand(3, requires_grad=True) * 2).sum()
    assert check_roots(root) == [root]
