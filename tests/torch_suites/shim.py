"""Point torch's public RPC names at mpidag's, as a user porting a program does by imports.

torch's suites import ``torch.distributed.rpc``, ``torch.distributed.autograd``,
``torch.distributed.optim.DistributedOptimizer`` and ``torch.distributed.nn.RemoteModule``
(and a few of their submodules). :func:`install` puts a proxy module in ``sys.modules`` and
on the parent package for each: an attribute is looked up in mpidag's module first; only a
name mpidag does not have falls back to torch's own object, and every such fallback is
recorded (:func:`torch_internals_used`), so a test that passes by touching torch's own
machinery is visible in the report instead of counting silently as a pass for mpidag.

Example::

    from tests.torch_suites import shim
    shim.install()
    import torch.distributed.rpc as rpc       # mpidag.rpc behind torch's name
    assert rpc.rpc_sync is mpidag.rpc.rpc_sync
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: torch module -> mpidag module whose names come first
MODULES: dict[str, str] = {
    "torch.distributed.rpc": "mpidag.rpc",
    "torch.distributed.rpc.api": "mpidag.rpc.api",
    "torch.distributed.rpc.functions": "mpidag.rpc.functions",
    "torch.distributed.rpc.backend_registry": "mpidag.rpc.backend_registry",
    "torch.distributed.rpc.constants": "mpidag.rpc.constants",
    "torch.distributed.autograd": "mpidag.autograd",
    "torch.distributed.nn.api.remote_module": "mpidag.nn.api.remote_module",
}

#: torch modules that keep their own names except these, taken from mpidag
OVERRIDES: dict[str, dict[str, tuple[str, str]]] = {
    "torch.distributed.optim": {"DistributedOptimizer": ("mpidag.optim", "DistributedOptimizer")},
    "torch.distributed.nn": {"RemoteModule": ("mpidag.nn", "RemoteModule")},
}

_used: set[str] = set()


class ProxyModule(types.ModuleType):
    """A torch module name whose attributes come from mpidag first, then from torch."""

    def __init__(self, name: str, mpidag_module: types.ModuleType | None,
                 torch_module: types.ModuleType, record: bool) -> None:
        super().__init__(name, torch_module.__doc__)
        self.__dict__["_mpidag_module"] = mpidag_module
        self.__dict__["_torch_module"] = torch_module
        self.__dict__["_record"] = record
        self.__dict__["__file__"] = getattr(torch_module, "__file__", None)
        self.__dict__["__path__"] = getattr(torch_module, "__path__", [])

    def __setattr__(self, attr: str, value: Any) -> None:
        """A name mpidag has is set on mpidag's module (torch's tests switch
        ``api._ignore_rref_leak`` this way); any other stays on the proxy."""
        mpidag_module = self.__dict__["_mpidag_module"]
        if mpidag_module is not None and hasattr(mpidag_module, attr):
            setattr(mpidag_module, attr, value)
        else:
            self.__dict__[attr] = value

    def __getattr__(self, attr: str) -> Any:
        mpidag_module = self.__dict__["_mpidag_module"]
        if mpidag_module is not None and hasattr(mpidag_module, attr):
            return getattr(mpidag_module, attr)
        value = getattr(self.__dict__["_torch_module"], attr)
        if self.__dict__["_record"] and not attr.startswith("__"):
            _used.add(f"{self.__name__}.{attr}")
        return value


def _import_optional(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None
        raise


def install() -> None:
    """Replace torch's RPC modules by proxies onto mpidag's (idempotent).

    Example::

        install(); import torch.distributed.autograd as a; a.context  # mpidag's
    """
    import torch.distributed.autograd  # noqa: F401  (torch's own, fully initialized first)
    import torch.distributed.nn  # noqa: F401
    import torch.distributed.nn.api.remote_module  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.distributed.rpc  # noqa: F401
    import torch.distributed.rpc.api  # noqa: F401
    import torch.distributed.rpc.backend_registry  # noqa: F401
    import torch.distributed.rpc.constants  # noqa: F401
    import torch.distributed.rpc.functions  # noqa: F401

    if isinstance(sys.modules["torch.distributed.rpc"], ProxyModule):
        return
    proxies: dict[str, ProxyModule] = {}
    for torch_name, mpidag_name in MODULES.items():
        proxies[torch_name] = ProxyModule(torch_name, _import_optional(mpidag_name),
                                          sys.modules[torch_name], record=True)
    for torch_name, names in OVERRIDES.items():
        proxy = ProxyModule(torch_name, None, sys.modules[torch_name], record=False)
        for attr, (module, name) in names.items():
            proxy.__dict__[attr] = getattr(importlib.import_module(module), name)
        proxies[torch_name] = proxy
    for torch_name, proxy in proxies.items():
        sys.modules[torch_name] = proxy
        parent_name, _, child = torch_name.rpartition(".")
        parent = proxies.get(parent_name)
        if parent is not None:
            parent.__dict__[child] = proxy
        else:
            setattr(sys.modules[parent_name], child, proxy)


def reset_torch_internals_used() -> None:
    """Forget the torch internals recorded so far (called before each test)."""
    _used.clear()


def torch_internals_used() -> list[str]:
    """The torch names the code looked up because mpidag has no such name, sorted."""
    return sorted(_used)
