"""DistributedDataParallel and RPC in one MPI job: a remote embedding and a replicated dense part.

The shape of PyTorch's tutorial "Combining Distributed DataParallel with Distributed RPC
Framework", on 4 MPI ranks:

    rank 0, 1  trainer0, trainer1: an nn.Linear(16, 8) wrapped in DistributedDataParallel
               over the trainers' process group (made by mpidag.rpc.init_process_group)
    rank 2     master: builds the embedding as a RemoteModule on the parameter server,
               starts the trainers over RPC, and checks the result against local training
    rank 3     ps: the parameter server, holding an nn.EmbeddingBag(100, 16, mode="sum")

Each trainer's step::

    with dist_autograd.context() as context_id:
        emb = remote_emb_module.forward(indices, offsets)     # RPC to ps
        loss = criterion(ddp_fc(emb), target)                 # local, DDP-replicated
        dist_autograd.backward(context_id, [loss])            # fc grads averaged over the
                                                              # trainers, emb grads to ps
        opt.step(context_id)     # one DistributedOptimizer: the embedding on ps + local fc

The differences from torch's tutorial: the process group needs no address or port
(``rpc.init_process_group(ranks=["trainer0", "trainer1"])``, called by every rank after
``init_rpc``), the data is seeded, and the trainers wait
for each other after each step (a barrier over their process group), so that both
forwards of a step read the embedding after both updates of the step before. That makes the
run deterministic: at the end the master repeats the training locally (same initial
parameters, same batches: the dense part's gradient is the trainers' mean, the embedding's
the sum of their gradients) and fails unless the parameters agree.

DDP is torch's own ``torch.nn.parallel.DistributedDataParallel``, unchanged (its reducer
never sees mpidag's backward pass: mpidag averages the gradients of a torch DDP module's
parameters itself, through the reducer's buckets and communication hook); ``--ddp mpidag``
uses ``mpidag.nn.parallel.DistributedDataParallel`` instead (averaging in the module's
forward), with the same result.

Run:  python -m mpidag.run -n 4 examples/ddp_rpc.py [--epochs 3] [--batches 5] [--ddp mpidag]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag.nn import RemoteModule
from mpidag.nn.parallel import DistributedDataParallel as MpidagDDP
from mpidag.optim import DistributedOptimizer

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
LR = 0.05
TRAINERS = ["trainer0", "trainer1"]
NAMES = [*TRAINERS, "master", "ps"]


class HybridModel(nn.Module):
    """The remote embedding, then the local dense layer wrapped in DDP."""

    def __init__(self, remote_emb_module: RemoteModule, ddp: str = "torch") -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        torch.manual_seed(100 + dist.get_rank())  # different on purpose: DDP broadcasts
        ddp_class = MpidagDDP if ddp == "mpidag" else nn.parallel.DistributedDataParallel
        self.fc = ddp_class(nn.Linear(EMBEDDING_DIM, 8))  # trainer0's parameters to trainer1

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


def get_batch(trainer: int, epoch: int, batch: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of bags of indices (the tutorial's shape), the same wherever it is made."""
    gen = torch.Generator().manual_seed(1000 * trainer + 100 * epoch + batch)
    num_indices = int(torch.randint(20, 50, (1,), generator=gen))
    indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,), generator=gen)
    offsets, start = [], 0
    while start < num_indices:
        offsets.append(start)
        start += int(torch.randint(1, 10, (1,), generator=gen))
    target = torch.randint(0, 8, (len(offsets),), generator=gen)
    return indices, torch.tensor(offsets), target


def _run_trainer(remote_emb_module: RemoteModule, trainer: int, epochs: int,
                 batches: int, ddp: str = "torch") -> dict:
    """On a trainer (called by the master over RPC): train, return what the check needs."""
    model = HybridModel(remote_emb_module, ddp)
    initial_fc = {k: v.detach().clone() for k, v in model.fc.module.state_dict().items()}
    # the remote embedding's parameters and the local dense ones, in one optimizer
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(rpc.RRef(param))
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=LR)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(epochs):
        for batch in range(batches):
            indices, offsets, target = get_batch(trainer, epoch, batch)
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            dist.barrier()  # both trainers' updates land before the next forwards
            losses.append(loss.item())
        print(f"[{TRAINERS[trainer]}] epoch {epoch + 1}/{epochs} loss {losses[-1]:.4f}",
              flush=True)
    return {"initial_fc": initial_fc, "losses": losses,
            "fc": {k: v.detach().clone() for k, v in model.fc.module.state_dict().items()}}


