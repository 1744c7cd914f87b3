"""A parameter server trained by several trainers with distributed autograd, on MPI.

The shape of PyTorch's tutorial "Implementing a Parameter Server Using Distributed RPC
Framework": rank 0 is the parameter server and holds the model; every other rank is a
trainer that runs its forward pass through the server's parameters over RPC inside a
``dist_autograd.context()``, runs ``dist_autograd.backward`` and steps a
``DistributedOptimizer`` over RRefs of the server's parameters. The trainers run at the
same time and update the same parameters without waiting for each other (asynchronous SGD).

The model is a bag-of-words text classifier: the mean of the token embeddings of a
sequence, then a linear layer. The data is synthetic: each of the 4 classes has its own
keyword tokens, and a sequence mixes keywords of its class with noise tokens.

What travels, per training step of a trainer::

    trainer                                       parameter server (rank 0)
    ids ----------- lookup(ids) ----------------> rows = embedding(ids)       (sparse part)
    rows <--------------------------------------- (a send function records the way back)
        <---------- dense_parameters() ---------- fc.weight, fc.bias         (pulled)
    loss = cross_entropy(linear(rows.mean(1), weight, bias), labels)
    dist_autograd.backward -- gradients ------> embedding.weight, fc.weight, fc.bias
    opt.step(context_id) ----------------------> SGD step on the server's parameters

Unlike the tutorial, the server does not run the whole model: an ``nn.Linear`` whose input
requires grad saves its weight for the backward pass, and a step of another trainer between
this trainer's forward and backward changes that weight in place, which autograd rejects
("one of the variables needed for gradient computation has been modified by an inplace
operation"). An embedding lookup saves only the indices, and pulled weights are copies on
the trainer, so concurrent steps never invalidate a trainer's graph.

On its first step every trainer checks the distributed gradients (read on the server with
``dist_autograd.get_gradients``) against plain local autograd of the same computation. At
the end the server measures the loss on the trainers' data (made again from their seeds)
and on held-out data, before and after training; the run fails unless the first went down.

Run:  python -m mpidag.run -n 3 examples/parameter_server.py [--steps 40] [--batch 32]

Surviving a lost rank (``--ft``, see docs/fault_tolerance.md): with ``--fail-rank R
--fail-step K`` rank R kills itself (SIGKILL) at its K-th step (a trainer) or K-th lookup
served (the server, rank 0)::

    python -m mpidag.run --ft -n 4 examples/parameter_server.py --fail-rank 2 --fail-step 5

A lost trainer: the server says so and the other trainers train on; the run checks the loss
over the trainers that finished. A lost server: every trainer stops with a message naming it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own convention
from torch import nn, optim

import mpidag.autograd as dist_autograd  # was: import torch.distributed.autograd
import mpidag.rpc as rpc  # was: import torch.distributed.rpc
from mpidag.optim import DistributedOptimizer  # was: from torch.distributed.optim

VOCAB = 64  # token ids 0..63
NUM_CLASSES = 4
KEYWORDS_PER_CLASS = 8  # class c owns the tokens [8c, 8c + 8); tokens 32..63 are noise
SEQ_LEN = 12
EMBED_DIM = 16
LR = 1.0
#: (rank, step) at which that rank kills itself (--fail-rank/--fail-step), or None
FAIL_AT: tuple[int, int] | None = None


def maybe_fail(rank: int, step: int) -> None:
    """The fault-tolerance demonstration: die as a lost node would (SIGKILL, no goodbye)."""
    if (rank, step) == FAIL_AT:
        print(f"[rank {rank}] killing myself at step {step} (--fail-rank/--fail-step)",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- data
def make_batch(generator: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic sequences: each token is a keyword of the label's class with p=0.4."""
    labels = torch.randint(NUM_CLASSES, (batch,), generator=generator)
    keywords = labels[:, None] * KEYWORDS_PER_CLASS + torch.randint(
        KEYWORDS_PER_CLASS, (batch, SEQ_LEN), generator=generator)
    first_noise = NUM_CLASSES * KEYWORDS_PER_CLASS
    noise = torch.randint(first_noise, VOCAB, (batch, SEQ_LEN), generator=generator)
    is_keyword = torch.rand((batch, SEQ_LEN), generator=generator) < 0.4
    return torch.where(is_keyword, keywords, noise), labels


