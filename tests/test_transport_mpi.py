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
