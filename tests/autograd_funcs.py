"""Functions the distributed autograd tests call over RPC (importable on every rank).

Each one is also called locally by the tests, to compute the same thing with plain autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import mpidag.autograd as dist_autograd
import mpidag.rpc as rpc


def my_add(t1, t2):
    return torch.add(t1, t2)


def mul_sin(x, w):
    return (x * w).sin()


def square(x):
    return x * x


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t ** 3

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        return 3 * t * t * g


#: on the callee: ``key -> (strides, shape)`` of the gradient that reached a
#: :func:`double_seeing_gradient` output (in-process ranks share it: keys name the caller)
SEEN_GRADIENTS: dict = {}


def double_seeing_gradient(x, key):
    """``x * 2``, whose gradient's strides and shape a tensor hook keeps under ``key``."""
    y = x * 2
    y.register_hook(lambda g: SEEN_GRADIENTS.__setitem__(key, (g.stride(), tuple(g.shape))))
    return y


def seen_gradient(key):
    return SEEN_GRADIENTS.pop(key, None)


def cube_inplace(x):
    """A custom Function, and in-place ops on a received (non-leaf) tensor."""
    x.mul_(2)
    y = Cube.apply(x)
    y.add_(1)
    return y


@dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


def containers(d):
    """Tensors inside dicts, lists and dataclasses, both ways."""
    pair = d["pair"]
    return {"out": [pair.first * d["scale"][0], Pair(pair.second.exp(), d["scale"][1] * 3)]}


def chain(route, x):
    """Nested calls: square here, then pass the rest of the route on (may come back here)."""
    y = square(x) + 1
    if not route:
        return y
    return rpc.rpc_sync(route[0], chain, args=(route[1:], y)) * 2


def chain_local(route, x):
    y = square(x) + 1
    return y if not route else chain_local(route[1:], y) * 2


def call_back(caller, x):
    """A -> B -> A: the callee calls back into the caller while the first call waits."""
    y = x.tanh()
    return rpc.rpc_sync(caller, square, args=(y,)) + y


def call_back_local(x):
    y = x.tanh()
    return square(y) + y


class Linear2(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 5)
        self.b = torch.nn.Linear(5, 3)
        # a private generator: the global one is shared with the other threads of the rank
        # (a remote and a local copy built at once would interleave their draws)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.rand(param.shape, generator=gen) - 0.5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def make_module(seed):
    return Linear2(seed)


def module_state(rref):
    return {k: v.detach().clone() for k, v in rref.local_value().state_dict().items()}


def module_grads(rref, context_id):
    """On the owner: the context's gradients of the module's parameters, by name."""
    grads = dist_autograd.get_gradients(context_id)
    module = rref.local_value()
    return {name: grads[p].clone() for name, p in module.named_parameters() if p in grads}


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 1

    @staticmethod
    def backward(ctx, g):
        raise ValueError("backward of FailingBackward failed on purpose")


def fails_in_backward(x):
    return FailingBackward.apply(x)


def leaf_on_owner(seed):
    gen = torch.Generator().manual_seed(seed)  # not the global one: calls run in threads
    return torch.rand((3, 3), generator=gen, requires_grad=True)


def context_gradients(context_id):
    """On a remote rank: its gradients in the context, as a list of (value, grad)."""
    grads = dist_autograd.get_gradients(context_id)
    return [(t.detach().clone(), g.clone()) for t, g in grads.items()]


PARAM = torch.nn.Parameter(torch.linspace(1.0, 2.0, 3))


def get_param():
    """Returns a Parameter itself (torch RPC sends it detached: a new leaf on the caller)."""
    return PARAM


def param_rref():
    """An RRef of the Parameter itself (torch: a tensor-typed RRef, fetched attached)."""
    return rpc.RRef(PARAM)


def is_parameter_leaf(x):
    """On the callee: what a Parameter argument arrived as."""
    return isinstance(x, torch.nn.Parameter) and x.is_leaf


