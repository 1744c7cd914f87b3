"""Pipeline parallelism with RPC: a model in two stages on two workers, on MPI.

The shape of PyTorch's tutorial "Distributed Pipeline Parallelism Using RPC": the driver
on rank 0 creates the two stages of the model with ``rpc.remote``, splits every batch into
micro-batches and sends each one down the pipeline without waiting::

    x_rref = RRef(micro_batch)                         # on the driver
    y_rref = stage1_rref.remote().forward(x_rref)      # stage 1 fetches x, keeps its output
    z_fut = stage2_rref.rpc_async().forward(y_rref)    # stage 2 fetches y from stage 1

so stage 1 works on micro-batch i+1 while stage 2 works on micro-batch i. The driver
concatenates the outputs, computes the loss, runs ``dist_autograd.backward`` (gradients flow
back through both stages) and steps a ``DistributedOptimizer`` over the parameter RRefs of
both stages.

Placement: stage 1 on ``worker1`` and stage 2 on the last worker. With 2 ranks, stage 1
shares rank 0 with the driver (``rpc.remote`` to oneself works as for any other worker), so
the pipeline still has two stages on two processes; ranks between the first and the last,
with 4 or more, only serve.

The data is synthetic: a fixed random "teacher" network makes the regression targets that
the two-stage "student" learns with an MSE loss; the run checks that the loss on the whole
dataset went down. On the first batch the distributed gradients are compared with plain
local autograd on a copy of both stages. Each epoch shows a progress bar, and the loss of
every batch is plotted to a PNG.

Run:  python -m mpidag.run -n 3 examples/pipeline.py [--epochs 5] [--plot pipeline_loss.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from torch import nn, optim

import mpidag.autograd as dist_autograd  # was: import torch.distributed.autograd
import mpidag.rpc as rpc  # was: import torch.distributed.rpc
from mpidag.optim import DistributedOptimizer  # was: from torch.distributed.optim
from mpidag.rpc import RRef  # was: from torch.distributed.rpc import RRef

IN_FEATURES = 16
HIDDEN = 64
OUT_FEATURES = 4
LR = 0.05


# ------------------------------------------------------------------------- stages
class Stage(nn.Module):
    """What both stages share: a forward pass on a micro-batch that arrives as an RRef."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the same initial weights in every run
        self._lock = threading.Lock()
        self.seq = self.build()

    def build(self) -> nn.Sequential:
        raise NotImplementedError

    def forward(self, x_rref: RRef) -> torch.Tensor:
        # Fetch the input from wherever it lives (the driver, or the previous stage).
        x = x_rref.to_here()
        # Micro-batches arrive concurrently on RPC threads; one at a time per stage.
        with self._lock:
            return self.seq(x)

    def parameter_rrefs(self) -> list[RRef]:
        """RRefs of this stage's parameters, for the driver's DistributedOptimizer."""
        return [RRef(p) for p in self.parameters()]

    def get_dist_gradients(self, context_id: int) -> list[torch.Tensor | None]:
        """This stage's gradients in a distributed autograd context, one per parameter."""
        grads = dist_autograd.get_gradients(context_id)
        return [grads.get(p) for p in self.parameters()]


class Stage1(Stage):
    def build(self) -> nn.Sequential:
        return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
                             nn.Linear(HIDDEN, HIDDEN), nn.ReLU())


class Stage2(Stage):
    def build(self) -> nn.Sequential:
        return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                             nn.Linear(HIDDEN, OUT_FEATURES))


class DistPipeline(nn.Module):
    """The driver's handle on the model: two remote stages, fed micro-batch by micro-batch."""

    def __init__(self, micro_batches: int, workers: tuple[str, str]) -> None:
        super().__init__()
        self.micro_batches = micro_batches
        # Distributed part: each stage is built on its worker and kept there.
        self.p1_rref = rpc.remote(workers[0], Stage1, args=(1,))
        self.p2_rref = rpc.remote(workers[1], Stage2, args=(2,))

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        out_futures = []
        for x in xs.chunk(self.micro_batches, dim=0):
            x_rref = RRef(x)
            # Stage 1 runs remotely and keeps its output there: y_rref refers to it.
            y_rref = self.p1_rref.remote().forward(x_rref)
            # Stage 2 fetches y from stage 1 itself; only z comes back to the driver.
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        # All micro-batches are in flight; collect the outputs in order.
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self) -> list[RRef]:
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


