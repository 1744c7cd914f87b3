"""Distributed autograd and the distributed optimizer, as in PyTorch's documentation.

Run: python -m mpidag.run -n 2 porting_mpidag.py
"""

import torch
from torch import optim

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag.optim import DistributedOptimizer


def random_tensor():
    return torch.rand((3, 3), requires_grad=True)


def train(rank, peer):
    with dist_autograd.context() as context_id:
        # Forward pass: create references to tensors made on the peer.
        rref1 = rpc.remote(peer, random_tensor)
        rref2 = rpc.remote(peer, random_tensor)
        loss = rref1.to_here() + rref2.to_here()

        # Backward pass: run distributed autograd.
        dist_autograd.backward(context_id, [loss.sum()])

        # Update the tensors where they live, with the gradients of this context.
        dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05)
        dist_optim.step(context_id)
        print(f"worker{rank}: loss {loss.sum().item():.4f}, optimizer step done")


def main():
    rpc.init_rpc()  # mpirun/srun set rank and world size; the worker is named worker{rank}
    rank = rpc.get_worker_info().id
    train(rank, peer="worker1" if rank == 0 else "worker0")
    rpc.shutdown()


if __name__ == "__main__":
    main()
