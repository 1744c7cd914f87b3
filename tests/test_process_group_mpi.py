"""The ``torch.distributed`` process group over the job's MPI (:mod:`mpidag.distributed`):
every collective's values against numbers computed here, several dtypes, non-contiguous
tensors, async handles, a group of some ranks, clear errors, and torch's unchanged
``DistributedDataParallel`` training to the parameters of one process's training.

Run at 2 and 3 ranks::

    python -m mpidag.run -n 3 -m pytest -q --with-mpi -m mpi tests/test_process_group_mpi.py
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mpidag.rpc as rpc
from mpidag.distributed import BACKEND, MPIProcessGroup
from tests.test_hybrid import _distributed_backward_averages, _local_grads

pytestmark = pytest.mark.mpi(min_size=2)
close = torch.testing.assert_close
SUM, PRODUCT, MIN, MAX, AVG = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
                               dist.ReduceOp.MAX, dist.ReduceOp.AVG)


@pytest.fixture
def pg(rpc_world) -> Iterator[MPIProcessGroup]:
    """The MPI group over every rank, as torch's default group."""
    group = rpc.init_process_group(backend="mpi", timeout=60)
    try:
        yield group
    finally:
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def _value(rank: int, dtype: torch.dtype, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    """A rank-dependent tensor whose products and sums stay exact in every dtype tested."""
    base = torch.arange(torch.Size(shape).numel()).reshape(shape) % 3
    if dtype == torch.bool:
        return (base + rank) % 2 == 0
    return (base + rank + 1).to(dtype)


def _expected(op: dist.ReduceOp, values: list[torch.Tensor]) -> torch.Tensor:
    wide = [v.to(torch.complex128 if v.is_complex() else torch.float64) for v in values]
    stacked = torch.stack(wide)
    if op == SUM:
        out = stacked.sum(0)
    elif op == PRODUCT:
        out = stacked.prod(0)
    elif op == AVG:
        out = stacked.mean(0)
    elif op == MIN:
        out = stacked.amin(0)
    else:
        out = stacked.amax(0)
    return out.to(values[0].dtype)


def test_the_group_is_mpi_over_every_rank(pg, rpc_world):
    assert isinstance(pg, MPIProcessGroup) and pg is dist.group.WORLD
    assert dist.get_backend() == BACKEND == pg.getBackendName()
    assert (dist.get_rank(), dist.get_world_size()) == (rpc_world.rank, rpc_world.size)
    assert pg.world_ranks == list(range(rpc_world.size))
    # RPC goes on beside it
    assert rpc.rpc_sync(rpc_world.next, torch.add, args=(torch.ones(1), 1)).item() == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32,
                                   torch.uint8, torch.float16, torch.bfloat16,
                                   torch.complex64, torch.bool], ids=str)
def test_all_reduce_every_op_and_dtype(pg, rpc_world, dtype):
    rank, size = rpc_world.rank, rpc_world.size
    ops = [SUM, PRODUCT, MIN, MAX]
    if dtype.is_floating_point or dtype.is_complex:
        ops.append(AVG)
    if dtype.is_complex:  # torch itself refuses the others on complex tensors
        ops = [SUM, AVG]
    for op in ops:
        t = _value(rank, dtype)
        dist.all_reduce(t, op=op)
        if dtype == torch.bool:  # SUM/MAX are OR, PRODUCT/MIN are AND
            values = [_value(r, dtype) for r in range(size)]
            any_, all_ = torch.stack(values).any(0), torch.stack(values).all(0)
            assert torch.equal(t, any_ if op in (SUM, MAX) else all_), op
            continue
        close(t, _expected(op, [_value(r, dtype) for r in range(size)]), msg=str(op))


