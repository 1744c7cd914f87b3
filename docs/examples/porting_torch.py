"""Distributed autograd and the distributed optimizer, as in PyTorch's documentation.

Run: torchrun --nproc-per-node 2 porting_torch.py
"""

import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import optim
from torch.distributed.optim import DistributedOptimizer


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
    rank = int(os.environ["RANK"])  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    world_size = int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    train(rank, peer="worker1" if rank == 0 else "worker0")
    rpc.shutdown()


if __name__ == "__main__":
    main()
