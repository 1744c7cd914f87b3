"""Backend options, backend types and ``WorkerInfo`` (defined in :mod:`mpidag.agent.options`),
under the module path of ``torch.distributed.rpc``'s public names.

Example::

    >>> from mpidag.rpc.options import TensorPipeRpcBackendOptions
    >>> opts = TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20)
    >>> type(opts).__name__, opts.num_worker_threads, opts.rpc_timeout
    ('MPIRpcBackendOptions', 8, 20.0)
"""

from mpidag.agent.options import (
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    BackendType,
    MPIRpcBackendOptions,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
)

__all__ = [
    "BackendType",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "MPIRpcBackendOptions",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "UNSET_RPC_TIMEOUT",
    "WorkerInfo",
]
