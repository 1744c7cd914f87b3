"""The end-to-end example of PyTorch's distributed autograd design document, on MPI.

Every rank creates two random tensors on the next rank with ``rpc.remote``, adds them
locally after ``to_here()``, runs the distributed backward pass, and steps a
``DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05)``: the owner's tensors move by
``-0.05 * gradient`` (the gradient of a sum is 1). Only the imports and the launch differ
from the torch program (``mp.spawn`` + ``MASTER_ADDR`` there; MPI starts the ranks here).

Run:  python -m mpidag.run -n 2 examples/dist_optim_example.py
"""

from __future__ import annotations

import torch
from torch import optim

import mpidag.autograd as dist_autograd  # was: import torch.distributed.autograd
from mpidag import rpc  # was: from torch.distributed import rpc
from mpidag.optim import DistributedOptimizer  # was: from torch.distributed.optim


def random_tensor():
    return torch.rand((3, 3), requires_grad=True)


def _run_process(rank, dst_rank, world_size):
    name = f"worker{rank}"
    dst_name = f"worker{dst_rank}"
    # Initialize RPC.
    rpc.init_rpc(name=name, rank=rank, world_size=world_size)
    # Use a distributed autograd context.
    with dist_autograd.context() as context_id:
        # Forward pass (create references on remote nodes).
        rref1 = rpc.remote(dst_name, random_tensor)
        rref2 = rpc.remote(dst_name, random_tensor)
        loss = rref1.to_here() + rref2.to_here()
        # Backward pass (run distributed autograd).
        dist_autograd.backward(context_id, [loss.sum()])
        # Build DistributedOptimizer.
        dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05)
        # Run the distributed optimizer step.
        before = rref1.to_here()
        dist_optim.step(context_id)
        after = rref1.to_here()
    moved = (before - after).detach()
    torch.testing.assert_close(moved, torch.full((3, 3), 0.05))
    print(f"[{name}] the SGD step on {dst_name} moved each value by {moved[0, 0].item():.4f} "
          f"(lr 0.05 x gradient 1)")


def run_process(rank, world_size):
    dst_rank = (rank + 1) % world_size
    _run_process(rank, dst_rank, world_size)
    rpc.shutdown()


if __name__ == "__main__":
    from mpi4py import MPI  # MPI gives each process its rank (torch: mp.spawn)

    run_process(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
