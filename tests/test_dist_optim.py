"""DistributedOptimizer behaviour only MPI ranks can show; the rest of the optimizer contract
is in tests/contract/test_dist_optim.py (run on both transports)."""

from __future__ import annotations

import pytest
import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from mpidag.optim import DistributedOptimizer
from tests import optim_funcs as of
from tests.conftest import profiled_names

pytestmark = pytest.mark.mpi(min_size=2)

close = torch.testing.assert_close


# MPI only: the torch profiler is process-wide (in-process ranks would share one)
def test_profiler_ranges_of_backward_and_step(rpc_world):
    """A trace shows the caller's backward, each rank's gradient work, the RPCs and the
    owner's optimizer step, on every rank that took part."""
    me, nxt, prv = rpc_world.name, rpc_world.next, rpc_world.prev
    param = rpc.remote(nxt, of.random_tensor, args=(rpc_world.rank,))

    def train_step(param=param):
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(nxt, of.scaled_sum, args=(param, 2.0))
            dist_autograd.backward(context_id, [loss])
            DistributedOptimizer(torch.optim.SGD, [param], lr=0.1).step(context_id)

    names = profiled_names(train_step)
    for name in ("mpidag.autograd.backward", "mpidag.autograd.gradients(roots)",
                 # the gradient of my RPC's arguments went to the previous rank's pass, and
                 # the previous rank's loss came from here: its gradients arrive here
                 f"mpidag.autograd.gradients({prv} -> {me})",
                 "mpidag.optim.step",  # the previous rank's parameter lives here
                 f"mpidag.rpc#tests.optim_funcs.scaled_sum({me} -> {nxt})",
                 f"mpidag.rpc.serve#tests.optim_funcs.scaled_sum({prv} -> {me})"):
        assert name in names, (name, sorted(n for n in names if n.startswith("mpidag")))
    del param, train_step