def test_broadcast_reduce_and_barrier(pg, rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    for root in range(size):
        t = _value(rank, torch.float64)
        dist.broadcast(t, src=root)
        close(t, _value(root, torch.float64))
        t = _value(rank, torch.int64)
        dist.reduce(t, dst=root, op=SUM)
        if rank == root:
            close(t, _expected(SUM, [_value(r, torch.int64) for r in range(size)]))
    b = torch.tensor([True, False]) if rank == 0 else torch.zeros(2, dtype=torch.bool)
    dist.broadcast(b, src=0)
    assert b.tolist() == [True, False]
    dist.barrier()



def test_large_reductions_run_in_chunks_with_exact_values(pg, rpc_world, monkeypatch):
    """An all_reduce / reduce over CHUNK_BYTES runs as chunks (64 bytes here, 2 in flight):
    the values are those of one reduction, for a length that is not a multiple of the
    chunk, every op, a widened dtype, a non-contiguous tensor, and async calls on the
    group's communicator between chunked ones."""
    from mpidag.distributed import process_group

    monkeypatch.setattr(process_group, "CHUNK_BYTES", 64)
    monkeypatch.setattr(process_group, "CHUNK_WINDOW", 2)
    rank, size = rpc_world.rank, rpc_world.size
    shape = (7, 13)  # 91 elements: 5 chunks of 16 float32 and one of 11
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        for op in (SUM, PRODUCT, MIN, MAX) + ((AVG,) if dtype.is_floating_point else ()):
            t = _value(rank, dtype, shape)
            dist.all_reduce(t, op=op)
            close(t, _expected(op, [_value(r, dtype, shape) for r in range(size)]),
                  rtol=0, atol=0)
    t = _value(rank, torch.float32, (13, 7)).t()
    dist.all_reduce(t, op=SUM)
    close(t, _expected(SUM, [_value(r, torch.float32, (13, 7)).t() for r in range(size)]),
          rtol=0, atol=0)
    # several chunked operations in flight with small ones between them, waited out of order
    a, b = _value(rank, torch.float64, (50,)), _value(rank, torch.int32, (33,))
    small = torch.full((2,), float(rank))
    works = [dist.all_reduce(a, async_op=True), dist.broadcast(small, src=size - 1,
                                                                async_op=True),
             dist.reduce(b, dst=0, op=MAX, async_op=True)]
    for work in reversed(works):
        work.wait()
    close(a, _expected(SUM, [_value(r, torch.float64, (50,)) for r in range(size)]),
          rtol=0, atol=0)
    assert small.tolist() == [size - 1.0, size - 1.0]
    if rank == 0:
        close(b, _expected(MAX, [_value(r, torch.int32, (33,)) for r in range(size)]),
              rtol=0, atol=0)

def test_all_gather_and_reduce_scatter(pg, rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    every = [_value(r, torch.float32) for r in range(size)]
    out = [torch.empty(2, 3) for _ in range(size)]
    dist.all_gather(out, _value(rank, torch.float32))
    close(out, every)
    flat = torch.empty(size * 2, 3)
    dist.all_gather_into_tensor(flat, _value(rank, torch.float32))
    close(flat, torch.cat(every))
    # reduce_scatter: member i gets the sum over ranks of their i-th part
    parts = [torch.full((3,), float(10 * rank + i)) for i in range(size)]
    got = torch.empty(3)
    dist.reduce_scatter(got, parts, op=SUM)
    close(got, torch.full((3,), float(sum(10 * r + rank for r in range(size)))))
    got = torch.empty(3, dtype=torch.float64)
    dist.reduce_scatter_tensor(got, torch.cat(parts).double(), op=MAX)
    close(got, torch.full((3,), float(10 * (size - 1) + rank), dtype=torch.float64))
    got = torch.empty(3)
    dist.reduce_scatter_tensor(got, torch.cat(parts), op=AVG)
    close(got, torch.full((3,), sum(10 * r + rank for r in range(size)) / size))


def test_gather_scatter_and_all_to_all(pg, rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    root = size - 1
    gathered = [torch.empty(2, dtype=torch.int64) for _ in range(size)] if rank == root \
        else None
    dist.gather(torch.tensor([rank, -rank]), gathered, dst=root)
    if rank == root:
        assert [g.tolist() for g in gathered] == [[r, -r] for r in range(size)]
    got = torch.empty(2)
    parts = [torch.tensor([float(r), 0.5]) for r in range(size)] if rank == root else None
    dist.scatter(got, parts, src=root)
    assert got.tolist() == [float(rank), 0.5]
    out = torch.empty(size)
    dist.all_to_all_single(out, torch.arange(size, dtype=torch.float32) + 100 * rank)
    assert out.tolist() == [100.0 * r + rank for r in range(size)]


def test_non_contiguous_tensors(pg, rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    t = _value(rank, torch.float32, (3, 4)).t()  # a transposed view
    assert not t.is_contiguous()
    dist.all_reduce(t)
    close(t, _expected(SUM, [_value(r, torch.float32, (3, 4)) for r in range(size)]).t())
    holder = torch.zeros(4, 6)
    view = holder[:, ::2]  # every other column: written in place, the rest untouched
    view.copy_(_value(rank, torch.float32, (4, 3)))
    dist.broadcast(view, src=0)
    close(holder[:, ::2], _value(0, torch.float32, (4, 3)))
    assert holder[:, 1::2].abs().sum().item() == 0
    outs = [torch.zeros(3, 4)[:, :2] for _ in range(size)]
    dist.all_gather(outs, torch.full((3, 2), float(rank)))
    close(outs, [torch.full((3, 2), float(r)) for r in range(size)])
    # a tensor that needs grad is read and written through .detach(), as torch does
    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        dist.all_reduce(w)
    close(w.detach(), torch.full((3,), float(size)))


def test_async_work_handles(pg, rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    tensors = [torch.full((1000,), float(rank + i)) for i in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works]
    doubled = futures[0].then(lambda fut: fut.value()[0] * 2)
    for work in works:
        assert work.wait()
        assert work.is_completed()
    base = sum(range(size))
    for i, t in enumerate(tensors):
        close(t, torch.full((1000,), float(base + size * i)))
    assert futures[3].value()[0] is tensors[3]
    close(doubled.wait(), torch.full((1000,), 2.0 * base))
    # a broadcast and a barrier, async too
    t = torch.full((5,), float(rank))
    work = dist.broadcast(t, src=1, async_op=True)
    dist.barrier(async_op=True).wait()
    work.wait()
    close(t, torch.ones(5))


def test_send_recv_and_their_async_forms(pg, rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(4, dtype=torch.float64)
    if rank % 2 == 0:
        dist.send(torch.arange(4.0, dtype=torch.float64) + rank, dst=nxt)
        dist.recv(got, src=prev)
    else:
        dist.recv(got, src=prev)
        dist.send(torch.arange(4.0, dtype=torch.float64) + rank, dst=nxt)
    close(got, torch.arange(4.0, dtype=torch.float64) + prev)
    big = torch.empty(1 << 18)
    receiving = dist.irecv(big, src=prev, tag=7)
    sending = dist.isend(torch.full((1 << 18,), float(rank)), dst=nxt, tag=7)
    receiving.wait()
    sending.wait()
    assert big.unique().tolist() == [float(prev)]
    # a list of p2p ops at once
    a, b = torch.empty(2), torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), rank + 0.5), nxt),
           dist.P2POp(dist.irecv, a, prev)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    b.copy_(a)
    close(b, torch.full((2,), prev + 0.5))


def test_some_ranks_and_a_subgroup(rpc_world):
    rank, size = rpc_world.rank, rpc_world.size
    members = [0, size - 1]  # with 3 ranks, rank 1 is left out
    pg = rpc.init_process_group(ranks=members, backend="mpi", timeout=60)
    if rank not in members:
        assert pg is None and not dist.is_initialized()
        return
    try:
        assert isinstance(pg, MPIProcessGroup) and pg.world_ranks == members
        assert (pg.rank(), pg.size()) == (members.index(rank), 2)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        assert t.item() == 1 + size
        out = [torch.empty(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(out, torch.tensor([rank]))
        assert [o.item() for o in out] == members
        # torch's new_group over the MPI default group: a group of its own
        solo = dist.new_group([1])
        if pg.rank() == 1:
            assert isinstance(solo, MPIProcessGroup) and solo.world_ranks == [size - 1]
            t = torch.tensor([5.0])
            dist.all_reduce(t, group=solo)
            assert t.item() == 5.0
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_torch_init_process_group_reaches_the_mpi_group(rpc_world):
    """``dist.init_process_group(backend="mpi")`` (torch's own name; a pip torch has no MPI
    backend) or ``"mpidag"``, with no MASTER_ADDR, no store, no rank: over every rank."""
    import os

    assert "MASTER_ADDR" not in os.environ
    for name in ("mpi", BACKEND):
        dist.init_process_group(backend=name)
        try:
            assert isinstance(dist.group.WORLD, MPIProcessGroup)
            assert dist.get_world_size() == rpc_world.size
            t = torch.ones(2)
            dist.all_reduce(t)
            close(t, torch.full((2,), float(rpc_world.size)))
        finally:
            dist.barrier()
            dist.destroy_process_group()
    with pytest.raises(ValueError, match="differ from the MPI job's"):
        dist.init_process_group(backend="mpi", rank=0, world_size=rpc_world.size + 5)


def test_bad_input_gets_a_clear_error(pg, rpc_world):
    size = rpc_world.size
    with pytest.raises(ValueError, match="needs one per group member"):
        dist.all_gather([torch.empty(2)] * (size + 1), torch.ones(2))
    with pytest.raises(ValueError, match="a tensor of 2 elements was expected"):
        dist.all_gather([torch.empty(3) for _ in range(size)], torch.ones(2))
    with pytest.raises(ValueError, match="one dtype"):
        dist.all_gather_into_tensor(torch.empty(2 * size, dtype=torch.int64), torch.ones(2))
    with pytest.raises(ValueError, match="AVG needs a floating point"):
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=AVG)
    with pytest.raises(ValueError, match="on complex tensors"):  # torch's check, or ours
        dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=MAX)
    with pytest.raises(ValueError, match="BAND needs an integer tensor"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="pass src="):
        dist.recv(torch.empty(1))
    with pytest.raises(ValueError, match="equal splits only"):
        dist.all_to_all_single(torch.empty(size), torch.empty(size),
                               [1] * size, [1] * size)
    # every rank raised before starting MPI: the group is still in step
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == size


def test_backend_mpi_needs_the_same_arguments_on_every_rank(rpc_world):
    backend = "mpi" if rpc_world.rank == 0 else "gloo"
    with pytest.raises(Exception, match="same arguments|passed other ranks/backend"):
        rpc.init_process_group(backend=backend, timeout=60)
    assert not dist.is_initialized()


def _train(model: nn.Module, batches: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in zip(batches, targets, strict=True):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_torch_ddp_trains_like_one_process(pg, rpc_world):
    """torch's unchanged DDP on the MPI group, each rank on its part of every batch, ends
    with the parameters of one process trained on the whole batches."""
    rank, size = rpc_world.rank, rpc_world.size

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()

    gen = torch.Generator().manual_seed(1)
    steps, per_rank = 4, 6
    xs = [torch.randn(size * per_rank, 5, generator=gen, dtype=torch.float64)
          for _ in range(steps)]
    ys = [torch.randn(size * per_rank, 3, generator=gen, dtype=torch.float64)
          for _ in range(steps)]
    local = make()
    _train(local, xs, ys)
    replica = make()
    if rank:  # replicas start apart: DDP broadcasts rank 0's parameters
        with torch.no_grad():
            for p in replica.parameters():
                p.add_(rank)
    ddp = nn.parallel.DistributedDataParallel(
        replica, process_group=pg, bucket_cap_mb=0.0005)  # several buckets, overlapping
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    _train(ddp, [x[part] for x in xs], [y[part] for y in ys])
    close(list(ddp.module.parameters()), list(local.parameters()))
    del ddp


def test_hybrid_rpc_and_ddp_on_the_mpi_group(pg, rpc_world):
    """DDP on the MPI group inside mpidag's distributed backward (the averaging runs in a
    serving thread while RPC goes on), as in tests/test_hybrid.py on Gloo."""
    rank, size = rpc_world.rank, rpc_world.size
    torch.manual_seed(rank)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2), process_group=pg)
    torch.manual_seed(0)
    reference = nn.Linear(3, 2)
    data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + r))
            for r in range(size)]
    per_rank = [_local_grads(r, reference, data[r]) for r in range(size)]
    mean = [sum(g[i] for g in per_rank) / size for i in range(2)]
    for _ in range(2):
        _distributed_backward_averages(rpc_world, model, data[rank], mean)
    del model
