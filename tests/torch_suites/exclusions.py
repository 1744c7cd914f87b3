"""The reviewed list of torch tests not run against mpidag, each with its reason.

A test is excluded only for a reason from :data:`REASONS`, a short closed list; a test of
public behaviour is made to pass, never excluded. Every entry names a test that exists in
the installed torch (:func:`check`, run by the runner and by tests/test_torch_suites.py), so
the list cannot go stale silently. Whole classes not run are in ``suites.CLASSES_NOT_RUN``.
"""

from __future__ import annotations

#: the closed list of reasons
REASONS: dict[str, str] = {
    "torchscript": "TorchScript over RPC (mpidag has no TorchScript RPC)",
    "faulty_agent": "torch's fault-injecting agent",
    "gpu": "needs a GPU",
    "tensorpipe": "a TensorPipe-only option or behaviour",
    "torch_internal": "a torch C++ internal with no meaning for mpidag",
    "torch_hang": "asserts that torch hangs where mpidag answers (a documented difference)",
    "dynamic_membership": "ranks joining an RPC group one by one (init_rpc without "
    "world_size): the MPI job is the world, and mpidag refuses this at once with a clear "
    "error (docs/porting.md)",
}

#: "Class.test_name" -> (reason, why this test needs it)
EXCLUDED: dict[str, tuple[str, str]] = {
    # TorchScript over RPC: scripted functions sent by rpc/remote, rpc called from script
    "RpcTest.test_profiler_with_script_async_rpc": (
        "torchscript", "rpc_async of a script function"),
    "RpcTest.test_profiler_with_script_async_rpc_single_threaded": (
        "torchscript", "rpc_async of a script function"),
    "RpcTest.test_profiler_with_script_sync_rpc": ("torchscript", "rpc_sync of a script function"),
    "RpcTest.test_profiler_with_script_sync_rpc_single_threaded": (
        "torchscript", "rpc_sync of a script function"),
    "RpcTest.test_profiler_with_script_remote_rpc": ("torchscript", "remote of a script function"),
    "RpcTest.test_profiler_with_script_remote_rpc_single_threaded": (
        "torchscript", "remote of a script function"),
    "RpcTest.test_async_record_function_cbs_jit_call": (
        "torchscript", "rpc_async called from a script function"),
    "RpcTest.test_rref_get_future": (
        "torchscript", "its third case is remote of a script function"),
    "RpcTest.test_wait_all_exit_early_script_function": (
        "torchscript", "rpc_async of a script function"),
    "RpcTest.test_stress_heavy_rpc_torchscript": ("torchscript", "rpc_sync of a script function"),
    "DistAutogradTest.test_backward_simple_script_call": (
        "torchscript", "rpc of a script function in a context"),
    "DistAutogradTest.test_trainer_ps_torchscript_functions": (
        "torchscript", "script functions as the trainer's RPC targets"),
    "TensorPipeAgentDistAutogradTest.test_backward_simple_script_call_sparse": (
        "torchscript", "rpc of a script function in a context"),
    "RemoteModuleTest.test_forward_async": (
        "torchscript", "runs each module-creation mode, the second a scripted RemoteModule "
        "with a TorchScript module interface"),
    "RemoteModuleTest.test_forward_sync": (
        "torchscript", "runs each module-creation mode, the second a scripted RemoteModule "
        "with a TorchScript module interface"),
    "RemoteModuleTest.test_forward_async_script": (
        "torchscript", "RemoteModule with a TorchScript module interface"),
    "RemoteModuleTest.test_forward_sync_script": (
        "torchscript", "RemoteModule with a TorchScript module interface"),
    "RemoteModuleTest.test_remote_module_py_pickle_not_supported_script": (
        "torchscript", "RemoteModule with a TorchScript module interface"),
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported": (
        "torchscript", "RemoteModule with a TorchScript module interface"),
    # torch's agent internals
    "RpcTest.test_register_rpc_backend_and_set_and_start_rpc_backend": (
        "torch_internal", "registers a backend type into torch's C++ agent registry"),
    "RpcTest.test_use_rpc_pickler": (
        "torch_internal", "swaps torch's internal _default_pickler"),
    "RpcTest.test_wait_all_workers_timeout": (
        "torch_internal", "monkeypatches torch's private api._wait_all_workers, which "
        "mpidag's shutdown does not call"),
    "RpcTest.test_shutdown_errors": (
        "torch_internal", "monkeypatches torch's private _broadcast_to_followers and "
        "_delete_all_user_and_unforked_owner_rrefs inside shutdown"),
    "TensorPipeAgentRpcTest.test_dynamic_rpc_init_rpc": (
        "dynamic_membership", "every rank calls init_rpc(rank=r) without a world_size"),
    "TensorPipeAgentRpcTest.test_dynamic_rpc_init_rpc_without_rank": (
        "dynamic_membership", "expects init_rpc without rank and world_size to fail; with "
        "MPI it starts the whole job's world, mpidag's documented default"),
    "TensorPipeAgentRpcTest.test_dynamic_rpc_new_rank_can_communicated_with_existing_rank": (
        "dynamic_membership", "rank 0 starts alone, the others join after a barrier"),
    "TensorPipeAgentRpcTest.test_dynamic_rpc_existing_rank_can_communicate_with_new_rank": (
        "dynamic_membership", "rank 0 starts alone, the others join after a barrier"),
    "TensorPipeAgentRpcTest.test_dynamic_and_static_init_rpc_together": (
        "dynamic_membership", "a static world of 3 of the 4 processes, then a dynamic member"),
    "RpcTest.test_use_rref_after_shutdown": (
        "torch_internal", "its second half pickles an RRef with torch's internal RPC pickler "
        "(torch.distributed.rpc.internal.serialize calls the C++ RRef's _serialize)"),
    "RpcTest.test_duplicate_name": (
        "torch_internal", "starts torch's agent by hand: rpc._init_rpc_backend with a "
        "rendezvous store (the public init_rpc path is test_duplicate_name_2)"),
    "DistAutogradTest.test_backward_unused_send_function": (
        "torch_hang", "asserts the backward pass is still running after 10 s (FAST mode "
        "waits forever for the gradient of an unused RPC result); mpidag's SMART mode "
        "finishes with the exact gradients"),
    "RpcTest.test_rref_leak": (
        "torch_internal", "mocks torch's private _delete_all_user_and_unforked_owner_rrefs "
        "so that shutdown leaves user RRefs behind"),
    "TensorPipeAgentRpcTest.test_infer_backend_from_options": (
        "tensorpipe", "asserts the agent is an instance of torch's C++ TensorPipeAgent"),
}

