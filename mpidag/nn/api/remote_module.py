"""``RemoteModule``: an ``nn.Module`` built and run on another worker (torch:
``torch.distributed.nn.api.remote_module.RemoteModule``).

Data flow of ``RemoteModule("worker1/cpu", nn.Linear, args=(4, 2))`` and ``forward(x)``::

    caller:  parse "worker1/cpu" -> rpc_sync(worker1, _create_module) -> RRef of the module
    worker1: module_cls(*args, **kwargs).to(device), kept by its owner RRef
    forward: rpc_async(worker1, _remote_forward, (module_rref, device, ..., *args))
             -> module.forward(*args) on worker1; inside a distributed autograd context the
             call records send/recv functions, so gradients reach the module's parameters
             (``remote_parameters()`` gives RRefs to them, for ``DistributedOptimizer``).

Unlike torch, the module is built with ``rpc_sync`` (torch uses ``remote``): a module that
fails to build raises its error, with its type, from the constructor on the calling rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import mpidag.rpc as rpc
from mpidag import _runtime
from mpidag.transport import frames

__all__ = ["RemoteModule", "parse_remote_device"]

_FORMAT = "'<workername>/<device>' or 'rank:<rank>/<device>' (e.g. 'worker1/cpu', " \
          "'rank:1/cuda:0'), or '<workername>' for the CPU"


def parse_remote_device(remote_device: str) -> tuple[str | int, torch.device]:
    """``(worker name or rank, device)`` of a remote device string, as torch parses it.

    Raises a ``ValueError`` naming the string and the expected form when it is malformed.

    Example::

        >>> parse_remote_device("worker1/cuda:0")
        ('worker1', device(type='cuda', index=0))
        >>> parse_remote_device("rank:1/cpu")
        (1, device(type='cpu'))
        >>> parse_remote_device("worker1")
        ('worker1', device(type='cpu'))
    """
    if not isinstance(remote_device, str):
        raise TypeError(f"remote_device must be a str such as 'worker1/cpu', got "
                        f"{type(remote_device).__name__}")

    def bad(why: str) -> ValueError:
        return ValueError(f"could not parse remote_device {remote_device!r}: {why}; the valid "
                          f"format is {_FORMAT}")

    fields = remote_device.split("/")
    if len(fields) > 2:
        raise bad("more than one '/'")
    worker, device_text = (fields[0], fields[1]) if len(fields) == 2 else (fields[0], "cpu")
    if not worker:
        raise bad("no worker")
    try:
        device = torch.device(device_text)
    except (RuntimeError, ValueError):
        raise bad(f"{device_text!r} is not a device") from None
    on: str | int = worker
    if ":" in worker:
        kind, _, number = worker.partition(":")
        if kind != "rank" or not number.isdigit():
            raise bad(f"{worker!r} is neither a worker name nor 'rank:<rank>'")
        on = int(number)
    return on, device


# ------------------------------------------------------------------ run on the owner


def _create_module(module_cls: Callable[..., nn.Module], args: tuple, kwargs: dict,
                   device: str) -> rpc.RRef:
    """On the owner: build the module, move it to ``device``, keep it behind an RRef."""
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(f"Expect `module_cls(*args, **kwargs)` returns an instance of <class "
                         f"nn.Module>, but it returns an instance of {type(module)}.")
    return rpc.RRef(module.to(device))


def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> list[rpc.RRef]:
    """On the owner: RRefs to the module's parameters."""
    return [rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _remote_forward(module_rref: rpc.RRef, device: str, is_device_map_set: bool,
                    *args: Any, **kwargs: Any) -> Any:
    """On the owner: run the module's ``forward``. For a CUDA module, tensors in the
    arguments are moved to its device and, without a device map to the caller, the result's
    tensors back to the CPU (as torch does)."""
    module = module_rref.local_value()
    target = torch.device(device)
    if target.type != "cuda":
        return module.forward(*args, **kwargs)
    args = _map_tensors(args, lambda t: t.to(target))
    kwargs = _map_tensors(kwargs, lambda t: t.to(target))
    out = module.forward(*args, **kwargs)
    return out if is_device_map_set else _map_tensors(out, lambda t: t.cpu())


def _rebuild(on: str | int, device: str, is_device_map_set: bool, module_rref: rpc.RRef,
             module_name: str) -> RemoteModule:
    """A RemoteModule that arrived over RPC (its RRef was forked for this worker)."""
    self = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(self)
    self.on, self.device, self.is_device_map_set = on, device, is_device_map_set
    self.module_rref, self._module_name = module_rref, module_name
    return self


def _raise_not_supported(name: str) -> None:
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule")


class RemoteModule(nn.Module):
    """A module created on another worker, called like a local one (torch's
    ``torch.distributed.nn.RemoteModule``).

    Args:
        remote_device: where to build it: ``"worker1/cpu"``, ``"rank:1/cpu"``,
            ``"worker1/cuda:0"``, or ``"worker1"`` (the CPU).
        module_cls: an ``nn.Module`` class (or any callable returning a module), importable
            on the remote worker.
        args: positional arguments of ``module_cls``.
        kwargs: keyword arguments of ``module_cls``.

    ``forward(*args, **kwargs)`` runs the module's forward on its worker and returns the
    result; ``forward_async`` returns a ``torch.futures.Future`` of it. Inside a distributed
    autograd context, gradients flow back to the remote parameters; ``remote_parameters()``
    gives RRefs to them for :class:`~mpidag.optim.DistributedOptimizer`. Methods of
    ``nn.Module`` that would act on local state (``parameters()``, ``to()``, ``cuda()``,
    ``state_dict()``, hooks, ...) raise a ``ValueError``, as in torch; ``train()`` and
    ``eval()`` switch the remote module's mode. Unlike torch, ``repr()`` works, and the
    constructor waits for the module to be built, raising its error with its type.

    A RemoteModule can be passed as an argument or result of an RPC (its RRef travels);
    plain ``pickle`` refuses it, as torch does.

    Raises:
        ValueError: a malformed ``remote_device`` (naming it and the expected form).
        UnknownWorkerError: a worker name or rank that is not in the job (a ``ValueError``).
        the remote error: whatever building the module raised on the remote worker.

    Example::

        >>> from mpidag.nn import RemoteModule
        >>> layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
        >>> layer(torch.ones(3, 4)).shape                 # runs on worker1
        torch.Size([3, 2])
        >>> layer.forward_async(torch.ones(3, 4)).wait().shape
        torch.Size([3, 2])
        >>> with dist_autograd.context() as context_id:
        ...     loss = layer(torch.ones(3, 4)).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     DistributedOptimizer(torch.optim.SGD, layer.remote_parameters(),
        ...                          lr=0.05).step(context_id)
    """

    on: str | int
    device: str
    is_device_map_set: bool
    module_rref: rpc.RRef

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module],
                 args: tuple | None = None, kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        on, device = parse_remote_device(remote_device)
        runtime = _runtime.current()
        rank = runtime.to_rank(on)  # UnknownWorkerError before anything is sent
        self.on = on
        self.device = str(device)
        me = runtime.agent.info.name
        self.is_device_map_set = bool(
            runtime.agent.device_maps.get(me, {}).get(runtime.agent.workers[rank].name))
        if not callable(module_cls):
            raise TypeError(f"module_cls must be an nn.Module class, got {module_cls!r}")
        self._module_name = getattr(module_cls, "__qualname__", repr(module_cls))
        self.module_rref = rpc.rpc_sync(
            rank, _create_module,
            args=(module_cls, tuple(args) if args else (), dict(kwargs) if kwargs else {},
                  self.device))

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: rpc.RRef,
                              _module_interface_cls: Any = None) -> RemoteModule:
        """A RemoteModule over an existing module RRef (several share one module).

        As in torch, ``remote_device`` is recorded (``on``, ``device``) but need not name
        the RRef's owner: torch's recipe for sending a RemoteModule calls this on the
        receiver with its own name. ``forward`` always runs on the module's owner (and the
        device map that applies is the one to the owner).

        Example::

            >>> first = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            >>> same = RemoteModule.init_from_module_rref("worker1/cpu",
            ...                                           first.get_module_rref())
            >>> x = torch.ones(4)
            >>> torch.equal(same(x), first(x))          # one module on worker1
            True
        """
        on, device = parse_remote_device(remote_device)
        runtime = _runtime.current()
        runtime.to_rank(on)  # UnknownWorkerError for a worker that does not exist
        owner = module_rref.owner()
        me = runtime.agent.info.name
        mapped = bool(runtime.agent.device_maps.get(me, {}).get(owner.name))
        return _rebuild(on, str(device), mapped, module_rref, "nn.Module")

    # ------------------------------------------------------------------ calls
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the remote module's ``forward`` and return its result.

        Example::

            >>> layer = RemoteModule("worker1", torch.nn.Linear, args=(4, 2))
            >>> layer.forward(torch.ones(4))       # outside a context: no graph comes back
            tensor([..., ...], requires_grad=True)
        """
        return self.forward_async(*args, **kwargs).wait()

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        """Run the remote module's ``forward``; return a ``torch.futures.Future`` of it.

        Example::

            >>> layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            >>> fut = layer.forward_async(torch.ones(3, 4))
            >>> fut.wait().shape
            torch.Size([3, 2])
        """
        return rpc.rpc_async(self.module_rref.owner(), _remote_forward,
                             args=(self.module_rref, self.device, self.is_device_map_set,
                                   *args), kwargs=kwargs)

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs to the remote module's parameters (with ``recurse``, its submodules' too).

        Example::

            >>> layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            >>> [p.to_here().shape for p in layer.remote_parameters()]
            [torch.Size([2, 4]), torch.Size([2])]
            >>> opt = DistributedOptimizer(torch.optim.SGD, layer.remote_parameters(), lr=0.1)
        """
        return rpc.rpc_sync(self.module_rref.owner(), _param_rrefs,
                            args=(self.module_rref, recurse))

    def get_module_rref(self) -> rpc.RRef:
        """The RRef of the remote module (``rref.to_here()`` copies it here).

        Example::

            >>> layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            >>> layer.get_module_rref().owner_name()
            'worker1'
            >>> layer.get_module_rref().to_here()
            Linear(in_features=4, out_features=2, bias=True)
        """
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set the remote module's training mode (torch returns the remote module's copy;
        this returns ``self``).

        Example::

            >>> layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            >>> layer.eval().training
            False
            >>> layer.train().training
            True
        """
        rpc.rpc_sync(self.module_rref.owner(), _set_training, args=(self.module_rref, mode))
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        """``train(False)``.

        Example::

            >>> layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            >>> layer.eval()
            RemoteModule(on=worker1, device=cpu, module=Linear)
            >>> layer.get_module_rref().to_here().training       # the remote module's mode
            False
        """
        return self.train(False)

    def __repr__(self) -> str:
        """Where the module lives and what it is (torch's ``repr`` raises).

        Example::

            >>> RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            RemoteModule(on=worker1, device=cpu, module=Linear)
        """
        return f"RemoteModule(on={self.on}, device={self.device}, module={self._module_name})"

    def extra_repr(self) -> str:  # noqa: D102 - torch's: not supported
        _raise_not_supported("extra_repr")

    def __reduce__(self) -> tuple:
        # over RPC (the agent's pickler is at work in this thread) the RRef forks for the
        # receiver; any other pickler (pickle.dumps, torch.save) is refused, as by torch
        pickler = getattr(frames._local, "pickler", None)
        if pickler is None or not pickler.busy:
            raise rpc.RPCError(
                "Cannot pickle RemoteModule in python pickler. RemoteModule can only be "
                "pickled when using RPC: pass it as an argument or return value of "
                "rpc_sync, rpc_async or remote")
        return (_rebuild, (self.on, self.device, self.is_device_map_set, self.module_rref,
                           self._module_name))

    # ------------------------------------------------- nn.Module methods torch forbids
    def register_buffer(self, name: str, tensor: torch.Tensor | None,
                        persistent: bool = True) -> None:
        _raise_not_supported("register_buffer")

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        _raise_not_supported("register_parameter")

    def add_module(self, name: str, module: nn.Module | None) -> None:
        _raise_not_supported("add_module")

    def apply(self, fn: Callable[[nn.Module], None]) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("apply")

    def cuda(self, device: Any = None) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("cuda")

    def ipu(self, device: Any = None) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("ipu")

    def xpu(self, device: Any = None) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("xpu")

    def cpu(self) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("cpu")

    def type(self, dst_type: Any) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("type")

    def float(self) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("float")

    def double(self) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("double")

    def half(self) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("half")

    def bfloat16(self) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("bfloat16")

    def to(self, *args: Any, **kwargs: Any) -> RemoteModule:  # type: ignore[override]
        _raise_not_supported("to")

    def register_backward_hook(self, hook: Any) -> Any:
        _raise_not_supported("register_backward_hook")

    def register_full_backward_hook(self, hook: Any, prepend: bool = False) -> Any:
        _raise_not_supported("register_full_backward_hook")

    def register_forward_pre_hook(self, hook: Any, *args: Any, **kwargs: Any) -> Any:
        _raise_not_supported("register_forward_pre_hook")

    def register_forward_hook(self, hook: Any, *args: Any, **kwargs: Any) -> Any:
        _raise_not_supported("register_forward_hook")

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        _raise_not_supported("state_dict")

    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        _raise_not_supported("load_state_dict")

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        raise ValueError("Method ``parameters`` not supported for RemoteModule. Please use "
                         "``remote_parameters`` instead.")

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Any:
        _raise_not_supported("named_parameters")

    def buffers(self, recurse: bool = True) -> Any:
        _raise_not_supported("buffers")

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Any:
        _raise_not_supported("named_buffers")

    def children(self) -> Any:
        _raise_not_supported("children")

    def named_children(self) -> Any:
        _raise_not_supported("named_children")

    def modules(self) -> Any:
        _raise_not_supported("modules")

    def named_modules(self, memo: Any = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Any:
        _raise_not_supported("named_modules")

    def requires_grad_(self, requires_grad: bool = True) -> RemoteModule:
        _raise_not_supported("requires_grad_")

    def zero_grad(self, set_to_none: bool = True) -> None:
        _raise_not_supported("zero_grad")

    def share_memory(self) -> RemoteModule:
        _raise_not_supported("share_memory")