def train_locally(initial_emb: dict, initial_fc: dict, epochs: int, batches: int
                  ) -> tuple[nn.Module, nn.Module]:
    """The same training on one process: per step, both trainers' batches; the dense
    gradient is their mean (DDP), the embedding's their sum (two SGD steps on ps)."""
    emb = nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum")
    emb.load_state_dict(initial_emb)
    fc = nn.Linear(EMBEDDING_DIM, 8)
    fc.load_state_dict(initial_fc)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        for batch in range(batches):
            grads: dict[nn.Parameter, torch.Tensor] = {}
            for trainer in range(len(TRAINERS)):
                indices, offsets, target = get_batch(trainer, epoch, batch)
                loss = criterion(fc(emb(indices, offsets)), target)
                params = [*emb.parameters(), *fc.parameters()]
                for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
                    grads[p] = grads[p] + g if p in grads else g
            with torch.no_grad():
                for p in emb.parameters():
                    p -= LR * grads[p]
                for p in fc.parameters():
                    p -= LR * grads[p] / len(TRAINERS)
    return emb, fc


def run_master(epochs: int, batches: int, ddp: str = "torch") -> None:
    remote_emb_module = RemoteModule("ps", nn.EmbeddingBag,
                                     args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                                     kwargs={"mode": "sum"})
    print(f"[master] {remote_emb_module!r}; training {len(TRAINERS)} trainers for {epochs} "
          f"epoch(s) of {batches} batches", flush=True)
    initial_emb = remote_emb_module.get_module_rref().to_here().state_dict()
    futs = [rpc.rpc_async(name, _run_trainer,
                          args=(remote_emb_module, trainer, epochs, batches, ddp))
            for trainer, name in enumerate(TRAINERS)]
    results = [fut.wait() for fut in futs]
    final_emb = remote_emb_module.get_module_rref().to_here().state_dict()
    emb, fc = train_locally(initial_emb, results[0]["initial_fc"], epochs, batches)
    diffs = [(final_emb["weight"] - emb.weight).abs().max().item()]
    replicas = max((results[0]["fc"][name] - results[1]["fc"][name]).abs().max().item()
                   for name in fc.state_dict())
    print(f"[master] largest difference between the trainers' DDP replicas: {replicas:.2e}",
          flush=True)
    if replicas != 0:
        raise SystemExit(f"the trainers' DDP replicas drifted apart by {replicas:.2e}")
    for result in results:
        for name, value in fc.state_dict().items():
            diffs.append((result["fc"][name] - value).abs().max().item())
    diff = max(diffs)
    first = sum(r["losses"][0] for r in results) / len(results)
    last = sum(r["losses"][-1] for r in results) / len(results)
    print(f"[master] largest difference to local training: {diff:.2e}", flush=True)
    if not diff < 1e-5:
        raise SystemExit(f"hybrid training differs from local training by {diff:.2e}")
    print(f"OK ddp_rpc: trainers={len(TRAINERS)} epochs={epochs} batches={batches} ddp={ddp} "
          f"loss {first:.4f} -> {last:.4f} final_loss={last:.4f} "
          f"max_diff_to_local={diff:.2e}", flush=True)


def run_worker(rank: int, epochs: int, batches: int, ddp: str = "torch") -> None:
    rpc.init_rpc(NAMES[rank], rank=rank, world_size=len(NAMES))
    # every rank takes part; the trainers get torch's default group over the two of them
    pg = rpc.init_process_group(ranks=TRAINERS, backend="gloo", timeout=60)
    if NAMES[rank] == "master":
        run_master(epochs, batches, ddp)
    rpc.shutdown()  # trainers and ps serve until the master is done
    if pg is not None:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=5, help="batches per epoch")
    parser.add_argument("--ddp", choices=("torch", "mpidag"), default="torch",
                        help="torch's DistributedDataParallel (default) or mpidag's subclass")
    args = parser.parse_args()
    if args.epochs < 1 or args.batches < 1:
        parser.error("--epochs and --batches must be positive")

    from mpi4py import MPI  # MPI gives each process its rank (torch: mp.spawn)

    rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if world_size != len(NAMES):
        raise SystemExit(f"ddp_rpc needs {len(NAMES)} ranks: 2 trainers, a master and a "
                         f"parameter server (python -m mpidag.run -n 4 examples/ddp_rpc.py)")
    run_worker(rank, args.epochs, args.batches, args.ddp)


if __name__ == "__main__":
    main()
