"""The MPI transport on its own (no agent): sends never wait for a busy receiver; how MPI
starts."""

import os
import re
import threading
import time
import types

import pytest
import torch

from mpidag.transport.frames import Envelope


def wire_is_built() -> bool:
    """Whether this environment has the compiled frame-0 path (CI: it must)."""
    try:
        import _mpidag_wire  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.mpi(min_size=1)
def test_the_compiled_wire_sends_receives_and_keeps_large_frames_in_flight():
    from mpi4py import MPI

    from mpidag.transport.wire import open_wire, status

    if os.environ.get("CI") == "true":  # set-up builds it in CI; a silent fallback is a bug
        assert wire_is_built(), status()
    if not wire_is_built():
        pytest.skip("_mpidag_wire is not built here: " + status())
    comm = MPI.COMM_SELF.Dup()
    try:
        wire = open_wire(comm, tag=3, MPI=MPI)
        assert wire is not None and status().startswith("compiled")
        assert wire.probe() is None
        wire.send(0, b"small")
        big = bytes(range(256)) * 4096  # 1 MiB: above every eager limit, stays in flight
        wire.send(0, big)
        assert wire.in_flight >= 1  # (MPICH leaves even the small one in flight at first)
        assert wire.probe() == (0, bytearray(b"small"))
        src, frame = wire.probe()
        assert src == 0 and frame == big
        for _ in range(100_000):  # received, so the sends complete with some progress
            if wire.complete_sends() == 0:
                break
        assert wire.in_flight == 0
        with pytest.raises(MPI.Exception):  # MPI's own error, as mpi4py raises it
            wire.send(5, b"to a rank that does not exist")
        with pytest.raises(ValueError, match="no rank -1"):
            wire.send(-1, b"x")
        with pytest.raises(TypeError):
            wire.send(0, "not bytes")
        # probe_wait: returns the frame that comes, or None once interrupted (the waiting
        # thread can only end before its 600 s because of interrupt())
        wire.send(0, b"waited for")
        assert wire.probe_wait(600.0) == (0, bytearray(b"waited for"))
        assert wire.probe_wait(0.0) is None and wire.probe_wait(1e-4) is None
        got = []
        waiter = threading.Thread(target=lambda: got.append(wire.probe_wait(600.0)),
                                  daemon=True)
        waiter.start()
        for _ in range(3000):  # interrupt until the thread, inside its wait, sees it
            wire.interrupt()
            waiter.join(0.01)
            if not waiter.is_alive():
                break
        assert got == [None] and not waiter.is_alive()
        wire.close()  # before the communicator is freed: an error, never a crash
        with pytest.raises(MPI.Exception) as info:
            wire.probe()
        assert info.value.Get_error_class() == MPI.ERR_COMM
        with pytest.raises(MPI.Exception):
            wire.send(0, b"after close")
        assert open_wire(comm, tag=3, MPI=MPI, compiled=False) is None
        assert status() == "Python frame-0 path: MPIDAG_COMPILED=0"
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=1)
def test_the_compiled_wire_moves_data_frames_into_and_out_of_tensors_own_memory():
    from mpi4py import MPI

    from mpidag.transport.wire import open_wire

    if not wire_is_built():
        pytest.skip("_mpidag_wire is not built here")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("a send to the own rank needs a second thread inside MPI")
    comm = MPI.COMM_SELF.Dup()
    try:
        wire = open_wire(comm, tag=3, MPI=MPI)
        sent = [torch.arange(300_000, dtype=torch.float64).reshape(600, 500),  # 2.4 MB
                torch.tensor([True, False, True]), torch.tensor(7, dtype=torch.int16)]
        for tensor in sent:
            received = torch.empty_like(tensor)
            sender = threading.Thread(target=wire.send_tensor, args=(0, 9, tensor))
            sender.start()  # (a rendezvous: the send waits for the receive)
            assert wire.recv_tensor(0, 9, received) is True
            sender.join(60)
            assert not sender.is_alive() and torch.equal(received, tensor)
        # a tensor whose bytes are not its values, in order, is left to the Python path
        base = torch.randn(4, 4, dtype=torch.complex64)
        for other in (base.t(), base.conj(), torch._neg_view(base)):
            assert wire.send_tensor(0, 9, other) is False
            assert wire.recv_tensor(0, 9, other) is False
        assert wire.probe() is None  # nothing was sent
        with pytest.raises(ValueError, match="no rank -1"):
            wire.send_tensor(-1, 9, base)
        wire.close()
        with pytest.raises(MPI.Exception):
            wire.recv_tensor(0, 9, base)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_sender_does_not_wait_while_the_receiver_is_busy(compiled):
    from mpi4py import MPI

    from mpidag.transport.mpi import MPITransport

    transport = MPITransport(compiled=compiled)
    assert (transport.wire is not None) == (compiled and wire_is_built())
    rank = transport.rank
    # 24 KiB inline: above Open MPI's eager limit, so a blocking send waits for a receive
    tensor = torch.arange(6144, dtype=torch.float32)
    try:
        # Ordering, not a stopwatch: rank 1 polls nothing until rank 0 says (over COMM_WORLD,
        # not the transport's communicator) that its three sends returned. A send that
        # waited for the receiver would never return, and rank 1 would report that.
        if rank == 0:
            for i in range(3):
                transport.send(1, Envelope(kind=4, request_id=i, payload=b"x" * 100,
                                           tensors=[tensor]), ["cpu"])
            MPI.COMM_WORLD.send("sent", dest=1)
        elif rank == 1:
            told = MPI.COMM_WORLD.irecv(source=0)
            deadline = time.monotonic() + 30
            done, message = told.test()
            while not done and time.monotonic() < deadline:
                time.sleep(0.01)
                done, message = told.test()
            got = []
            if not done:  # let rank 0's sends finish (no hang), then fail
                while not done and time.monotonic() < deadline + 30:
                    env = transport.poll()
                    if env is not None:
                        got.append(env)
                    done, message = told.test()
                pytest.fail("rank 0's sends did not return while this rank received nothing")
            assert message == "sent"
            deadline = time.monotonic() + 30
            while len(got) < 3 and time.monotonic() < deadline:
                env = transport.poll()
                if env is not None:
                    got.append(env)
            assert [env.request_id for env in got] == [0, 1, 2]
            for env in got:
                assert bytes(env.payload) == b"x" * 100 and torch.equal(env.tensors[0], tensor)
    finally:
        MPI.COMM_WORLD.Barrier()
        transport.close(collective=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_messages_with_frames_after_frame_0_arrive_whole_by_either_receipt(compiled):
    """The C receipt takes messages whose tensors are all on the CPU in frames of their own
    (or empty); a payload frame, a sparse tensor or an inline tensor beside a large one go
    to the Python method, counted through the wire's own set_receiver."""
    from mpi4py import MPI

    from mpidag.transport import frames
    from mpidag.transport.base import FramedTransport
    from mpidag.transport.mpi import MPITransport

    transport = MPITransport(compiled=compiled)
    in_c = compiled and transport.wire is not None and transport.thread_multiple
    big = torch.arange(100_000, dtype=torch.float64).reshape(1000, 100)  # 800 KB
    flags = torch.tensor([True, False] * 150_000)  # 300 KB of bool
    grad = torch.linspace(0, 1, 70_000).requires_grad_()  # 280 KB, requires grad
    cases = [  # (payload, tensors, received by C)
        (b"one", [big], True),
        (b"three", [big, torch.zeros(0, 3), flags], True),
        (b"grad", [grad, big.to(torch.int32)], True),
        (b"inline beside", [torch.ones(3), big], False),
        (bytes(range(256)) * 8192, [big], False),  # a 2 MiB payload: a frame of its own
        (b"sparse", [big.to_sparse()], False),
    ]
    python_receipts = []
    if in_c:
        python_receive = types.MethodType(FramedTransport.receive_rest, transport)

        def counting(*args):
            python_receipts.append(args[0].request_id)
            return python_receive(*args)

        cache = transport.recv_cache
        transport.wire.set_receiver(counting, cache.pool.empty if cache.pool is not None
                                    else cache.empty_tensor, frames.finish_tensor)
    try:
        if transport.rank == 0:
            for i, (payload, tensors, _) in enumerate(cases):
                transport.send(1, Envelope(kind=4, request_id=i, payload=payload,
                                           tensors=tensors), ["cpu"] * len(tensors))
        elif transport.rank == 1:
            got = []
            deadline = time.monotonic() + 60
            while len(got) < len(cases) and time.monotonic() < deadline:
                env = transport.poll()
                if env is not None:
                    got.append(env)
            assert [env.request_id for env in got] == list(range(len(cases)))
            for env, (payload, tensors, _) in zip(got, cases, strict=True):
                assert bytes(env.payload) == payload
                assert len(env.tensors) == len(tensors)
                for received, sent in zip(env.tensors, tensors, strict=True):
                    assert received.dtype == sent.dtype and received.shape == sent.shape
                    assert received.layout == sent.layout
                    assert received.requires_grad == sent.requires_grad
                    assert torch.equal(received.detach().to_dense(), sent.detach().to_dense())
            if in_c:
                assert python_receipts == [i for i, case in enumerate(cases) if not case[2]]
    finally:
        MPI.COMM_WORLD.Barrier()
        transport.close(collective=True)


START = """
import os
from mpidag.transport.mpi import start_mpi
MPI = start_mpi()
print("rank", MPI.COMM_WORLD.Get_rank(), "of", MPI.COMM_WORLD.Get_size(),
      "btl setting left:", os.environ.get("OMPI_MCA_btl"))
"""


def _start(tmp_path, extra_env: dict[str, str], nprocs: int = 0):
    """Start MPI as mpidag does, alone or under ``mpidag.run -n nprocs``, with Open MPI's
    report of which BTL components it initialises."""
    import os
    import subprocess
    import sys

    script = tmp_path / "start.py"
    script.write_text(START)
    launch = [sys.executable, "-m", "mpidag.run", "-n", str(nprocs)] if nprocs else \
        [sys.executable]
    env = {**{k: v for k, v in os.environ.items() if k != "OMPI_MCA_btl"},
           "OMPI_MCA_btl_base_verbose": "100", **extra_env}
    return subprocess.run([*launch, str(script)], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def _open_mpi() -> bool:
    import subprocess
    import sys

    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    return out.stdout.startswith("Open MPI")


@pytest.mark.parametrize("nprocs", [0, 2])
def test_mpi_on_one_node_starts_without_the_fabric_btl_unless_the_user_sets_one(tmp_path,
                                                                                 nprocs):
    """Open MPI's libfabric BTL, which sleeps 1 s when it finds no provider, is left out of a
    job on one node (a process alone, mpidag.run's local job); the user's own choice wins;
    the setting is not left in the environment for processes the program starts."""
    if not _open_mpi():
        pytest.skip("the setting is Open MPI's")
    ours = _start(tmp_path, {}, nprocs)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    for rank in range(max(nprocs, 1)):
        assert f"rank {rank} of {max(nprocs, 1)} btl setting left: None" in ours.stdout
    log = ours.stdout + ours.stderr
    # the shared-memory BTL: sm (Open MPI 5), vader (4.x)
    assert re.search(r"initializing btl component (sm|vader)\b", log), log
    assert "initializing btl component ofi" not in log, log
    if nprocs:  # the user's own setting: the same code path either way, checked alone
        return
    theirs = _start(tmp_path, {"OMPI_MCA_btl": "^tcp"}, nprocs)  # ofi stays in
    assert theirs.returncode == 0, theirs.stdout + theirs.stderr
    assert "initializing btl component ofi" in theirs.stdout + theirs.stderr
    assert "btl setting left: ^tcp" in theirs.stdout


def test_one_node_start_settings_read_the_launchers_variables():
    from mpidag.transport.mpi import one_node_start_settings

    skip_ofi = {"OMPI_MCA_btl": "^ofi"}
    assert one_node_start_settings({}) == skip_ofi
    assert one_node_start_settings({"OMPI_COMM_WORLD_SIZE": "3",
                                    "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == skip_ofi
    assert one_node_start_settings({"OMPI_COMM_WORLD_SIZE": "4",
                                    "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == {}
    assert one_node_start_settings({"SLURM_STEP_NUM_NODES": "1", "PMIX_RANK": "0"}) == skip_ofi
    assert one_node_start_settings({"SLURM_STEP_NUM_NODES": "2", "PMIX_RANK": "0"}) == {}
    assert one_node_start_settings({"PMI_RANK": "0", "PMI_SIZE": "2"}) == {}  # unknown
    assert one_node_start_settings({"OMPI_MCA_btl": "tcp,self"}) == {}


def test_a_wire_built_for_another_mpi_is_refused_with_the_reason(caplog):
    from mpidag.transport.wire import open_wire, status

    if not wire_is_built():
        pytest.skip("_mpidag_wire is not built here")

    class OtherMPI:  # what mpi4py would say if the venv's MPI changed after the build
        @staticmethod
        def Get_library_version():
            return "Some Other MPI v9.9\n"

    with caplog.at_level("INFO", logger="mpidag.transport.wire"):
        assert open_wire(None, tag=0, MPI=OtherMPI) is None
    assert "mpi4py uses 'Some Other MPI v9.9'" in status()
    assert "python -m mpidag.transport.wire_build" in status()
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_modules_built_from_other_sources_are_not_used_and_say_so(monkeypatch):
    """After a ``git pull`` without ``setup.sh`` the built modules may lack what this
    mpidag calls: they are not used (the Python path runs) and the reason says to rebuild."""
    from mpidag.transport import frames
    from mpidag.transport.wire import open_wire, status

    if not wire_is_built():
        pytest.skip("the compiled modules are not built here")
    import _mpidag_frames
    import _mpidag_wire

    monkeypatch.setattr(_mpidag_wire, "VERSION", 1)
    assert open_wire(None, tag=0, MPI=None) is None  # (refused before MPI is asked)
    assert "built from other sources (version 1" in status() and "wire_build" in status()
    monkeypatch.setattr(_mpidag_frames, "VERSION", 1)
    monkeypatch.setattr(frames, "_codec_problem", None)
    assert frames._load_codec() is None
    assert "built from other sources (version 1" in frames.codec_problem()
