"""Functions the RPC tests call remotely (module level, so they pickle by reference)."""

from __future__ import annotations

import threading
import time

import torch

import mpidag.rpc as rpc


def add(a, b):
    return a + b


def identity(x):
    return x


def noop():
    return None


def whoami():
    return rpc.get_worker_info().name


def raise_value_error(msg):
    raise ValueError(msg)


class CustomError(Exception):
    def __init__(self, code, detail):
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


def raise_custom(code):
    raise CustomError(code, "custom detail")


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


_RELEASED_LOCK = threading.Lock()


def _release_event(key):
    """This rank's event for ``key`` (per rank: in-process ranks share this module)."""
    from tests.contract.harness import rank_state

    released = rank_state("rpc_funcs.released", dict)
    with _RELEASED_LOCK:
        return released.setdefault(key, threading.Event())


def wait_for_release(key, value, limit=60.0):
    """Block until :func:`release` is called with ``key`` on this rank (at most ``limit`` s),
    then return ``value``: a call that cannot finish before the test says so."""
    _release_event(key).wait(limit)
    return value


def release(key):
    """Let every :func:`wait_for_release` call waiting on ``key`` on this rank return."""
    _release_event(key).set()
    return True


def nested_add(via, a, b):
    """Called on one rank, forwards the work to ``via`` with a nested rpc_sync."""
    return rpc.rpc_sync(via, add, args=(a, b), timeout=30) + 1


def call_back_to(origin, depth):
    """A -> B -> A -> ... cycles of nested calls, ``depth`` hops deep."""
    me = rpc.get_worker_info().name
    if depth == 0:
        return [me]
    return [me] + rpc.rpc_sync(origin, call_back_to, args=(me, depth - 1), timeout=30)


@rpc.functions.async_execution
def async_add_chained(to, x, y, z):
    return rpc.rpc_async(to, add, args=(x, y), timeout=30).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def async_fail(to):
    return rpc.rpc_async(to, raise_value_error, args=("inner failure",), timeout=30)


@rpc.functions.async_execution
def async_not_a_future():
    return 42


def return_unpicklable():
    return threading.Lock()


def checksum(t):
    return float(t.double().sum()), tuple(t.shape), str(t.dtype), t.is_contiguous()


def describe_tensors(obj):
    """Shapes, dtypes and the identity structure of tensors in a nested structure."""
    a, b, c = obj["a"], obj["b"], obj["nested"][0]
    return {"same": a is c, "shapes": [tuple(a.shape), tuple(b.shape)],
            "requires_grad": [a.requires_grad, b.requires_grad]}


def big_tensor_check(t):
    """Return only a digest of a huge tensor (avoid echoing gigabytes)."""
    return t.numel(), float(t[:: 1 << 20].double().sum()), float(t[-1]), t.dtype


def make_big(nbytes):
    return torch.arange(nbytes // 4, dtype=torch.int32)


class Interrupted(BaseException):
    """A BaseException that is not an Exception (as KeyboardInterrupt, GeneratorExit)."""


def raise_system_exit(code):
    raise SystemExit(code)


def raise_base_exception(msg):
    raise Interrupted(msg)


def payload_digest(obj):
    """What a large payload looks like on arrival: its type, length and sampled bytes."""
    import numpy as np

    view = np.frombuffer(memoryview(obj).cast("B"), dtype=np.uint8)
    return type(obj).__name__, view.size, int(view[:: 1 << 20].astype(np.int64).sum()), \
        int(view[-1])


def make_large_payload(kind, nbytes):
    import numpy as np

    values = np.resize(np.arange(251, dtype=np.uint8), nbytes)  # 0..250 repeated
    return values.tobytes() if kind == "bytes" else values


class Adder:
    """An object whose bound method is called remotely (travels pickled with the call)."""

    def __init__(self, base):
        self.base = base

    def plus(self, x):
        return self.base + x


class TwoArgumentError(Exception):
    """An exception that pickle cannot rebuild (its __init__ takes two arguments)."""

    def __init__(self, flag, msg):
        self.flag = flag
        super().__init__(msg)


def raise_two_argument_error():
    raise TwoArgumentError(True, "built with two arguments")


def same_object(a, b):
    """Whether the callee got one object for ``a`` and ``b`` (a tensor passed twice)."""
    return a is b


def grad_flags(*tensors):
    """The ``requires_grad`` flags of the tensors the callee got."""
    return tuple(t.requires_grad for t in tensors)


def ids_and_total(ids, *tensors):
    """The ids as the callee got them, then the sum of the tensors, in one flat tuple (a
    batched gradient message carries a tuple of ids beside its gradients)."""
    return (*ids, float(sum(t.sum() for t in tensors)))
