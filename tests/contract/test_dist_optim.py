"""DistributedOptimizer across 2 and 3 ranks: results equal local training; locks per parameter.

Contract tests: each runs in-process and under MPI (tests/contract/harness.py).
"""

from __future__ import annotations

import threading

import pytest
import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag import testing
from mpidag.optim import DistributedOptimizer
from tests import optim_funcs as of
from tests.autograd_funcs import in_threads
from tests.contract.harness import bound, python_encodes

close = torch.testing.assert_close


def test_design_document_end_to_end_example(world):
    dst = world.next
    with dist_autograd.context() as context_id:
        rref1 = rpc.remote(dst, of.random_tensor, args=(world.rank,))
        rref2 = rpc.remote(dst, of.random_tensor, args=(world.rank + 50,))
        loss = rref1.to_here() + rref2.to_here()
        dist_autograd.backward(context_id, [loss.sum()])
        dist_optim = DistributedOptimizer(torch.optim.SGD, [rref1, rref2], lr=0.05)
        dist_optim.step(context_id)
    before = (of.random_tensor(world.rank), of.random_tensor(world.rank + 50))
    close(rref1.to_here(), before[0].detach() - 0.05)
    close(rref2.to_here(), before[1].detach() - 0.05)
    del rref1, rref2, dist_optim


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_training_equals_local_training(world, optimizer):
    """A model on the next rank plus a local weight, trained N steps, with param groups."""
    owner = world.next
    seed = 7 + world.rank
    module = rpc.remote(owner, of.make_model, args=(seed,))
    remote_params = rpc.rpc_sync(owner, of.parameter_rrefs, args=(module,))
    scale = torch.ones(2, requires_grad=True)  # a parameter on this rank
    local_model = of.make_model(seed)
    local_scale = torch.ones(2, requires_grad=True)
    if optimizer == "adam":
        cls, kwargs = torch.optim.Adam, {"lr": 0.01}
    else:
        cls, kwargs = torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}
    groups = [{"params": remote_params[:2]}, {"params": remote_params[2:], "lr": 0.02},
              {"params": [rpc.RRef(scale)]}]
    dist_optim = DistributedOptimizer(cls, groups, **kwargs)
    local_params = list(local_model.parameters())
    local_optim = cls([{"params": local_params[:2]},
                       {"params": local_params[2:], "lr": 0.02},
                       {"params": [local_scale]}], **kwargs)
    gen = torch.Generator().manual_seed(world.rank)
    for _ in range(5):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        with dist_autograd.context() as context_id:
            out = rpc.rpc_sync(owner, of.model_forward, args=(module, x))
            loss = ((out * scale - y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            dist_optim.step(context_id)
        local_optim.zero_grad()
        ((local_model(x) * local_scale - y) ** 2).mean().backward()
        local_optim.step()
    state = rpc.rpc_sync(owner, of.model_state, args=(module,))
    for name, value in local_model.state_dict().items():
        close(state[name], value, rtol=1e-5, atol=1e-6)
    close(scale, local_scale)
    del module, remote_params, groups, dist_optim


def test_no_update_is_lost_when_everyone_steps_one_parameter(world):
    """Every rank, with 2 threads each, steps the same parameter on worker0 concurrently."""
    steps, threads, numel = 20, 2, 1000
    param = rpc.rpc_sync("worker0", of.shared_param, args=("counter", numel))

    def trainer(index: int) -> None:
        opt = DistributedOptimizer(torch.optim.SGD, [param], lr=1.0)
        scale = torch.full((numel,), float(world.rank * threads + index + 1))
        for _ in range(steps):
            with dist_autograd.context() as context_id:
                loss = rpc.rpc_sync("worker0", of.scaled_sum, args=(param, scale))
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)

    in_threads(trainer, threads)
    testing.quiesce()  # every rank finished its steps
    n = world.size * threads
    expected = -float(steps * n * (n + 1) // 2)  # each step subtracts its scale exactly
    value = rpc.rpc_sync("worker0", of.shared_value, args=("counter",))
    close(value, torch.full((numel,), expected))
    testing.quiesce()
    param = None  # noqa: F841 - drop the RRef before the module's leak check


def _gated_steps(world, gate: str, names: tuple[str, str], hold: float) -> list[tuple]:
    """Two optimizer steps on ``world.next``: the holder's over parameter ``names[0]``
    first; once it is inside its step (holding its locks, see ``GatedSGD``), the other's
    over ``names[1]``. Returns the owner's record of their entering and leaving."""
    owner = world.next
    rrefs = {n: rpc.rpc_sync(owner, of.shared_param, args=(n, 64)) for n in set(names)}
    opts = [DistributedOptimizer(of.GatedSGD, [rrefs[name]], lr=0.1, gate=gate,
                                 holder=holder, hold=hold)
            for name, holder in zip(names, (True, False), strict=True)]

    def step(opt: DistributedOptimizer, name: str) -> None:
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(owner, of.scaled_sum, args=(rrefs[name], torch.ones(64)))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)

    holder = threading.Thread(target=bound(step), args=(opts[0], names[0]))
    holder.start()
    try:
        assert rpc.rpc_sync(owner, of.wait_entered, args=(gate, True, 60.0))
        step(opts[1], names[1])
    finally:
        holder.join()
    return rpc.rpc_sync(owner, of.gate_events, args=(gate,))


#: the record of two steps that did not overlap: the holder left before the other entered
ONE_AFTER_THE_OTHER = [("enter", True), ("leave", True), ("enter", False), ("leave", False)]


def test_disjoint_parameters_step_in_parallel_shared_ones_do_not(world):
    """Orderings, not a stopwatch: over disjoint parameters the other step enters while the
    holder waits inside its own (the holder would wait its full 60 s otherwise, and the
    record would show it); over the same parameter it enters only after the holder left
    (the holder waits 0.5 s for it: a slow machine can only make it enter later)."""
    tag = f"r{world.rank}"
    events = _gated_steps(world, f"{tag}-disjoint", (f"{tag}a", f"{tag}b"), hold=60.0)
    assert events.index(("enter", False)) < events.index(("leave", True)), events
    events = _gated_steps(world, f"{tag}-shared", (f"{tag}c", f"{tag}c"), hold=0.5)
    assert events == ONE_AFTER_THE_OTHER, events
    testing.quiesce()


def test_global_lock_mode_serializes_everything(world):
    owner = world.next
    previous = rpc.rpc_sync(owner, of.set_lock_mode, args=("global",))
    try:
        tag = f"g{world.rank}"
        events = _gated_steps(world, f"{tag}-global", (f"{tag}a", f"{tag}b"), hold=0.5)
        assert events == ONE_AFTER_THE_OTHER, events
    finally:
        testing.quiesce()
        rpc.rpc_sync(owner, of.set_lock_mode, args=(previous,))
        testing.quiesce()


def test_crossing_parameter_sets_do_not_deadlock(world):
    owner = world.next
    tag = f"x{world.rank}"
    p1 = rpc.rpc_sync(owner, of.shared_param, args=(f"{tag}1", 64))
    p2 = rpc.rpc_sync(owner, of.shared_param, args=(f"{tag}2", 64))
    steps = 10 if world.inproc else 30  # in-process, every rank's steps share these cores
    errors: list[BaseException] = []

    def run(order: list) -> None:
        try:
            opt = DistributedOptimizer(torch.optim.SGD, order, lr=1.0)
            for _ in range(steps):
                with dist_autograd.context() as context_id:
                    loss = rpc.rpc_sync(owner, of.pair_loss, args=(order[0], order[1],
                                                                  torch.ones(64)))
                    dist_autograd.backward(context_id, [loss])
                    opt.step(context_id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=bound(run), args=(o,)) for o in ([p1, p2], [p2, p1])]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "steps deadlocked"
    assert not errors, errors
    for name in (f"{tag}1", f"{tag}2"):
        close(rpc.rpc_sync(owner, of.shared_value, args=(name,)), torch.full((64,), -2.0 * steps))
    testing.quiesce()