# --------------------------------------------------------------------------- data
def make_dataset(batches: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and the targets of a fixed random teacher network, in batches."""
    generator = torch.Generator().manual_seed(0)
    teacher = nn.Sequential(nn.Linear(IN_FEATURES, 32), nn.Tanh(), nn.Linear(32, OUT_FEATURES))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        inputs = torch.randn(batches, batch_size, IN_FEATURES, generator=generator)
        return [(x, teacher(x)) for x in inputs]


# ------------------------------------------------------------------ progress, plot
def writes_to_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` shows on a terminal (and a bar can be redrawn in place).

    ``isatty()`` alone is not enough under ``mpirun``: Open MPI gives every rank a
    pseudo-terminal, even when mpirun's own output goes to a file or a pipe. It copies the
    window size of a real terminal to it, though, so a terminal of 0 columns is a redirect.
    """
    if not stream.isatty():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError):
        return False


class ProgressBar:
    """A one-line text bar: redrawn in place on a terminal, one plain line otherwise."""

    def __init__(self, label: str, total: int, stream: TextIO = sys.stdout,
                 width: int = 24) -> None:
        self.label, self.total, self.stream, self.width = label, total, stream, width
        self.interactive = writes_to_terminal(stream)
        self.text = ""

    def update(self, done: int, loss: float) -> None:
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.text = f"{self.label} [{bar}] {done}/{self.total} loss {loss:.4f}"
        if self.interactive:
            self.stream.write("\r" + self.text)
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(("\r" if self.interactive else "") + self.text + "\n")
        self.stream.flush()


def plot_losses(path: Path, result: TrainingResult, title: str) -> None:
    """Loss of every batch, each epoch's mean and the whole dataset's, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    losses = result.batch_losses
    per_epoch = len(losses[0])
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, per_epoch * len(losses) + 1)
    ax.plot(steps, [v for epoch in losses for v in epoch], lw=1, label="batch loss")
    ax.plot([per_epoch * (e + 1) for e in range(len(losses))],
            [statistics.mean(epoch) for epoch in losses], "o-", label="epoch mean")
    ax.plot([0, len(steps)], [result.loss_before, result.loss_after], "s", color="black",
            label="whole dataset, before and after")
    ax.set_xlabel("batch")
    ax.set_ylabel("MSE loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------- driver
def check_gradients(model: DistPipeline, context_id: int, inputs: torch.Tensor,
                    targets: torch.Tensor) -> float:
    """Distributed gradients of the stages against local autograd on copies of them."""
    worst = 0.0
    local1, local2 = Stage1(1), Stage2(2)
    local1.load_state_dict(model.p1_rref.rpc_sync().state_dict())
    local2.load_state_dict(model.p2_rref.rpc_sync().state_dict())
    loss = nn.functional.mse_loss(local2.seq(local1.seq(inputs)), targets)
    loss.backward()
    for local, rref in ((local1, model.p1_rref), (local2, model.p2_rref)):
        distributed = rref.rpc_sync().get_dist_gradients(context_id)
        for param, got in zip(local.parameters(), distributed, strict=True):
            assert got is not None, "a stage parameter got no distributed gradient"
            torch.testing.assert_close(got, param.grad)
            worst = max(worst, (got - param.grad).abs().max().item())
    return worst


def evaluate(model: DistPipeline, dataset: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of the model on the whole dataset (forward passes only, no context)."""
    with torch.no_grad():
        return statistics.mean(nn.functional.mse_loss(model(inputs), targets).item()
                               for inputs, targets in dataset)


