"""torch's shipped RPC suites, the test classes run against mpidag, and how to build them.

torch generates one test class per (suite, agent fixture) in ``rpc_utils.generate_tests``:
the suite's class, the agent's fixture and a base that spawns the ranks. Here the base is
torch's ``MultiProcessTestCase`` without the spawning (each MPI rank is one test rank, set by
:func:`make_test`), and the fixture is torch's own TensorPipe one: its options go through
``rpc.backend_registry`` like every torch program's.

Example::

    from tests.torch_suites import shim, suites
    shim.install()
    cls = suites.test_class(suites.SUITES[0], "RpcTest")
    names = suites.test_names(cls)        # ['test_add', 'test_add_done_callback', ...]
"""

from __future__ import annotations

import importlib
import unittest
from dataclasses import dataclass

_PREFIX = "torch.testing._internal.distributed."


@dataclass(frozen=True)
class Suite:
    """One of torch's test files and the classes of it that are run."""

    file: str  #: path under torch/testing/_internal/distributed/
    module: str
    classes: tuple[str, ...]


SUITES: tuple[Suite, ...] = (
    Suite("rpc/rpc_test.py", _PREFIX + "rpc.rpc_test", ("RpcTest", "TensorPipeAgentRpcTest")),
    Suite("rpc/dist_autograd_test.py", _PREFIX + "rpc.dist_autograd_test",
          ("DistAutogradTest", "TensorPipeAgentDistAutogradTest")),
    Suite("rpc/dist_optimizer_test.py", _PREFIX + "rpc.dist_optimizer_test",
          ("DistOptimizerTest",)),
    Suite("rpc/examples/parameter_server_test.py", _PREFIX + "rpc.examples.parameter_server_test",
          ("ParameterServerTest",)),
    Suite("rpc/examples/reinforcement_learning_rpc_test.py",
          _PREFIX + "rpc.examples.reinforcement_learning_rpc_test",
          ("ReinforcementLearningRpcTest",)),
    Suite("nn/api/remote_module_test.py", _PREFIX + "nn.api.remote_module_test",
          ("RemoteModuleTest", "ThreeWorkersRemoteModuleTest")),
    Suite("ddp_under_dist_autograd_test.py", _PREFIX + "ddp_under_dist_autograd_test",
          ("DdpUnderDistAutogradTest", "DdpComparisonTest")),
)

#: whole classes of those files that are not run, with the reason (see exclusions.py)
CLASSES_NOT_RUN: dict[str, str] = {
    "CudaRpcTest": "gpu",
    "TensorPipeAgentCudaRpcTest": "gpu",
    "CudaDistAutogradTest": "gpu",
    "TensorPipeCudaDistAutogradTest": "gpu",
    "CudaRemoteModuleTest": "gpu",
    "CudaDdpComparisonTest": "gpu",
    "FaultyAgentRpcTest": "faulty_agent",
    "FaultyAgentDistAutogradTest": "faulty_agent",
    "JitRpcTest": "torchscript",
    "JitDistAutogradTest": "torchscript",
    "JitFaultyAgentRpcTest": "torchscript",
}


def suite_of(class_name: str) -> Suite:
    """The suite that holds ``class_name``."""
    for suite in SUITES:
        if class_name in suite.classes:
            return suite
    raise KeyError(f"no suite runs {class_name!r}; known: "
                   f"{sorted(c for s in SUITES for c in s.classes)}")


def test_class(suite: Suite, class_name: str, fresh: bool = False) -> type:
    """The runnable class: torch's suite class + torch's TensorPipe fixture + a base
    without process spawning (the shim must be installed first). ``fresh`` reloads the
    suite's module first: its globals (e.g. dist_autograd_test's ``rpc_done`` and
    ``ctx_ids``) start anew, as in the new process torch runs each test in."""
    from torch.testing._internal.common_distributed import MultiProcessTestCase
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    module = importlib.import_module(suite.module)
    if fresh:
        module = importlib.reload(module)
    suite_class = getattr(module, class_name)
    generated = type(f"TensorPipe{class_name}",
                     (suite_class, TensorPipeRpcAgentTestFixture, MultiProcessTestCase), {})
    # as torch's generate_tests does: the class lives in a module, so methods of the test
    # (e.g. a trainer's bound method sent by RPC) pickle by reference
    generated.__module__ = suite.module
    setattr(module, generated.__name__, generated)
    return generated


def test_names(cls: type) -> list[str]:
    """The test methods of ``cls`` in unittest's order."""
    return list(unittest.TestLoader().getTestCaseNames(cls))


def make_test(cls: type, name: str, rank: int, file_name: str) -> unittest.TestCase:
    """An instance of test ``name`` as MPI rank ``rank``, with the shared store file."""
    test = cls(name)
    test.rank = rank
    test.file_name = file_name
    return test
