"""Hybrid jobs: rpc.init_process_group (a torch.distributed group from the MPI job),
mpidag.nn.parallel.DistributedDataParallel inside distributed autograd (2 and 3 ranks), and
examples/ddp_rpc.py at 4 ranks against the same training done locally."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag.errors import RPCError, RPCNotInitializedError, UnknownWorkerError
from mpidag.nn.parallel import DistributedDataParallel as DDP
from tests.test_examples import numbers, ok_line, run_example

close = torch.testing.assert_close


@pytest.mark.mpi(min_size=2)
def test_process_group_over_every_rank(rpc_world):
    pg = rpc.init_process_group(timeout=60)
    try:
        assert dist.is_initialized() and pg is dist.group.WORLD
        assert (pg.rank(), pg.size()) == (rpc_world.rank, rpc_world.size)
        assert (dist.get_rank(), dist.get_world_size()) == (rpc_world.rank, rpc_world.size)
        t = torch.tensor([float(rpc_world.rank + 1)])
        dist.all_reduce(t, group=pg)
        assert t.item() == rpc_world.size * (rpc_world.size + 1) / 2
        # RPC goes on beside it
        assert rpc.rpc_sync(rpc_world.next, torch.add, args=(torch.ones(1), 1)).item() == 2
        # a second group while the first exists: a clear error on every member
        with pytest.raises(ValueError, match="already has a default process group"):
            rpc.init_process_group(timeout=60)
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_process_group_of_some_ranks_by_name(rpc_world):
    members = [rpc_world.size - 1, 0]  # with 3 ranks, rank 1 is left out
    pg = rpc.init_process_group(ranks=[f"worker{r}" for r in members], backend="gloo",
                                timeout=60)
    if rpc_world.rank not in members:
        assert pg is None and not dist.is_initialized()
        return
    try:
        assert (pg.rank(), pg.size()) == (members.index(rpc_world.rank), 2)
        seen: list[int | None] = [None, None]
        dist.all_gather_object(seen, rpc_world.rank, group=pg)
        assert seen == members
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_process_group_errors_reach_every_rank(rpc_world):
    rank = rpc_world.rank
    if rank == 0:
        with pytest.raises(UnknownWorkerError, match="unknown destination rank 99"):
            rpc.init_process_group(ranks=[0, 99], timeout=60)
    else:
        with pytest.raises(RPCError, match=r"failed on rank\(s\) \[0\]"):
            rpc.init_process_group(ranks=[0, 1], timeout=60)
    assert not dist.is_initialized()
    with pytest.raises(RPCError, match=r"rank\(s\) \[.*\] passed other ranks/backend"):
        rpc.init_process_group(ranks=[0] if rank == 0 else [0, 1], timeout=60)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] appear more than once"):
        rpc.init_process_group(ranks=[1, 0, 1], timeout=60)
    with pytest.raises(ValueError, match="needs a member"):
        rpc.init_process_group(ranks=[], timeout=60)
    with pytest.raises(TypeError, match="ranks must be a list"):
        rpc.init_process_group(ranks=0, timeout=60)
    if rank == rpc_world.size - 1:
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            rpc.init_process_group(timeout=-1)
    else:
        with pytest.raises(RPCError, match="failed on rank"):
            rpc.init_process_group(timeout=60)
    assert not dist.is_initialized()
    pg = rpc.init_process_group(timeout=60)  # nothing left over: a correct call works
    try:
        assert pg.size() == rpc_world.size
    finally:
        dist.destroy_process_group()


def test_process_group_before_init_rpc():
    with pytest.raises(RPCNotInitializedError, match="init_rpc"):
        rpc.init_process_group(ranks=[0])


def _local_grads(seed_rank: int, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    loss = (model(x) * 2).pow(2).sum()
    return list(torch.autograd.grad(loss, list(model.parameters())))


def _distributed_backward_averages(rpc_world, model: nn.Module, x: torch.Tensor,
                                   mean: list) -> None:
    """A distributed backward through the next rank and back (the averaging runs when the
    gradient arrives from there, in a serving thread): the context holds the mean of every
    rank's gradients, and .grad stays unset."""
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync(rpc_world.next, torch.mul, args=(model(x), 2))
        dist_autograd.backward(context_id, [out.pow(2).sum()])
        grads = dist_autograd.get_gradients(context_id)
    close([grads[p] for p in model.parameters()], mean)
    assert all(p.grad is None for p in model.parameters())


def _no_sync_keeps_own_then_local_backward_averages(rpc_world, model: nn.Module,
                                                    x: torch.Tensor, own: list, mean: list):
    """Under ``no_sync()`` a distributed backward keeps this rank's own gradients (as torch);
    outside a context the module is torch's DDP: its reducer, unharmed, averages into .grad."""
    with dist_autograd.context() as context_id, model.no_sync():
        out = rpc.rpc_sync(rpc_world.next, torch.mul, args=(model(x), 2))
        dist_autograd.backward(context_id, [out.pow(2).sum()])
        grads = dist_autograd.get_gradients(context_id)
    close([grads[p] for p in model.parameters()], own)
    (model(x) * 2).pow(2).sum().backward()
    close([p.grad for p in model.parameters()], mean)