def test_parameter_without_gradient_is_skipped(world):
    owner = world.next
    a = rpc.remote(owner, of.random_tensor, args=(1,))
    b = rpc.remote(owner, of.random_tensor, args=(2,))
    before_b = b.to_here()
    opt = DistributedOptimizer(torch.optim.SGD, [a, b], lr=0.5)
    with dist_autograd.context() as context_id:
        before_a = a.to_here()
        dist_autograd.backward(context_id, [before_a.sum()])
        opt.step(context_id)
    close(a.to_here(), before_a.detach() - 0.5)
    close(b.to_here(), before_b)  # no gradient in the context: unchanged
    del a, b, opt


def test_a_step_is_a_plain_call_that_names_the_local_optimizer_by_its_key(world,
                                                                          monkeypatch):
    """step() sends each owner two integers (the local optimizer's key and the context), so
    the compiled path carries it where built (no Python encode, no RRef pickled and no fork
    message back); the parameters move as the local optimizer moves them; the owner's
    local optimizer goes with its DistributedOptimizer, and a step on a key it no longer
    has is a clear error."""
    from mpidag._runtime import current
    from mpidag.optim import optimizer as optimizer_module

    there = rpc.remote(world.next, of.random_tensor, args=(4,))
    start = there.to_here()
    opt = DistributedOptimizer(torch.optim.SGD, [there], lr=0.5)
    encoded: list[str] = []
    for step in range(3):  # (the first call of a function makes its reference: Python)
        if step == 1:
            encoded = python_encodes(monkeypatch)
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [(there.to_here() * 2).sum()])
            opt.step(context_id)
    close(there.to_here(), start - 3 * 0.5 * 2)
    if current().agent.core is not None:
        assert "_local_step" not in encoded, encoded
    (key,) = opt._local_keys
    assert type(key) is int
    testing.quiesce()  # every rank's logged steps are done
    monkeypatch.undo()
    owner_keys = rpc.rpc_sync(world.next, of.local_optimizer_keys)
    assert key in owner_keys
    del opt
    testing.settle()  # every rank's optimizer is gone, and the owners freed theirs
    assert key not in rpc.rpc_sync(world.next, of.local_optimizer_keys)
    with pytest.raises(RuntimeError, match="no longer exists on") as info:
        rpc.rpc_sync(world.next, optimizer_module._local_step, args=(key, 0))
    assert "make a new DistributedOptimizer" in str(info.value)
    del there