def trainer_batches(rank: int, steps: int, batch: int) -> Iterator[tuple[torch.Tensor,
                                                                          torch.Tensor]]:
    """The batches that trainer ``rank`` trains on, the same in every run.

    The server makes them again to measure the loss on the training data before and after.
    """
    generator = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        yield make_batch(generator, batch)


def held_out_set() -> tuple[torch.Tensor, torch.Tensor]:
    """1,024 sequences no trainer sees, the same in every run."""
    return make_batch(torch.Generator().manual_seed(7), 1024)


# -------------------------------------------------------------------------- model
def classify(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The dense part of the model: mean of the embedded tokens, then a linear layer."""
    return F.linear(rows.mean(dim=1), weight, bias)


class BagOfWords(nn.Module):
    """The whole model, as it lives on the parameter server."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, EMBED_DIM)
        self.fc = nn.Linear(EMBED_DIM, NUM_CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return classify(self.embedding(ids), self.fc.weight, self.fc.bias)


class ParameterServer(nn.Module):
    """Holds the model on rank 0; the trainers call its methods through an RRef."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial model in every run
        self.model = BagOfWords()
        self.reports: dict[str, list[float]] = {}
        self.grad_checks: dict[str, float] = {}
        self.lock = threading.Lock()
        self.lookups = 0

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids``; runs here, in the caller's autograd context."""
        with self.lock:
            self.lookups += 1
            served = self.lookups
        maybe_fail(0, served)
        return self.model.embedding(ids)

    def dense_parameters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear layer's weights, as tensors whose gradients flow back to them here.

        Views, not the ``nn.Parameter`` objects: torch's RPC pickles a Parameter as a new,
        detached Parameter, whose gradient would stay on the trainer.
        """
        fc = self.model.fc
        return fc.weight.view_as(fc.weight), fc.bias.view_as(fc.bias)

    def get_param_rrefs(self) -> list[rpc.RRef]:
        """RRefs of every parameter, for the trainers' DistributedOptimizer."""
        return [rpc.RRef(param) for param in self.model.parameters()]

    def get_dist_gradients(self, context_id: int) -> list[torch.Tensor | None]:
        """This rank's gradients in the context, one per parameter (None: not reached)."""
        grads = dist_autograd.get_gradients(context_id)
        return [grads.get(param) for param in self.model.parameters()]

    def report(self, trainer: str, losses: list[float], grad_check: float) -> None:
        with self.lock:
            self.reports[trainer] = losses
            self.grad_checks[trainer] = grad_check

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[float, float]:
        """Mean loss and accuracy of the model on ``batches`` (local, no autograd)."""
        loss = correct = count = 0.0
        for ids, labels in batches:
            logits = self.model(ids)
            loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
            count += len(labels)
        return loss / count, correct / count


param_server: ParameterServer | None = None
global_lock = threading.Lock()


def get_parameter_server() -> ParameterServer:
    """The one ParameterServer of this process (every trainer's rpc.remote gets it)."""
    global param_server
    with global_lock:
        if param_server is None:
            param_server = ParameterServer()
        return param_server


# ------------------------------------------------- calling methods through RRefs
def call_method(method: Callable[..., Any], rref: rpc.RRef, *args: Any, **kwargs: Any) -> Any:
    """Runs on the owner of ``rref``: ``method(value, *args, **kwargs)``."""
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method: Callable[..., Any], rref: rpc.RRef, *args: Any,
                  **kwargs: Any) -> Any:
    """Call ``method`` on the value of ``rref`` where it lives, and wait for the result."""
    return rpc.rpc_sync(rref.owner(), call_method, args=(method, rref, *args), kwargs=kwargs)


# ------------------------------------------------------------------------ trainer
class TrainerNet:
    """The trainer's view of the model: every parameter lives on the parameter server."""

    def __init__(self) -> None:
        # Distributed part: an RRef to the server's ParameterServer.
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)

    def get_global_param_rrefs(self) -> list[rpc.RRef]:
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def pull(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embedding rows (looked up on the server) and the dense weights (pulled)."""
        rows = remote_method(ParameterServer.lookup, self.param_server_rref, ids)
        weight, bias = remote_method(ParameterServer.dense_parameters, self.param_server_rref)
        return rows, weight, bias


def check_gradients(net: TrainerNet, context_id: int, ids: torch.Tensor,
                    labels: torch.Tensor, pulled: tuple[torch.Tensor, ...]) -> float:
    """Compare the server's distributed gradients with local autograd; the largest diff.

    The local computation starts from copies of exactly the values this trainer received
    (other trainers may have stepped the server's parameters since), so it is exact. The
    gradient of the embedding table is that of the looked-up rows added into their rows.
    """
    local = [t.detach().clone().requires_grad_() for t in pulled]
    loss = F.cross_entropy(classify(*local), labels)
    g_rows, g_weight, g_bias = torch.autograd.grad(loss, local)
    g_table = torch.zeros(VOCAB, EMBED_DIM).index_add_(
        0, ids.flatten(), g_rows.reshape(-1, EMBED_DIM))
    expected = [g_table, g_weight, g_bias]
    distributed = remote_method(ParameterServer.get_dist_gradients, net.param_server_rref,
                                context_id)
    worst = 0.0
    for got, want in zip(distributed, expected, strict=True):
        assert got is not None, "a server parameter got no distributed gradient"
        torch.testing.assert_close(got, want)
        worst = max(worst, (got - want).abs().max().item())
    return worst


def run_training_loop(rank: int, steps: int, batch: int) -> None:
    name = rpc.get_worker_info().name
    net = TrainerNet()
    param_rrefs = net.get_global_param_rrefs()
    # One local SGD per owner, here only the parameter server; stepped over RPC.
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=LR)
    losses: list[float] = []
    grad_check = float("nan")
    every = max(1, steps // 4)
    for step, (ids, labels) in enumerate(trainer_batches(rank, steps, batch)):
        maybe_fail(rank, step + 1)
        with dist_autograd.context() as context_id:
            # Forward pass: two RPCs to the server, recorded in this context.
            rows, weight, bias = net.pull(ids)
            loss = F.cross_entropy(classify(rows, weight, bias), labels)
            # Backward pass: gradients flow back to the server's parameters.
            dist_autograd.backward(context_id, [loss])
            if step == 0:
                grad_check = check_gradients(net, context_id, ids, labels,
                                             (rows, weight, bias))
                print(f"[{name}] step 1: distributed gradients match local autograd "
                      f"(largest difference {grad_check:.1e})", flush=True)
            # Optimizer step on the server, with the gradients of this context.
            opt.step(context_id)
        losses.append(loss.item())
        if step == 0 or (step + 1) % every == 0 or step + 1 == steps:
            print(f"[{name}] step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
    remote_method(ParameterServer.report, net.param_server_rref, name, losses, grad_check)
    print(f"[{name}] training complete", flush=True)


# ------------------------------------------------------------------------- driver
def evaluation_sets(world_size: int, steps: int, batch: int) -> dict[str, Callable[[], Any]]:
    """The trainers' data (remade from their seeds) and the held-out sequences."""
    return {
        "train": lambda: (b for rank in range(1, world_size)
                          for b in trainer_batches(rank, steps, batch)),
        "held_out": lambda: [held_out_set()],
    }


def wait_for_trainers(server: ParameterServer, trainers: int) -> list[str]:
    """On the server: wait until every trainer reported or was lost; the lost ones.

    In an ``--ft`` job a trainer may die; the server says so when it learns of it and the
    other trainers go on (they only talk to the server)."""
    lost: list[str] = []
    while True:
        failed = [w.name for w in rpc.failed_workers()]
        for name in failed:
            if name not in lost:
                lost.append(name)
                print(f"[parameter_server] {name} was lost (its rank failed); training goes "
                      f"on with {trainers - len(lost)} trainer(s)", flush=True)
        with server.lock:
            done = len(server.reports)
        if done + len(lost) >= trainers:
            return lost
        time.sleep(0.05)


def summarize(server: ParameterServer, world_size: int, steps: int, batch: int,
              before: dict[str, tuple[float, float]], lost: list[str]) -> None:
    """On rank 0 after shutdown: check that the loss went down, print the OK line.

    The check is on the trainers' own data, before and after training: every step lowers
    the loss of its batch, so it holds for runs of any length (on held-out data, one step
    of a small batch can as well raise the loss as lower it).
    """
    trainers = world_size - 1 - len(lost)
    if len(server.reports) != trainers or trainers < 1:
        raise SystemExit(f"FAIL parameter_server: {len(server.reports)} of {trainers} trainers "
                         f"reported")
    after = {name: server.evaluate(make())
             for name, make in evaluation_sets(world_size, steps, batch).items()}
    first_step = sum(losses[0] for losses in server.reports.values()) / trainers
    last_step = sum(losses[-1] for losses in server.reports.values()) / trainers
    worst = max(server.grad_checks.values())
    for name, label in (("train", "the trainers' data"), ("held_out", "held-out data")):
        print(f"[parameter_server] {label}: loss {before[name][0]:.4f} -> {after[name][0]:.4f}"
              f", accuracy {before[name][1]:.2f} -> {after[name][1]:.2f}", flush=True)
    loss_before, loss_after = before["train"][0], after["train"][0]
    if not loss_after < loss_before:
        raise SystemExit(f"FAIL parameter_server: the loss on the trainers' data did not "
                         f"decrease: {loss_before:.4f} -> {loss_after:.4f}")
    if lost:
        print(f"[parameter_server] lost during training: {', '.join(lost)}; the loss is "
              f"measured on every trainer's data", flush=True)
    print(f"OK parameter_server: world_size={world_size} trainers={trainers} steps={steps} "
          f"batch={batch} loss {loss_before:.4f} -> {loss_after:.4f} (on the trainers' data, "
          f"before -> after training) step_loss {first_step:.4f} -> {last_step:.4f} "
          f"held_out_loss {before['held_out'][0]:.4f} -> {after['held_out'][0]:.4f} "
          f"held_out_acc={after['held_out'][1]:.2f} grad_check_max_diff={worst:.1e}",
          flush=True)


def run_worker(rank: int, world_size: int, steps: int, batch: int) -> None:
    if rank == 0:
        server = get_parameter_server()
        before = {name: server.evaluate(make())
                  for name, make in evaluation_sets(world_size, steps, batch).items()}
        rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size)
        print(f"[parameter_server] serving {world_size - 1} trainer(s)", flush=True)
        lost = wait_for_trainers(server, world_size - 1)
        rpc.shutdown()  # returns when every trainer is done and has shut down
        summarize(server, world_size, steps, batch, before, lost)
    else:
        rpc.init_rpc(name=f"trainer_{rank}", rank=rank, world_size=world_size)
        try:
            run_training_loop(rank, steps, batch)
        except rpc.WorkerFailedError as exc:
            if exc.worker_name != "parameter_server":
                raise
            print(f"[trainer_{rank}] the parameter server failed ({exc}); stopping: the "
                  f"model was on it", flush=True)
            rpc.shutdown()
            sys.exit(1)  # (sys.exit: its status survives an --ft job's lost workers)
        rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per trainer")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--fail-rank", type=int, default=None,
                        help="fault-tolerance demo (run with --ft): this rank kills itself")
    parser.add_argument("--fail-step", type=int, default=3,
                        help="...at this step of its own (the server: its n-th lookup)")
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1:
        parser.error("--steps and --batch must be positive")
    global FAIL_AT
    if args.fail_rank is not None:
        FAIL_AT = (args.fail_rank, args.fail_step)

    from mpi4py import MPI  # MPI gives each process its rank (torch: mp.spawn)

    rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if world_size < 2:
        raise SystemExit("parameter_server needs at least 2 ranks: 1 server + trainers "
                         "(python -m mpidag.run -n 3 examples/parameter_server.py)")
    run_worker(rank, world_size, args.steps, args.batch)


if __name__ == "__main__":
    main()
