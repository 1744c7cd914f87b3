"""Backend options, backend types and ``WorkerInfo``, mirroring ``torch.distributed.rpc``."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mpidag.errors import InvalidArgumentError

__all__ = [
    "BackendType",
    "check_timeout",
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
    "MPIRpcBackendOptions",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
]

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_SHUTDOWN_TIMEOUT = 0
UNSET_RPC_TIMEOUT = -1.0
DEFAULT_NUM_WORKER_THREADS = 16
DEFAULT_INIT_METHOD = "env://"

DeviceLike = int | str | torch.device


def check_timeout(timeout: Any, name: str = "timeout") -> float:
    """The ``timeout`` of a call, checked on the caller by torch's rules.

    ``UNSET_RPC_TIMEOUT`` (-1.0; also ``None``) takes the default of the backend options,
    0 means no timeout (so does ``inf``), any other value is seconds and must be >= 0.
    Anything else raises at once, naming the argument: ``TypeError`` for what is not a
    number, :class:`~mpidag.errors.InvalidArgumentError` (a ``ValueError`` and torch's
    ``RuntimeError``) for a negative or NaN number, which torch takes and then fails the
    call with a timeout.

    Example::

        >>> check_timeout(2), check_timeout(UNSET_RPC_TIMEOUT), check_timeout(math.inf)
        (2, -1.0, 0.0)
        >>> check_timeout(-5)
        Traceback (most recent call last):
        mpidag.errors.InvalidArgumentError: timeout=-5 is not a valid timeout: pass seconds ...
    """
    kind = timeout.__class__
    if kind is float or kind is int:  # the common cases: a timeout, or the default
        if 0 <= timeout < math.inf:
            return timeout
        if timeout == UNSET_RPC_TIMEOUT:
            return UNSET_RPC_TIMEOUT
    if timeout is None:
        return UNSET_RPC_TIMEOUT
    if kind is bool or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds (0: no timeout), got "
                        f"{kind.__name__}: {timeout!r}")
    seconds = float(timeout)
    if seconds == UNSET_RPC_TIMEOUT:
        return UNSET_RPC_TIMEOUT
    if not seconds >= 0:  # negative or NaN
        raise InvalidArgumentError(
            f"{name}={timeout!r} is not a valid timeout: pass seconds >= 0 (0: no timeout), or "
            f"leave {name}= out (UNSET_RPC_TIMEOUT, {UNSET_RPC_TIMEOUT}) for the default "
            f"timeout of the backend options (rpc_timeout)")
    return 0.0 if seconds == math.inf else seconds


class BackendType(enum.Enum):
    """RPC backends. ``TENSORPIPE`` is accepted for torch programs and runs on MPI.

    Example::

        >>> rpc.BackendType.TENSORPIPE.name   # what torch programs pass; mpidag runs it on MPI
        'TENSORPIPE'

    so ``rpc.init_rpc("worker0", backend=rpc.BackendType.TENSORPIPE)`` runs unchanged.
    """

    MPI = "MPI"
    TENSORPIPE = "TENSORPIPE"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker of the job: its ``name`` and ``id`` (its MPI rank).

    Example::

        >>> info = mpidag.rpc.get_worker_info("worker1")
        >>> info.id, info.name
        (1, 'worker1')
    """

    name: str
    id: int

    def __post_init__(self) -> None:
        check_worker_name(self.name)

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


#: torch's limit on worker names (``MAX_NAME_LEN``), and the characters it allows
MAX_NAME_LEN = 128
_NAME_PUNCTUATION = frozenset("-_:")


def check_worker_name(name: str) -> None:
    """Raise ``RuntimeError`` (torch's type and wording) unless ``name`` is a valid worker
    name: non-empty, shorter than 128 characters, only letters, digits, ``-``, ``_``, ``:``.

    Example::

        >>> check_worker_name("trainer:0")
        >>> check_worker_name("abc*")
        Traceback (most recent call last):
        RuntimeError: Worker name must match ^[A-Za-z0-9-_:]*$, but got 'abc*': use only ...
    """
    if not isinstance(name, str):
        raise TypeError(f"a worker name must be a str, got {type(name).__name__}")
    if not name:
        raise RuntimeError("Worker name must be non-empty: pass a name such as 'trainer0' "
                           "(or none: mpidag names rank r 'worker{r}')")
    if len(name) >= MAX_NAME_LEN:
        raise RuntimeError(f"RPC worker name {name[:40]}... is not shorter than "
                           f"{MAX_NAME_LEN} characters ({len(name)}): choose a shorter name")
    if not all(c.isascii() and (c.isalnum() or c in _NAME_PUNCTUATION) for c in name):
        raise RuntimeError(f"Worker name must match ^[A-Za-z0-9-_:]*$, but got {name!r}: "
                           f"use only letters, digits, '-', '_' and ':'")


def _device(d: DeviceLike) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    dev = torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    return dev


class RpcBackendOptions:
    """The base class of backend options (torch's ``RpcBackendOptions``): a default
    timeout and an init method. :class:`MPIRpcBackendOptions` is the one backend's options;
    a subclass of this one that is not that is refused by ``init_rpc``.

    Example::

        >>> opts = rpc.RpcBackendOptions(rpc_timeout=20)
        >>> opts.rpc_timeout, opts.init_method
        (20.0, 'env://')
    """

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD) -> None:
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method


