"""SMART mode: exact gradients for any graph recorded in a context, against local autograd.

The default ``mode="smart"`` of ``mpidag.autograd.backward`` must give the gradients of the
same computation done locally also when the loss leaves some RPC results unused, including
results that share inputs with used ones (FAST mode cannot finish there), in the middle of a
chain over several ranks, results of ``remote()``/``to_here()``/proxies, with several roots,
with ``retain_graph`` and in concurrent contexts. ``mode="fast"`` keeps PyTorch's strict rule.
Contract tests: each runs in-process and under MPI (tests/contract/harness.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc
from tests import autograd_funcs as af
from tests.contract.harness import serial

close = torch.testing.assert_close


def _seeded(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + seed)
    return [torch.rand(s, generator=gen, requires_grad=True) for s in shapes]


def _check(grads: dict, loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    """``grads`` (a context's) equal local autograd's for ``loss``; unreached leaves absent."""
    expected = torch.autograd.grad(loss, leaves, allow_unused=True)
    for i, (leaf, want) in enumerate(zip(leaves, expected, strict=True)):
        if want is None:
            assert leaf not in grads, f"leaf {i} got a gradient the loss does not give it"
        else:
            assert leaf in grads, f"leaf {i} is missing its gradient"
            close(grads[leaf], want)


def test_unused_result_sharing_an_input_with_a_used_one(world):
    """The case FAST mode cannot finish: ``h`` feeds a used and an unused RPC."""
    a, c = _seeded(world.rank, (3,), (3,))
    with serial(), warnings.catch_warnings():  # process-wide filters: one rank at a time
        warnings.simplefilter("error")  # SMART mode does not warn about unused results
        with dist_autograd.context() as context_id:
            h = a * 2
            d = rpc.rpc_sync(world.next, af.square, args=(h,))
            e = rpc.rpc_sync(world.next, af.mul_sin, args=(h, c))  # noqa: F841 - unused
            dist_autograd.backward(context_id, [d.sum()])
            grads = dist_autograd.get_gradients(context_id)
    _check(grads, af.square(a * 2).sum(), [a, c])


def test_fast_mode_stays_strict(world):
    a, b, c = _seeded(world.rank, (3,), (3,), (3,))
    with dist_autograd.context() as context_id:
        h = a * 2
        d = rpc.rpc_sync(world.next, af.square, args=(h,))
        e = rpc.rpc_sync(world.next, af.mul_sin, args=(h, c))  # noqa: F841 - unused
        with pytest.raises(dist_autograd.UnusedRPCGradientError, match="mul_sin") as info:
            dist_autograd.backward(context_id, [d.sum()], mode="fast")
        assert "FAST mode" in str(info.value)
        assert f"mul_sin sent to {world.next} (from rank {world.rank}) never " \
            "received a gradient" in str(info.value)  # the waiting source, named
        del info
    with dist_autograd.context() as context_id:
        d = rpc.rpc_sync(world.next, af.my_add, args=(a, b))
        e = rpc.rpc_sync(world.next, torch.mul, args=(b, c))  # noqa: F841 - unused
        with serial(), pytest.warns(dist_autograd.UnusedRPCWarning, match="mul"):
            dist_autograd.backward(context_id, [d.sum()], mode="fast")
        grads = dist_autograd.get_gradients(context_id)
    _check(grads, af.my_add(a, b).sum(), [a, b, c])
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync(world.next, af.my_add, args=(a, b)).sum()
        with pytest.raises(ValueError, match="'smart'.*'fast'.*got 'quick'"):
            dist_autograd.backward(context_id, [loss], mode="quick")


def test_unused_results_of_remote_to_here_and_proxies(world):
    a, b = _seeded(world.rank, (4,), (4,))
    with dist_autograd.context() as context_id:
        h = a.exp()
        rref = rpc.remote(world.next, af.square, args=(h,))
        fetched = rref.to_here()  # noqa: F841 - unused
        via_proxy = rref.rpc_sync().mul(2)  # noqa: F841 - unused
        used = rpc.rpc_sync(world.next, af.my_add, args=(h, b))
        other = rpc.remote(world.next, af.mul_sin, args=(h, b))  # never fetched
        dist_autograd.backward(context_id, [used.sum()])
        grads = dist_autograd.get_gradients(context_id)
        del other, rref
    _check(grads, af.my_add(a.exp(), b).sum(), [a, b])


def test_several_roots_and_retain_graph(world):
    a, b, c = _seeded(world.rank, (3,), (3,), (3,))
    with dist_autograd.context() as context_id:
        h = a * b
        d = rpc.rpc_sync(world.next, af.square, args=(h,))
        rpc.rpc_sync(world.next, af.mul_sin, args=(h, c))  # unused
        f = rpc.rpc_sync(world.next, af.my_add, args=(h, c))
        roots = [d.sum(), (f * 2).sum()]
        dist_autograd.backward(context_id, roots, retain_graph=True)
        dist_autograd.backward(context_id, roots)  # the second pass adds to the first
        grads = dist_autograd.get_gradients(context_id)
    h = a * b
    local = 2 * (af.square(h).sum() + (af.my_add(h, c) * 2).sum())
    _check(grads, local, [a, b, c])


def test_concurrent_contexts_with_unused_results(world):
    done: dict[int, tuple] = {}

    def worker(i: int) -> None:
        a, c = _seeded(world.rank * 10 + i, (5,), (5,))
        for _ in range(4):
            with dist_autograd.context() as context_id:
                h = a * (i + 1)
                d = rpc.rpc_sync(world.next, af.square, args=(h,))
                rpc.rpc_sync(world.next, af.mul_sin, args=(h, c))  # unused
                dist_autograd.backward(context_id, [d.sum()])
                grads = dist_autograd.get_gradients(context_id)
        done[i] = (a, c, grads)

    af.in_threads(worker, 4)
    for i, (a, c, grads) in done.items():
        _check(grads, af.square(a * (i + 1)).sum(), [a, c])


def test_callee_forwards_to_a_rank_whose_result_nobody_uses(world):
    """The callee sends the tensor on and drops the answer: the third rank of the chain is
    never reached by the backward pass, so only SMART mode's question reaches it."""
    (a,) = _seeded(world.rank, (4,))
    third = world.worker(world.rank + 2)
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync(world.next, af.forward_unused, args=(third, a.sin()))
        dist_autograd.backward(context_id, [y.sum()])
        grads = dist_autograd.get_gradients(context_id)
    _check(grads, (a.sin() * 3).sum(), [a])


@pytest.mark.world(min_size=3)
def test_unused_results_in_the_middle_of_a_chain_over_every_rank(world):
    (x,) = _seeded(world.rank, (3,))
    route = [world.worker(world.rank + k) for k in range(1, world.size + 1)]
    with dist_autograd.context() as context_id:
        y = af.chain_with_unused(route, x)
        dist_autograd.backward(context_id, [y.sum()])
        grads = dist_autograd.get_gradients(context_id)
    _check(grads, af.chain_local(route, x).sum(), [x])


@pytest.mark.world(min_size=3)
def test_unused_rpc_to_a_rank_the_pass_never_reaches(world):
    a, c = _seeded(world.rank, (3,), (3,))
    other = world.worker(world.rank + 2)
    with dist_autograd.context() as context_id:
        h = a * 2
        d = rpc.rpc_sync(world.next, af.square, args=(h,))
        rpc.rpc_sync(other, af.mul_sin, args=(h, c))  # unused, on a rank nothing else visits
        dist_autograd.backward(context_id, [d.sum()])
        grads = dist_autograd.get_gradients(context_id)
    _check(grads, af.square(a * 2).sum(), [a, c])


@pytest.mark.world(min_size=3)
def test_unfetched_remote_on_a_rank_the_pass_never_reaches(world):
    """``remote()`` sends ``h`` to a third rank whose value nobody fetches: no message of
    the backward pass ever reaches that rank, so only the root's question (the wave after
    the pass went quiet) can learn that its recv function will never fire."""
    a, b = _seeded(world.rank, (3,), (3,))
    third = world.worker(world.rank + 2)
    with dist_autograd.context() as context_id:
        h = a.cos()
        held = rpc.remote(third, af.mul_sin, args=(h, b))  # never fetched
        d = rpc.rpc_sync(world.next, af.square, args=(h,))
        dist_autograd.backward(context_id, [d.sum()])
        grads = dist_autograd.get_gradients(context_id)
        del held
    _check(grads, af.square(a.cos()).sum(), [a, b])