def param_gradient(context_id):
    from mpidag import autograd as dist_autograd

    return dist_autograd.get_gradients(context_id).get(PARAM)


class TaggedTensor(torch.Tensor):
    """A tensor subclass with an attribute of its own (as users write for units, masks...)."""


def tagged(t, tag):
    out = t.as_subclass(TaggedTensor)
    out.tag = tag
    return out


def scale_tagged(t, factor):
    """On the callee: check the argument arrived as the subclass with its attribute, and
    return a subclass instance computed from it (gradients must flow both ways)."""
    if type(t) is not TaggedTensor or getattr(t, "tag", None) != "metres":
        raise TypeError(f"expected a TaggedTensor tagged 'metres', got {type(t).__name__} "
                        f"{getattr(t, '__dict__', {})}")
    return tagged(t * factor, "scaled")


def chain_with_unused(route, x):
    """``chain`` whose every hop also makes an RPC of the same input that nothing uses
    (SMART mode: the middle of a chain over several ranks holds a dead send function)."""
    y = square(x) + 1
    if not route:
        return y
    rpc.rpc_sync(route[0], mul_sin, args=(y, y))  # result dropped on purpose
    return rpc.rpc_sync(route[0], chain_with_unused, args=(route[1:], y)) * 2


def forward_unused(to, x):
    """On the callee: send ``x`` on to ``to`` and drop the result; return ``x * 3``."""
    rpc.rpc_sync(to, square, args=(x,))
    return x * 3


def in_threads(worker, n: int) -> None:
    """Run ``worker(i)`` for i in range(n), each in its own thread; raise the first error.
    Each thread acts as the caller's rank (in-process ranks: the caller's runtime)."""
    import threading

    from mpidag import _runtime

    errors: list[BaseException] = []
    runtime = _runtime.current_or_none()

    def guarded(i: int) -> None:
        _runtime.bind_thread(runtime)
        try:
            worker(i)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller
            errors.append(exc)
        finally:
            _runtime.bind_thread(None)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def embedding_lookup(rref, indices):
    """On the owner of an ``nn.Embedding`` RRef: the embedding of ``indices``."""
    return rref.local_value()(indices)


def embedding_weight_and_gradient(rref, context_id):
    """On the owner: the embedding's weight and its gradient in the context (sparse)."""
    weight = rref.local_value().weight
    return weight.detach().clone(), dist_autograd.get_gradients(context_id)[weight]


def build_sparse(coalesce: bool = False, requires_grad: bool = False) -> torch.Tensor:
    """torch's dist_autograd_test ``build_sparse_tensor`` (uncoalesced unless asked)."""
    tensor = torch.sparse_coo_tensor([[0, 1, 1], [2, 0, 2]], [3.2, 4.1, 5.3], (3, 3),
                                     requires_grad=requires_grad)
    return tensor.coalesce() if coalesce else tensor


def sparse_pair(d: dict) -> dict:
    """Runs on another rank: sparse tensors inside containers, both ways."""
    a, b = d["pair"]
    return {"sum": [a + b], "flags": (a.is_coalesced(), b.is_coalesced())}


def fetch_doubled(rref):
    """Runs on another rank: fetches a sparse value through that rank's RRef layer."""
    return rref.to_here() * 2


def embedding_bag_forward(rref, indices, offsets, weights):
    """Runs on the embedding's owner (torch's ``_call_remote_embedding``)."""
    return rref.local_value()(indices, offsets, weights)


def gradient_of_weight(rref, context_id) -> torch.Tensor:
    """Runs on the embedding's owner: its weight's gradient in the context (torch's
    ``_get_grad``)."""
    return dist_autograd.get_gradients(context_id)[rref.local_value().weight]


def weight_of(rref) -> torch.Tensor:
    """Runs on the owner: a copy of the embedding's weight."""
    return rref.local_value().weight.detach().clone()