def test_bad_arguments_are_clear_errors(world):
    with pytest.raises(ValueError, match="empty params_rref"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
    with pytest.raises(TypeError, match="not an RRef"):
        DistributedOptimizer(torch.optim.SGD, [torch.ones(2, requires_grad=True)], lr=0.1)
    with pytest.raises(TypeError, match="Optimizer subclass"):
        DistributedOptimizer(dict, [rpc.RRef(torch.ones(2, requires_grad=True))])
    opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(torch.ones(1, requires_grad=True))],
                               lr=0.1)
    with pytest.raises(RuntimeError, match="does not exist"):
        opt.step(12345)
    del opt


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.RMSprop, torch.optim.Rprop,
                                       torch.optim.Adadelta])
def test_parameters_that_do_not_require_grad_are_accepted_and_never_updated(world,
                                                                              optimizer):
    """torch's test_dist_optim_none_grads: such a parameter never gets a gradient, so it
    is skipped by every step, while the others are updated as by the local optimizer."""
    frozen = rpc.remote(world.next, of.frozen_tensor)
    here = torch.full((3,), 2.0, requires_grad=True)
    local = here.detach().clone().requires_grad_()
    opt = DistributedOptimizer(optimizer, [rpc.RRef(here), frozen], lr=0.05)
    reference = optimizer([local, torch.ones(3)], lr=0.05)
    for _ in range(2):
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [(here * frozen.to_here()).sum()])
            opt.step(context_id)
        (local * torch.ones(3)).sum().backward()
        reference.step()
        local.grad = None
    torch.testing.assert_close(here.detach(), local.detach())
    assert not torch.equal(here.detach(), torch.full((3,), 2.0))
    torch.testing.assert_close(frozen.to_here(), torch.ones(3))
    del frozen, opt


def test_failing_step_names_what_was_applied(world):
    here = torch.zeros(3, requires_grad=True)
    there = rpc.remote(world.next, of.random_tensor, args=(3,))
    start = there.to_here()
    opt = DistributedOptimizer(of.FailingSGD, [rpc.RRef(here), there], lr=1.0,
                               fail_on=world.name)
    with dist_autograd.context() as context_id:
        loss = here.sum() + there.to_here().sum()
        dist_autograd.backward(context_id, [loss])
        with pytest.raises(FloatingPointError, match="on purpose") as info:
            opt.step(context_id)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"could not step on {world.name}" in notes and world.next in notes
    close(here, torch.zeros(3))  # refused here
    close(there.to_here(), start - 1.0)  # applied there, and the error said so
    del there, opt, info
