"""``mpidag.rpc``: ``torch.distributed.rpc`` on MPI. Port a program by changing its imports.

Example::

    import mpidag.rpc as rpc              # was: import torch.distributed.rpc as rpc
    rpc.init_rpc()                        # rank and world size come from mpirun/srun
    ret = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
    rpc.shutdown()
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
from mpidag.errors import RemoteTraceback, RPCError, RPCTimeoutError, WorkerFailedError
from mpidag.rpc import api, backend_registry, constants, functions  # noqa: F401 - as torch's
from mpidag.rpc.api import (
    _get_current_rpc_agent,  # noqa: F401 - torch's private helper, used by its tests
    _get_debug_info,  # noqa: F401 - torch's private helper, used by its tests
    _rref_context_get_debug_info,  # noqa: F401 - torch's private helper, used by its tests
    _set_rpc_timeout,  # noqa: F401 - torch's private helper, used by its tests
    enable_gil_profiling,
    failed_workers,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    rpc_async,
    rpc_sync,
    shutdown,
)
from mpidag.rpc.process_group import init_process_group
from mpidag.rpc.rref import RRef, remote
from mpidag.rpc.server_process_global_profiler import (
    _server_process_global_profile,  # noqa: F401 - torch's private name, used by its tests
)

__all__ = [
    "BackendType",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "MPIRpcBackendOptions",
    "RPCError",
    "RRef",
    "RpcBackendOptions",
    "RPCTimeoutError",
    "RemoteTraceback",
    "TensorPipeRpcBackendOptions",
    "UNSET_RPC_TIMEOUT",
    "WorkerFailedError",
    "WorkerInfo",
    "enable_gil_profiling",
    "failed_workers",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_process_group",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
