"""The MPI transport on its own (no agent): sends never wait for a busy receiver."""

import time

import pytest
import torch

from mpidag.transport.frames import Envelope


@pytest.mark.mpi(min_size=2)
def test_a_sender_does_not_wait_while_the_receiver_is_busy():
    from mpi4py import MPI

    from mpidag.transport.mpi import MPITransport

    transport = MPITransport()
    rank = transport.rank
    # 24 KiB inline: above Open MPI's eager limit, so a blocking send waits for a receive
    tensor = torch.arange(6144, dtype=torch.float32)
    try:
        if rank == 0:
            started = time.monotonic()
            for i in range(3):
                transport.send(1, Envelope(kind=4, request_id=i, payload=b"x" * 100,
                                           tensors=[tensor]), ["cpu"])
            elapsed = time.monotonic() - started
            MPI.COMM_WORLD.send(elapsed, dest=1)
        elif rank == 1:
            time.sleep(0.5)  # busy: nothing receives for half a second
            got = []
            deadline = time.monotonic() + 30
            while len(got) < 3 and time.monotonic() < deadline:
                env = transport.poll()
                if env is not None:
                    got.append(env)
            elapsed = MPI.COMM_WORLD.recv(source=0)
            assert [env.request_id for env in got] == [0, 1, 2]
            for env in got:
                assert bytes(env.payload) == b"x" * 100 and torch.equal(env.tensors[0], tensor)
            assert elapsed < 0.25, f"the sender waited {elapsed:.3f} s for the receiver"
    finally:
        MPI.COMM_WORLD.Barrier()
        transport.close(collective=True)