class MPIRpcBackendOptions(RpcBackendOptions):
    """Options of the MPI RPC backend; same arguments as ``TensorPipeRpcBackendOptions``.

    Args:
        num_worker_threads: threads that run incoming requests (default 16).
        rpc_timeout: default timeout of calls in seconds (default 60; 0 means none).
        init_method: accepted for torch compatibility and ignored (MPI bootstraps the job).
        device_maps: ``{worker_name: {local_device: remote_device}}`` for CUDA tensors.
        devices: local devices this worker uses (checked against the device maps).
        max_sleep: longest idle sleep of the progress loop, seconds; bounds the idle CPU
            use. ``None`` (default): ``MPIDAG_BACKOFF_MAX`` as read at ``init_rpc``, else
            1e-3.

    Example::

        >>> opts = MPIRpcBackendOptions(num_worker_threads=8, rpc_timeout=20)
        >>> opts.set_device_map("worker1", {0: 1})
        >>> opts.device_maps
        {'worker1': {device(type='cuda', index=0): device(type='cuda', index=1)}}

    and then ``mpidag.rpc.init_rpc("worker0", rpc_backend_options=opts)`` on every rank.
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: Mapping[str, Mapping[DeviceLike, DeviceLike]] | None = None,
        devices: list[DeviceLike] | None = None,
        max_sleep: float | None = None,
        _transports: list | None = None,
        _channels: list | None = None,
    ) -> None:
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ValueError(
                f"num_worker_threads must be a positive int, got {num_worker_threads!r}"
            )
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, numbers.Real):
            raise TypeError(f"MPIRpcBackendOptions(): incompatible constructor arguments: "
                            f"rpc_timeout must be a number of seconds (0: no timeout), got "
                            f"{type(rpc_timeout).__name__}: {rpc_timeout!r}")
        if not rpc_timeout >= 0:  # NaN too
            raise ValueError(f"rpc_timeout must be >= 0 seconds (0: no timeout), got "
                             f"{rpc_timeout!r}")
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method
        self.device_maps: dict[str, dict[torch.device, torch.device]] = {}
        for name, mapping in (device_maps or {}).items():
            self.set_device_map(name, mapping)
        self.devices = [_device(d) for d in devices or []]
        if max_sleep is not None and not max_sleep >= 0:
            raise ValueError(f"max_sleep must be >= 0 seconds, got {max_sleep!r}")
        self.max_sleep = max_sleep

    def set_device_map(self, to: str, device_map: Mapping[DeviceLike, DeviceLike]) -> None:
        """Map local devices to devices of worker ``to`` for tensors sent there.

        Replies from ``to`` use the inverse map, as in torch. Two local devices may not map
        to the same remote device (``ValueError``).

        Example::

            >>> opts = MPIRpcBackendOptions()
            >>> opts.set_device_map("worker1", {"cuda:0": "cuda:1"})   # or {0: 1}
            >>> opts.device_maps
            {'worker1': {device(type='cuda', index=0): device(type='cuda', index=1)}}
        """
        mapping = {_device(k): _device(v) for k, v in device_map.items()}
        targets = list(mapping.values())
        if len(set(targets)) != len(targets):
            raise ValueError(f"device map for {to!r} maps two local devices to the same remote "
                             f"device: {device_map!r}")
        self.device_maps.setdefault(to, {}).update(mapping)

    def set_devices(self, devices: list[DeviceLike]) -> None:
        """Set the local devices this worker uses.

        Example::

            >>> opts = MPIRpcBackendOptions()
            >>> opts.set_devices(["cuda:0", 1])
            >>> opts.devices
            [device(type='cuda', index=0), device(type='cuda', index=1)]
        """
        self.devices = [_device(d) for d in devices]

    @classmethod
    def from_any(cls, options: Any) -> MPIRpcBackendOptions:
        """Accept ours, torch's ``TensorPipeRpcBackendOptions``, or ``None``.

        Example::

            >>> import torch.distributed.rpc as torch_rpc
            >>> opts = MPIRpcBackendOptions.from_any(
            ...     torch_rpc.TensorPipeRpcBackendOptions(num_worker_threads=8))
            >>> opts.num_worker_threads, opts.rpc_timeout
            (8, 60.0)
        """
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if hasattr(options, "num_worker_threads") and hasattr(options, "rpc_timeout"):
            return cls(
                num_worker_threads=int(options.num_worker_threads),
                rpc_timeout=float(options.rpc_timeout),
                device_maps=dict(getattr(options, "device_maps", {}) or {}),
                devices=list(getattr(options, "devices", []) or []),
            )
        if isinstance(options, RpcBackendOptions) or any(
                c.__name__ == "RpcBackendOptions" for c in type(options).__mro__):
            raise TypeError(
                f"Could not infer backend for options {options!r}: `rpc_backend_options` must "
                f"be a `TensorPipeRpcBackendOptions` (mpidag.rpc.MPIRpcBackendOptions, the "
                f"one backend's options), got {type(options).__name__}")
        raise TypeError(
            f"Argument rpc_backend_options must be an instance of RpcBackendOptions: pass "
            f"mpidag.rpc.MPIRpcBackendOptions (or torch's TensorPipeRpcBackendOptions), got "
            f"{type(options).__name__}"
        )


#: torch programs construct this name; it is the same options class here
TensorPipeRpcBackendOptions = MPIRpcBackendOptions