@pytest.mark.mpi(min_size=2)
def test_ddp_averages_gradients_inside_distributed_autograd(rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    pg = rpc.init_process_group(timeout=60)
    model = None
    try:
        torch.manual_seed(rank)  # different on every rank: DDP broadcasts rank 0's
        model = DDP(nn.Linear(3, 2), process_group=pg)
        torch.manual_seed(0)
        reference = nn.Linear(3, 2)
        close([p.detach() for p in model.parameters()],
              [p.detach() for p in reference.parameters()])
        data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + r))
                for r in range(size)]
        per_rank = [_local_grads(r, reference, data[r]) for r in range(size)]
        mean = [sum(g[i] for g in per_rank) / size for i in range(2)]
        for _ in range(2):  # twice: nothing left pending in DDP between iterations
            _distributed_backward_averages(rpc_world, model, data[rank], mean)
        _no_sync_keeps_own_then_local_backward_averages(rpc_world, model, data[rank],
                                                        per_rank[rank], mean)
    finally:
        # every member here before any tears its group down, and the DDP reducer (which
        # holds the group) freed first: destroying a Gloo group whose peer has left while
        # the reducer still held it hung in ~ProcessGroupGloo (seen once in CI)
        dist.barrier()
        model = None
        gc.collect()
        dist.destroy_process_group()


class _SparseBag(nn.Module):
    """An EmbeddingBag with sparse gradients under a dense layer (DDP's sparse case)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum", sparse=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(indices, offsets))


@pytest.mark.mpi(min_size=2)
def test_ddp_averages_sparse_embedding_gradients_inside_distributed_autograd(rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    pg = rpc.init_process_group(timeout=60)
    model = None
    try:
        torch.manual_seed(rank)  # DDP broadcasts rank 0's parameters
        model = DDP(_SparseBag(), process_group=pg)
        torch.manual_seed(0)
        reference = _SparseBag()
        # every rank its own rows of the table; the last rank's bag is empty (no rows:
        # an all-zero gradient, which still joins the sparse all-reduce)
        inputs = [(torch.tensor([r, r + 1, 7]), torch.tensor([0, 2])) for r in range(size)]
        inputs[-1] = (torch.tensor([], dtype=torch.long), torch.tensor([0, 0]))
        per_rank = []
        for r in range(size):
            loss = (reference(*inputs[r]) * 2).pow(2).sum()
            per_rank.append(torch.autograd.grad(loss, list(reference.parameters())))
        mean = [sum(g[i].to_dense() for g in per_rank) / size for i in range(3)]
        for _ in range(2):
            with dist_autograd.context() as context_id:
                out = rpc.rpc_sync(rpc_world.next, torch.mul, args=(model(*inputs[rank]), 2))
                dist_autograd.backward(context_id, [out.pow(2).sum()])
                grads = dist_autograd.get_gradients(context_id)
            weight = model.module.bag.weight
            assert grads[weight].is_sparse and weight.grad is None
            close(grads[weight].to_dense(), mean[0])
            close([grads[p] for p in list(model.parameters())[1:]], mean[1:])
    finally:
        dist.barrier()
        model = None
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_torch_ddp_unchanged_averages_inside_distributed_autograd(rpc_world):
    """torch's own DistributedDataParallel inside mpidag's distributed backward: its reducer
    never runs there, so mpidag averages through the reducer's buckets (before: each rank
    silently kept its own gradients and the replicas drifted)."""
    rank, size = rpc_world.rank, rpc_world.size
    pg = rpc.init_process_group(timeout=60)
    model = static = None
    try:
        torch.manual_seed(rank)
        model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2), process_group=pg)
        torch.manual_seed(0)
        reference = nn.Linear(3, 2)
        data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + r))
                for r in range(size)]
        per_rank = [_local_grads(r, reference, data[r]) for r in range(size)]
        mean = [sum(g[i] for g in per_rank) / size for i in range(2)]
        hooked: list[torch.Tensor] = []
        model.module.bias.register_post_accumulate_grad_hook(hooked.append)
        for _ in range(2):
            _distributed_backward_averages(rpc_world, model, data[rank], mean)
        assert len(hooked) == 2  # after the averaging, once per backward
        _no_sync_keeps_own_then_local_backward_averages(rpc_world, model, data[rank],
                                                        per_rank[rank], mean)
        # what mpidag cannot do on the reducer's behalf is an error, never wrong training
        static = nn.parallel.DistributedDataParallel(nn.Linear(3, 2), process_group=pg,
                                                     static_graph=True)
        with dist_autograd.context() as context_id:
            loss = static(data[rank]).sum()
            with pytest.raises(RuntimeError, match=r"static_graph=True cannot average .*"
                                                   r"mpidag\.nn\.parallel\.Distributed"):
                dist_autograd.backward(context_id, [loss])
    finally:
        dist.barrier()
        model = static = None
        gc.collect()
        dist.destroy_process_group()


def test_ddp_rpc_example_equals_local_training_at_4_ranks_with_torch_ddp_and_mpidag_ddp():
    for ddp, epochs, batches in (("torch", 2, 4), ("mpidag", 1, 3)):
        proc = run_example("ddp_rpc.py", nprocs=4,
                           args=("--epochs", str(epochs), "--batches", str(batches),
                                 "--ddp", ddp), timeout=120)
        line = ok_line(proc, "ddp_rpc")
        assert f"trainers=2 epochs={epochs} batches={batches} " in line
        assert f"ddp={ddp} " in line
        (diff,) = numbers(line, r" max_diff_to_local=(\S+)")
        assert diff < 1e-5
        assert "largest difference between the trainers' DDP replicas: 0.00e+00" in proc.stdout
        assert "[master] RemoteModule(on=ps, device=cpu, module=EmbeddingBag)" in proc.stdout
        for trainer in ("trainer0", "trainer1"):
            assert f"[{trainer}] epoch {epochs}/{epochs} loss " in proc.stdout