#: "Class.test_name" -> why: tests that race in torch's own code; they run in the full run
#: (``python -m tests.torch_suites``) but never in CI's fixed part, where one failure in two
#: tries would fail CI for a reason mpidag cannot fix
RACY_IN_TORCH: dict[str, str] = {
    "DdpUnderDistAutogradTest.test_backward_ddp_inside": (
        "the master's rpc.remote(trainer, Trainer) can reach a trainer whose main thread is "
        "still inside dist.init_process_group (past the Gloo rendezvous, before the default "
        "group is set), and Trainer.__init__'s dist.new_group raises 'Default process group "
        "has not been initialized'; TensorPipe's ~1 ms latency hides the race, mpidag's "
        "~10 us does not (failed 2 of 5 runs of its class, on the Python path too)"),
    "DdpUnderDistAutogradTest.test_backward_ddp_outside": (
        "the same race as test_backward_ddp_inside (Trainer.__init__ calls dist.new_group)"),
}


def _read_ci_part() -> frozenset[str]:
    from pathlib import Path

    path = Path(__file__).with_name("ci_part.txt")
    lines = path.read_text().splitlines() if path.exists() else []
    return frozenset(line.strip() for line in lines
                     if line.strip() and not line.startswith("#"))


#: the fixed part CI runs ("Class.test_name", listed in ci_part.txt); the full run is one
#: command away (python -m tests.torch_suites)
CI_PART: frozenset[str] = _read_ci_part()


def check() -> None:
    """Raise ``ValueError`` for an unknown reason or an entry naming no test of torch's."""
    from tests.torch_suites import shim, suites

    shim.install()
    known = set()
    for suite in suites.SUITES:
        for cls_name in suite.classes:
            try:
                cls = suites.test_class(suite, cls_name)
            except Exception:  # noqa: BLE001 - reported by the runner as the file's failure
                known |= {k for k in (*EXCLUDED, *CI_PART, *RACY_IN_TORCH)
                          if k.startswith(cls_name + ".")}
                continue
            known |= {f"{cls_name}.{n}" for n in suites.test_names(cls)}
    for key, (reason, why) in EXCLUDED.items():
        if reason not in REASONS:
            raise ValueError(f"exclusions.py: {key}: unknown reason {reason!r} "
                             f"(known: {sorted(REASONS)})")
        if not why:
            raise ValueError(f"exclusions.py: {key}: say why")
        if key not in known:
            raise ValueError(f"exclusions.py: {key} is not a test of the installed torch")
    stale = sorted(CI_PART - known)
    if stale:
        raise ValueError(f"exclusions.py: CI_PART names tests torch does not have: {stale}")
    stale = sorted(set(RACY_IN_TORCH) - known)
    if stale:
        raise ValueError(f"exclusions.py: RACY_IN_TORCH names tests torch does not have: "
                         f"{stale}")
    racy_in_ci = sorted(CI_PART & set(RACY_IN_TORCH))
    if racy_in_ci:
        raise ValueError(f"exclusions.py: CI's fixed part (ci_part.txt) has tests that race "
                         f"in torch's own code: {racy_in_ci}")
