"""Functions the DistributedOptimizer tests call over RPC (importable on every rank)."""

from __future__ import annotations

import threading

import torch

import mpidag.rpc as rpc

_shared_lock = threading.Lock()


def _shared() -> dict[str, torch.Tensor]:
    """This rank's named parameters (per rank: in-process ranks share this module)."""
    from tests.contract.harness import rank_state

    return rank_state("optim_funcs.shared", dict)


def random_tensor(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand((3, 3), generator=gen, requires_grad=True)


def shared_param(name, numel):
    """On the owner: an RRef to this rank's parameter `name` (made on first call)."""
    shared = _shared()
    with _shared_lock:
        if name not in shared:
            shared[name] = torch.zeros(numel, requires_grad=True)
    return rpc.RRef(shared[name])


def shared_value(name):
    return _shared()[name].detach().clone()


def scaled_sum(param_rref, scale):
    """On the owner: a loss whose gradient is `scale` whatever the parameter's value."""
    return (param_rref.local_value() * scale).sum()


def pair_loss(rref_a, rref_b, scale):
    return (rref_a.local_value() * scale).sum() + (rref_b.local_value() * scale).sum()


def make_model(seed):
    """The same model for the same seed, whichever thread builds it: the weights come from a
    private generator (the global one is shared by the threads of a rank: an owner's pool
    thread building a remote model while the main thread builds its local copy interleaved
    their draws, and the two models differed)."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.rand(param.shape, generator=gen) - 0.5)
    return model


def parameter_rrefs(module_rref):
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def model_forward(module_rref, x):
    return module_rref.local_value()(x)


def model_state(module_rref):
    return {k: v.detach().clone() for k, v in module_rref.local_value().state_dict().items()}


def frozen_tensor():
    return torch.ones(3)


def step_times(optimizer_rref):
    return list(optimizer_rref.local_value().step_times)


def set_lock_mode(mode):
    from mpidag import _runtime

    locks = _runtime.current().parameter_locks
    previous, locks.mode = locks.mode, mode
    return previous


class FailingSGD(torch.optim.SGD):
    """SGD whose step fails on the rank named `fail_on` (a constructor argument)."""

    def __init__(self, params, lr, fail_on):
        super().__init__(params, lr=lr)
        self.fail_on = fail_on

    def step(self, closure=None):
        if rpc.get_worker_info().name == self.fail_on:
            raise FloatingPointError(f"step refused on {self.fail_on} on purpose")
        return super().step(closure)


def _gate(name):
    """This rank's record of the gated steps named ``name``: (condition, events)."""
    from tests.contract.harness import rank_state

    gates = rank_state("optim_funcs.gates", dict)
    with _shared_lock:
        if name not in gates:
            gates[name] = (threading.Condition(), [])
        return gates[name]


class GatedSGD(torch.optim.SGD):
    """SGD whose steps record on their owner when they enter and leave, per ``gate``: the
    ``holder``'s step, once entered, waits (holding its parameters' locks) until the other
    step has entered too, at most ``hold`` seconds. What the record shows is the order of
    the two steps, whatever the speed of the machine: with disjoint locks the other step
    enters while the holder waits; with one lock it enters only after the holder left."""

    def __init__(self, params, lr, gate, holder, hold):
        super().__init__(params, lr=lr)
        self.gate, self.holder, self.hold = gate, holder, hold

    def step(self, closure=None):
        cond, events = _gate(self.gate)
        with cond:
            events.append(("enter", self.holder))
            cond.notify_all()
            if self.holder:
                cond.wait_for(lambda: ("enter", False) in events, timeout=self.hold)
        result = super().step(closure)
        with cond:
            events.append(("leave", self.holder))
            cond.notify_all()
        return result


def wait_entered(gate, holder, limit):
    """On the owner: wait until the ``holder`` (or other) step of ``gate`` has entered."""
    cond, events = _gate(gate)
    with cond:
        return cond.wait_for(lambda: ("enter", holder) in events, timeout=limit)


def gate_events(gate):
    cond, events = _gate(gate)
    with cond:
        return list(events)


def local_optimizer_keys():
    """The keys of the local optimizers alive on this rank (DistributedOptimizer's owners)."""
    from mpidag.optim import optimizer

    return sorted(optimizer._local_optimizers.keys())
