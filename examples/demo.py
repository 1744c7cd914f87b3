"""mpidag demo: the example of PyTorch's distributed autograd design document, on MPI.

Worker 0 sends ``t1`` and ``t2`` to worker 1, which adds them (``my_add``); worker 0
multiplies the result with ``t4`` and runs the distributed backward pass from
``loss = t5.sum()``. The FAST mode engine sends the gradient of ``t3`` back to worker 1, whose
send function passes it on to ``t1`` and ``t2`` on worker 0. The gradients, read from the
context with ``get_gradients``, are printed next to those of the same computation done
locally with plain autograd.

Run:  python -m mpidag.run -n 2 examples/demo.py
"""

from __future__ import annotations

import statistics
import time

import torch

import mpidag.autograd as dist_autograd  # was: import torch.distributed.autograd
import mpidag.rpc as rpc  # was: import torch.distributed.rpc


def my_add(t1, t2):
    return torch.add(t1, t2)


def forward_and_backward(t1, t2, t4):
    with dist_autograd.context() as context_id:
        # Perform some computation remotely.
        t3 = rpc.rpc_sync("worker1", my_add, args=(t1, t2))
        # Perform some computation locally based on the remote result.
        t5 = torch.mul(t3, t4)
        # Compute some loss.
        loss = t5.sum()
        # Run the backward pass.
        dist_autograd.backward(context_id, [loss])
        # Retrieve the gradients from the context.
        return loss, dist_autograd.get_gradients(context_id)


def main() -> None:
    rpc.init_rpc()  # rank and world size come from mpirun / srun
    me = rpc.get_worker_info()
    if me.id == 0:
        torch.manual_seed(0)
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        t4 = torch.rand((3, 3), requires_grad=True)
        loss, grads = forward_and_backward(t1, t2, t4)
        local_loss = torch.mul(my_add(t1, t2), t4).sum()
        local = torch.autograd.grad(local_loss, [t1, t2, t4])
        print(f"[{me.name}] loss {loss.item():.6f} (local: {local_loss.item():.6f})")
        worst = 0.0
        for name, tensor, expected in zip(("t1", "t2", "t4"), (t1, t2, t4), local,
                                          strict=True):
            got = grads[tensor]
            worst = max(worst, (got - expected).abs().max().item())
            print(f"[{me.name}] gradient of {name}: distributed | local")
            for row_got, row_exp in zip(got.tolist(), expected.tolist(), strict=True):
                print("    " + " ".join(f"{v:8.4f}" for v in row_got) + "  | "
                      + " ".join(f"{v:8.4f}" for v in row_exp))
        assert t1.grad is None, "distributed gradients live in the context, not in .grad"
        print(f"[{me.name}] largest difference to local autograd: {worst:.2e}")
        if worst > 1e-6:
            raise SystemExit("distributed gradients differ from local autograd")
        for _ in range(200):
            forward_and_backward(t1, t2, t4)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(500):
                forward_and_backward(t1, t2, t4)
            times.append((time.perf_counter() - start) / 500 * 1e6)
        print(f"[{me.name}] forward + distributed backward: {statistics.median(times):.0f} us "
              f"per iteration (median of 5 x 500)")
    rpc.shutdown()
    print(f"[{me.name}] shut down cleanly")


if __name__ == "__main__":
    main()
