"""torch's ``torch.distributed.rpc.constants``: the default values of the RPC options.

Example::

    >>> from mpidag.rpc import constants
    >>> rpc._set_rpc_timeout(constants.DEFAULT_RPC_TIMEOUT_SEC)   # back to the default
    >>> rpc.get_rpc_timeout()
    60.0
"""

from datetime import timedelta

from mpidag.agent.options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
)

#: torch's timeout of its internal process group (kept for programs that read it)
DEFAULT_PROCESS_GROUP_TIMEOUT: timedelta = timedelta(milliseconds=2**31 - 1)

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_PROCESS_GROUP_TIMEOUT",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
]
