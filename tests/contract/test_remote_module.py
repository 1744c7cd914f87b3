"""mpidag.nn.RemoteModule across 2 and 3 ranks: training equals local training; forward,
forward_async, remote_parameters, the nn.Module methods it forbids, and clear errors.

Contract tests: each runs in-process and under MPI (tests/contract/harness.py).
"""

from __future__ import annotations

import io
import pickle
import re

import pytest
import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag.errors import RPCError, UnknownWorkerError
from mpidag.nn import RemoteModule
from mpidag.optim import DistributedOptimizer
from tests import remote_module_funcs as rmf

close = torch.testing.assert_close


@pytest.mark.parametrize("form", ["name", "rank"])
def test_training_equals_local_training(world, form):
    """A remote MLP and a local scale, trained 5 SGD-with-momentum steps with distributed
    autograd, end with the parameters of the same training done locally."""
    owner = rpc.get_worker_info(world.next)
    device = f"{owner.name}/cpu" if form == "name" else f"rank:{owner.id}/cpu"
    seed = 11 + world.rank
    remote = RemoteModule(device, rmf.MLP, args=(seed,), kwargs={"hidden": 6})
    local = rmf.MLP(seed, hidden=6)
    scale = torch.ones(2, requires_grad=True)
    local_scale = torch.ones(2, requires_grad=True)
    params = remote.remote_parameters()
    assert len(params) == 4 and all(p.owner() == owner for p in params)
    dist_optim = DistributedOptimizer(torch.optim.SGD, [*params, rpc.RRef(scale)],
                                      lr=0.05, momentum=0.9)
    local_optim = torch.optim.SGD([*local.parameters(), local_scale], lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(world.rank)
    for _ in range(5):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        with dist_autograd.context() as context_id:
            loss = ((remote(x, scale=0.5) * scale - y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            dist_optim.step(context_id)
        local_optim.zero_grad()
        local_loss = ((local(x, scale=0.5) * local_scale - y) ** 2).mean()
        local_loss.backward()
        local_optim.step()
        close(loss, local_loss)
    trained = rpc.rpc_sync(owner, rmf.state, args=(remote.get_module_rref(),))
    expected = {k: v.detach() for k, v in local.state_dict().items()}
    assert trained.keys() == expected.keys()
    for name in expected:
        close(trained[name], expected[name])
        assert not torch.equal(trained[name], rmf.MLP(seed, hidden=6).state_dict()[name])
    close(scale.detach(), local_scale.detach())
    del remote, params, dist_optim


def test_forward_async_and_outputs(world):
    remote = RemoteModule(world.next, rmf.MLP, args=(3,))
    x = torch.randn(5, 4)
    fut = remote.forward_async(x, scale=2.0)
    assert isinstance(fut, torch.futures.Future)
    expected = rmf.MLP(3)(x, scale=2.0)
    close(fut.wait(), expected)
    close(remote.forward(x, scale=2.0), expected)
    close(remote(x), rmf.MLP(3)(x))
    pair = RemoteModule(f"{world.next}/cpu", rmf.TwoOutputs)
    out, extra = pair(torch.ones(3))
    close(out, torch.full((3,), 2.0))
    close(extra["sum"], torch.tensor(6.0))
    del remote, pair


def test_parameters_module_rref_and_modes(world):
    remote = RemoteModule(f"{world.next}/cpu", rmf.MLP, args=(4,))
    rref = remote.get_module_rref()
    assert rref.owner_name() == world.next
    assert len(remote.remote_parameters(recurse=False)) == 0  # all in submodules
    values = [p.to_here() for p in remote.remote_parameters()]
    close(values, [p.detach() for p in rmf.MLP(4).parameters()])
    assert remote.eval() is remote and remote.training is False
    assert rpc.rpc_sync(world.next, rmf.training_mode, args=(rref,)) is False
    remote.train()
    assert rpc.rpc_sync(world.next, rmf.training_mode, args=(rref,)) is True
    text = repr(remote)
    assert f"on={world.next}" in text and "device=cpu" in text and "MLP" in text
    same = RemoteModule.init_from_module_rref(f"{world.next}/cpu", rref)
    close(same(torch.ones(1, 4)), remote(torch.ones(1, 4)))
    # remote_device need not name the owner (torch checks nothing): forward goes to it
    here = RemoteModule.init_from_module_rref(f"{world.name}/cpu", rref)
    assert here.on == world.name and here.module_rref.owner_name() == world.next
    close(here(torch.ones(1, 4)), remote(torch.ones(1, 4)))
    on, out = rpc.rpc_sync(world.prev, rmf.init_here_and_call, args=(rref, torch.ones(1, 4)))
    assert on == world.prev
    close(out, remote(torch.ones(1, 4)))
    del remote, rref, same, values, here, out


@pytest.mark.parametrize("method, args", [
    ("parameters", ()), ("named_parameters", ()), ("buffers", ()), ("children", ()),
    ("modules", ()), ("to", ("cpu",)), ("cuda", ()), ("cpu", ()), ("float", ()),
    ("half", ()), ("state_dict", ()), ("load_state_dict", ({},)), ("zero_grad", ()),
    ("requires_grad_", ()), ("apply", (print,)), ("register_forward_hook", (print,)),
    ("register_buffer", ("b", None)), ("add_module", ("m", None)), ("share_memory", ()),
])
def test_local_state_methods_raise_like_torch(world, method, args):
    remote = RemoteModule(world.next, torch.nn.Linear, args=(2, 2))
    expected = "Please use ``remote_parameters``" if method == "parameters" else \
        f"Method ``{method}`` not supported for RemoteModule"
    with pytest.raises(ValueError, match=expected):
        getattr(remote, method)(*args)
    del remote


@pytest.mark.parametrize("device, why", [
    ("worker1/cpu/0", "more than one '/'"), ("/cpu", "no worker"), ("", "no worker"),
    ("worker1/gpu7", "'gpu7' is not a device"),
    ("rank:x/cpu", "neither a worker name nor 'rank:<rank>'"),
    ("node:1/cpu", "neither a worker name nor 'rank:<rank>'"),
])
def test_bad_device_string(world, device, why):
    with pytest.raises(ValueError) as info:
        RemoteModule(device, torch.nn.Linear, args=(2, 2))
    text = str(info.value)
    assert repr(device) in text and why in text
    assert "'<workername>/<device>' or 'rank:<rank>/<device>'" in text
    with pytest.raises(TypeError, match="remote_device must be a str"):
        RemoteModule(1, torch.nn.Linear, args=(2, 2))


def test_unknown_worker(world):
    with pytest.raises(UnknownWorkerError, match="nosuchworker"):
        RemoteModule("nosuchworker/cpu", torch.nn.Linear, args=(2, 2))
    with pytest.raises(UnknownWorkerError, match="unknown destination rank 99"):
        RemoteModule("rank:99/cpu", torch.nn.Linear, args=(2, 2))


def test_remote_build_failure_reaches_the_caller(world):
    with pytest.raises(KeyError, match="cannot build: no weights"):
        RemoteModule(f"{world.next}/cpu", rmf.BrokenModule, args=("no weights",))
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        RemoteModule(world.next, torch.nn.Linear, args=(2, 2), kwargs={"bogus": 1})
    with pytest.raises(ValueError, match="returns an instance of <class 'int'>"):
        RemoteModule(world.next, rmf.not_a_module, args=(3,))
    if not torch.cuda.is_available():  # the remote .to("cuda:0") fails there, as here
        # torch's own error, whatever this build words it ("Torch not compiled with CUDA
        # enabled" on a CPU build, "Found no NVIDIA driver ..." on a CUDA build without GPU)
        with pytest.raises(BaseException) as local:
            torch.nn.Linear(2, 2).to("cuda:0")
        with pytest.raises(type(local.value), match=re.escape(str(local.value))):
            RemoteModule(f"{world.next}/cuda:0", torch.nn.Linear, args=(2, 2))
    # the remote rank keeps serving
    assert rpc.rpc_sync(world.next, rmf.echo, args=(5,)) == 5
    remote = RemoteModule(world.next, torch.nn.Linear, args=(2, 1))
    assert remote(torch.ones(3, 2)).shape == (3, 1)
    del remote


def test_travels_over_rpc_not_by_pickle(world):
    remote = RemoteModule(f"{world.next}/cpu", rmf.MLP, args=(6,))
    x = torch.randn(2, 4)
    third = rpc.get_worker_info(world.prev).name  # worker of its own, with 3 ranks
    close(rpc.rpc_sync(third, rmf.call_remote_module, args=(remote, x)), rmf.MLP(6)(x))
    back = rpc.rpc_sync(world.next, rmf.echo, args=(remote,))
    assert isinstance(back, RemoteModule)
    close(back(x), rmf.MLP(6)(x))
    torchs = ("Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled "
              "when using RPC")  # torch's test_remote_module_py_pickle_not_supported
    with pytest.raises(RPCError, match=torchs):
        pickle.dumps(remote)
    with pytest.raises(RuntimeError, match=torchs):
        torch.save(remote, io.BytesIO())
    del remote, back


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device(world):
    remote = RemoteModule(f"{world.next}/cuda:0", rmf.MLP, args=(8,))
    assert rpc.rpc_sync(world.next, rmf.module_device,
                        args=(remote.get_module_rref(),)) == "cuda:0"
    x = torch.randn(3, 4)
    out = remote(x)  # CPU in, CPU out: no device map to the owner
    assert out.device.type == "cpu"
    close(out, rmf.MLP(8)(x), atol=1e-4, rtol=1e-4)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [remote(x).sum()])
        DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=0.1
                             ).step(context_id)
    del remote
