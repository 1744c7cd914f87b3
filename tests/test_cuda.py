"""CUDA tensors over RPC: direct (CUDA-aware MPI) and host-staged, with device maps.

Skipped where no GPU exists; run on a GPU machine with
``python -m mpidag.run -n 2 -m pytest --with-mpi -m mpi tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

import mpidag.rpc as rpc
from mpidag._config import Config
from mpidag.transport.mpi import detect_cuda_aware
from tests import rpc_funcs as f

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def on_device(t):
    return str(t.device), float(t.double().sum())


@pytest.fixture(scope="module")
def gpu_world():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    opts = rpc.MPIRpcBackendOptions()
    ngpu = torch.cuda.device_count()
    for peer in range(comm.size):
        if peer != comm.rank:
            opts.set_device_map(f"worker{peer}", {0: peer % ngpu})
    rpc.init_rpc(rpc_backend_options=opts)
    yield comm
    rpc.shutdown()


@pytest.mark.parametrize("nbytes", [1024, 4 << 20])
def test_cuda_tensor_lands_on_mapped_device_and_comes_back(gpu_world, nbytes):
    peer = (gpu_world.rank + 1) % gpu_world.size
    x = torch.randn(nbytes // 4, device="cuda:0")
    device, total = rpc.rpc_sync(f"worker{peer}", on_device, args=(x,), timeout=60)
    assert device == f"cuda:{peer % torch.cuda.device_count()}"
    assert total == pytest.approx(float(x.double().sum()), rel=1e-6)
    y = rpc.rpc_sync(f"worker{peer}", f.identity, args=(x,), timeout=60)
    assert y.device == x.device and torch.equal(x, y)  # replies use the inverse map


def test_cpu_tensors_stay_on_cpu(gpu_world):
    peer = (gpu_world.rank + 1) % gpu_world.size
    assert rpc.rpc_sync(f"worker{peer}", on_device, args=(torch.ones(3),), timeout=30)[0] == "cpu"


def test_unmapped_device_is_a_clear_error(gpu_world):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs for an unmapped device")
    peer = (gpu_world.rank + 1) % gpu_world.size
    with pytest.raises(ValueError, match="no device map entry"):
        rpc.rpc_sync(f"worker{peer}", f.identity, args=(torch.ones(2, device="cuda:1"),))


def test_cuda_awareness_override(monkeypatch):
    monkeypatch.setenv("MPIDAG_CUDA_AWARE", "0")
    assert detect_cuda_aware(Config.from_env().cuda_aware) is False
    monkeypatch.setenv("MPIDAG_CUDA_AWARE", "1")
    assert detect_cuda_aware(Config.from_env().cuda_aware) is True
