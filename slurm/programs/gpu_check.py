"""One rank per GPU: CUDA tensors over mpidag RPC, or CPU tensors where there is no GPU.

Each rank uses the GPU Slurm gave it (``--gpus-per-task=1``: it sees one, ``cuda:0``; with
all of the node's GPUs visible it takes ``cuda:<SLURM_LOCALID>``), maps its device to every
peer's with ``set_device_map`` and sends a tensor to the next rank, which adds to it on its
own GPU. Where ``torch.cuda.is_available()`` is False (a CPU-only build of torch, no GPU,
no driver) the same exchange runs with CPU tensors. Every rank prints the path it took:
``path=cuda:N cuda_aware_mpi=True|False`` or ``path=cpu``; worker0 ends with
``OK gpu: world_size=N path=...``.

``MPIDAG_CUDA_AWARE=1/0`` forces device buffers to go to MPI directly / through host memory
(default: ask the MPI library).

Run:  srun --mpi=pmix --gpus-per-task=1 -n 2 python slurm/programs/gpu_check.py
"""

from __future__ import annotations

import os
import sys

import torch
from _common import all_ranks_ok, check_world, slurm_summary
from mpi4py import MPI

import mpidag.rpc as rpc
from mpidag.transport.mpi import detect_cuda_aware


def add_on_my_device(t: torch.Tensor, value: float) -> tuple[torch.Tensor, str]:
    """Runs on the receiving rank: the tensor arrives on its device (the device map)."""
    return t + value, str(t.device)


def pick_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("SLURM_LOCALID", os.environ.get(
        "OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def main() -> int:
    rank, size = check_world("gpu")
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"[gpu] rank={rank} path={device} gpu={torch.cuda.get_device_name(device)} "
              f"cuda_aware_mpi={detect_cuda_aware()} "
              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '-')}", flush=True)
    else:
        print(f"[gpu] rank={rank} path=cpu (torch.cuda.is_available() is False: torch "
              f"{torch.__version__}, CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES', '-')}); using CPU tensors", flush=True)
    # Every rank's device index, to build the device maps (before RPC starts).
    devices = MPI.COMM_WORLD.allgather(device.index if device.type == "cuda" else None)
    opts = rpc.MPIRpcBackendOptions()
    if device.type == "cuda":
        opts.set_devices([device])
        for peer, peer_device in enumerate(devices):
            if peer != rank:
                opts.set_device_map(f"worker{peer}", {device: peer_device})
    rpc.init_rpc(rpc_backend_options=opts)
    nxt = f"worker{(rank + 1) % size}"
    x = torch.arange(1 << 16, dtype=torch.float32, device=device)
    y, remote_device = rpc.rpc_sync(nxt, add_on_my_device, args=(x, float(rank)), timeout=120)
    ok = y.device == device and torch.equal(y, x + rank)
    print(f"[gpu] rank={rank} sent {x.numel()} floats on {device} to {nxt}: they arrived on "
          f"{remote_device}, the answer came back on {y.device}: {'ok' if ok else 'WRONG'}",
          flush=True)
    all_ok = all_ranks_ok(ok)
    rpc.shutdown()
    if rank == 0:
        if all_ok:
            print(f"[gpu] {slurm_summary()}")
            print(f"OK gpu: world_size={size} path={'cuda' if device.type == 'cuda' else 'cpu'}",
                  flush=True)
        else:
            print("FAILED gpu: a tensor came back wrong or on the wrong device", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