@dataclass
class TrainingResult:
    batch_losses: list[list[float]]  # per epoch, per batch
    loss_before: float  # on the whole dataset
    loss_after: float
    grad_check: float  # largest difference to local autograd, first batch


def run_master(world_size: int, args: argparse.Namespace) -> TrainingResult:
    workers = ("worker1" if world_size > 2 else "worker0", f"worker{world_size - 1}")
    print(f"[driver] stage 1 on {workers[0]}, stage 2 on {workers[1]}; "
          f"{args.micro_batches} micro-batches per batch", flush=True)
    model = DistPipeline(args.micro_batches, workers)
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=LR, momentum=0.9)
    dataset = make_dataset(args.batches, args.batch_size)
    loss_before = evaluate(model, dataset)
    print(f"[driver] loss on the whole dataset before training: {loss_before:.4f}", flush=True)
    losses: list[list[float]] = []
    grad_check = float("nan")
    for epoch in range(1, args.epochs + 1):
        bar = ProgressBar(f"epoch {epoch}/{args.epochs}", len(dataset))
        epoch_losses: list[float] = []
        for inputs, targets in dataset:
            with dist_autograd.context() as context_id:
                # Forward: micro-batches through both stages, in flight at once.
                outputs = model(inputs)
                loss = loss_fn(outputs, targets)
                # Backward: through stage 2, then stage 1, on their workers.
                dist_autograd.backward(context_id, [loss])
                if epoch == 1 and not epoch_losses:
                    grad_check = check_gradients(model, context_id, inputs, targets)
                    print(f"[driver] first batch: distributed gradients match local "
                          f"autograd (largest difference {grad_check:.1e})", flush=True)
                # Step: each stage's worker updates its own parameters.
                opt.step(context_id)
            epoch_losses.append(loss.item())
            bar.update(len(epoch_losses), statistics.mean(epoch_losses))
        bar.close()
        losses.append(epoch_losses)
    loss_after = evaluate(model, dataset)
    print(f"[driver] loss on the whole dataset after training: {loss_after:.4f}", flush=True)
    return TrainingResult(losses, loss_before, loss_after, grad_check)


def summarize(world_size: int, args: argparse.Namespace, result: TrainingResult) -> None:
    """Write the plot, check that the loss went down, print the OK line."""
    plot_losses(args.plot, result, f"pipeline.py: 2 stages, {args.micro_batches} "
                                   f"micro-batches, {world_size} ranks")
    first, last = result.loss_before, result.loss_after
    if not last < first:
        raise SystemExit(f"FAIL pipeline: the loss did not decrease ({first:.4f} -> "
                         f"{last:.4f}); plot in {args.plot}")
    epoch_means = [statistics.mean(epoch) for epoch in result.batch_losses]
    print(f"OK pipeline: world_size={world_size} epochs={args.epochs} loss {first:.4f} -> "
          f"{last:.4f} (the whole dataset, before -> after training) epoch_loss "
          f"{epoch_means[0]:.4f} -> {epoch_means[-1]:.4f} "
          f"grad_check_max_diff={result.grad_check:.1e} plot={args.plot}", flush=True)


def run_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        result = run_master(world_size, args)
        rpc.shutdown()
        summarize(world_size, args, result)
    else:
        rpc.shutdown()  # the other ranks only serve: the driver drives the stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batches", type=int, default=16, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro-batches per batch, in flight at once")
    parser.add_argument("--plot", type=Path, default=Path("pipeline_loss.png"),
                        help="PNG file for the loss plot")
    args = parser.parse_args()
    if min(args.epochs, args.batches, args.micro_batches) < 1 or \
            args.batch_size < args.micro_batches:
        parser.error("need positive --epochs, --batches, --micro-batches and "
                     "--batch-size >= --micro-batches")

    from mpi4py import MPI  # MPI gives each process its rank (torch: mp.spawn)

    rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if world_size < 2:
        raise SystemExit("pipeline needs at least 2 ranks "
                         "(python -m mpidag.run -n 3 examples/pipeline.py)")
    run_worker(rank, world_size, args)


if __name__ == "__main__":
    main()
