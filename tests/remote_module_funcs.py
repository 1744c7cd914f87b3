"""Modules and functions the RemoteModule tests build and call over RPC (importable on every
rank)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """A small model whose parameters depend only on ``seed``; ``scale`` is a keyword
    argument of ``forward``."""

    def __init__(self, seed: int, hidden: int = 5) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.first = nn.Linear(4, hidden)
        self.second = nn.Linear(hidden, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))) * scale


class TwoOutputs(nn.Module):
    """A forward returning a tuple and a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x * self.w, {"sum": (x * self.w).sum()}


class BrokenModule(nn.Module):
    def __init__(self, why: str) -> None:
        super().__init__()
        raise KeyError(f"cannot build: {why}")


def not_a_module(value: int) -> int:
    return value


def state(module_rref) -> dict[str, torch.Tensor]:
    """On the owner: a copy of the module's parameters, by name."""
    return {k: v.detach().clone() for k, v in module_rref.local_value().state_dict().items()}


def training_mode(module_rref) -> bool:
    return module_rref.local_value().training


def module_device(module_rref) -> str:
    return str(next(module_rref.local_value().parameters()).device)


def call_remote_module(remote_module, x: torch.Tensor) -> torch.Tensor:
    """On a third worker: use a RemoteModule that arrived as an argument."""
    return remote_module(x)


def echo(value):
    return value


def init_here_and_call(module_rref, x: torch.Tensor) -> tuple[str, torch.Tensor]:
    """torch's recipe for sending a RemoteModule: the receiver makes its own over the
    module RRef, naming itself as ``remote_device``; forward still runs on the owner."""
    import mpidag.rpc as rpc
    from mpidag.nn import RemoteModule

    remote = RemoteModule.init_from_module_rref(f"{rpc.get_worker_info().name}/cpu",
                                                module_rref)
    return remote.on, remote(x)
