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
}

#: "Class.test_name" -> (reason, why this test needs it)
EXCLUDED: dict[str, tuple[str, str]] = {
}

#: the fixed part CI runs ("Class.test_name"); the full run is one command away
CI_PART: frozenset[str] = frozenset()


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
                known |= {k for k in (*EXCLUDED, *CI_PART) if k.startswith(cls_name + ".")}
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
