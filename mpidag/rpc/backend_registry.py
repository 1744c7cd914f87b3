"""torch's ``torch.distributed.rpc.backend_registry``: the backend types and the options
each takes. mpidag has one backend, MPI; ``BackendType.TENSORPIPE`` names it too, so a
torch program's backend and options run on MPI unchanged.

Example::

    from mpidag.rpc import backend_registry
    opts = backend_registry.construct_rpc_backend_options(
        backend_registry.BackendType["TENSORPIPE"], rpc_timeout=20, num_worker_threads=8)
    rpc.init_rpc("worker0", backend=backend_registry.BackendType.TENSORPIPE,
                 rpc_backend_options=opts)
"""

from __future__ import annotations

from typing import Any

from mpidag.agent.options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    BackendType,
    MPIRpcBackendOptions,
)

__all__ = [
    "BackendType",
    "backend_registered",
    "construct_rpc_backend_options",
    "register_backend",
]


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` names a backend (``"MPI"`` or ``"TENSORPIPE"``).

    Example::

        >>> from mpidag.rpc import backend_registry
        >>> backend_registry.backend_registered("TENSORPIPE")
        True
        >>> backend_registry.backend_registered("GLOO")
        False
    """
    return backend_name in BackendType.__members__


def register_backend(backend_name: str, construct_rpc_backend_options_handler: Any,
                     init_backend_handler: Any) -> BackendType:
    """torch's registration of a new backend, which mpidag cannot do: every call runs on
    MPI. Raises ``RuntimeError`` (torch's "already registered" for a known name).

    Example::

        >>> from mpidag.rpc import backend_registry
        >>> backend_registry.register_backend("TENSORPIPE", None, None)
        Traceback (most recent call last):
        RuntimeError: RPC backend TENSORPIPE: already registered
    """
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    raise RuntimeError(
        f"RPC backend {backend_name}: mpidag cannot register backends; every backend runs on "
        f"MPI. Use mpidag.rpc.BackendType.MPI (or TENSORPIPE) with MPIRpcBackendOptions.")


def construct_rpc_backend_options(
    backend: BackendType,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = DEFAULT_INIT_METHOD,
    num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
    _transports: list | None = None,
    _channels: list | None = None,
    **kwargs: Any,
) -> MPIRpcBackendOptions:
    """The options of ``backend``, as torch's function makes them: an
    :class:`~mpidag.rpc.MPIRpcBackendOptions` for both ``BackendType`` members (the
    TensorPipe-only ``_transports`` and ``_channels`` are accepted and unused); other
    keyword arguments go to the options (``device_maps``, ``devices``, ``max_sleep``).

    Example::

        >>> from mpidag.rpc import backend_registry
        >>> opts = backend_registry.construct_rpc_backend_options(
        ...     rpc.BackendType.TENSORPIPE, rpc_timeout=20, num_worker_threads=8)
        >>> type(opts).__name__, opts.rpc_timeout, opts.num_worker_threads
        ('MPIRpcBackendOptions', 20.0, 8)
    """
    if not isinstance(backend, BackendType) and \
            getattr(backend, "name", None) not in BackendType.__members__:
        raise TypeError(f"Argument backend must be a member of BackendType: "
                        f"mpidag.rpc.BackendType.MPI (or TENSORPIPE, which runs on MPI), got "
                        f"{backend!r}")
    return MPIRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method,
                                num_worker_threads=num_worker_threads,
                                _transports=_transports, _channels=_channels, **kwargs)
