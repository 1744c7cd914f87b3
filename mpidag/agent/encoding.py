"""How a call travels: a handler by name, a module-level function by a cached reference,
anything else pickled with its arguments (the format is in :mod:`mpidag.agent.messages`)."""

from __future__ import annotations

import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from mpidag.agent import fastpath
from mpidag.agent.handlers import Handler, Plugins, describe
from mpidag.agent.messages import (
    FLAG_FUNCTION_REF,
    FLAG_HANDLER,
    FLAG_PLAIN,
    FLAG_TENSOR_SLOTS,
    REF_LENGTH,
)
from mpidag.agent.peers import Peers
from mpidag.agent.sending import Sender
from mpidag.errors import RPCError, SerializationError, wrap_error
from mpidag.transport.frames import Envelope, is_plain

__all__ = ["CallCodec", "pickle_plain"]

#: types of callables whose calls may carry a cached reference instead of a pickle
_REF_TYPES = frozenset({types.FunctionType, types.BuiltinFunctionType, Handler})

#: ``load(payload, env)``: unpickle a call's arguments (the server's, with its hook)
Loader = Callable[[bytes | memoryview, Envelope], Any]

#: the compiled path's writer of plain values (``None`` where it is not built)
_plain_pickle = getattr(fastpath.compiled_module(), "plain_pickle", None)


def pickle_plain(value: Any) -> bytes:
    """The pickle of a plain value (see :func:`mpidag.transport.frames.is_plain`) as both
    call paths write it: by the compiled path's writer where it is built (no 4 KiB buffer
    per call, see ``fastpath.c``), else by :func:`pickle.dumps`; either way
    :func:`pickle.loads` reads it.

    Example::

        >>> pickle.loads(pickle_plain(((1, "a", None), {})))
        ((1, 'a', None), {})
    """
    if _plain_pickle is not None:
        written = _plain_pickle(value)
        if written is not None:
            return written
    return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)


class CallCodec:
    """Encodes calls on the caller (:meth:`encode`) and decodes them on the callee
    (:meth:`decode`), with a table of function references on each side.

    Example::

        >>> codec = runtime.agent.calls.codec
        >>> payload, tensors, flags = codec.encode(1, torch.add, (torch.ones(2), 1), {})
        >>> flags == FLAG_FUNCTION_REF, len(tensors)
        (True, 1)
    """

    def __init__(self, sender: Sender, peers: Peers, plugins: Plugins) -> None:
        self.sender = sender
        self.peers = peers
        self.plugins = plugins
        #: function or handler -> (payload prefix, flag) of calls of it (see _prefix; the
        #: compiled call path reads this table too)
        self.prefixes: dict[Any, tuple[bytes, int]] = {}
        #: payload prefix -> (function, its module's namespace or None, its name) (the
        #: compiled call path reads this table too)
        self.targets: dict[bytes, tuple[Callable, dict | None, str]] = {}

    def encode(self, dst: int, func: Callable, args: tuple, kwargs: dict
               ) -> tuple[bytes | memoryview, list[torch.Tensor], int]:
        """``(payload, tensors, flags)`` of a call of ``func`` for rank ``dst``."""
        try:
            prefix = None
            if type(func) in _REF_TYPES:
                prefix = self.prefixes.get(func) or self._prefix(func)
            if prefix is not None:
                ref, flags = prefix
                if not kwargs and is_plain(args):
                    if not args:
                        return ref, [], flags | FLAG_PLAIN
                    return ref + pickle_plain((args, kwargs)), [], flags | FLAG_PLAIN
                payload, tensors = self.sender.dumps_for(dst, (args, kwargs), (func, args), ref)
                return payload, tensors, flags
            payload, tensors = self.sender.dumps_for(dst, (func, args, kwargs), (func, args))
            return payload, tensors, 0
        except Exception as exc:
            raise SerializationError(
                f"could not pickle the call of {describe(func)} for {self.peers.name(dst)}: "
                f"{exc}. Arguments and the function must be picklable (define functions at "
                f"module level; no lambdas, locks, open files or generators)."
            ) from exc

    def _prefix(self, func: Any) -> tuple[bytes, int] | None:
        """The payload prefix of calls of ``func`` and its flag, or ``None`` when ``func``
        must travel pickled with each call (kept in a table by function)."""
        if isinstance(func, Handler):
            ref, flag = func.name.encode(), FLAG_HANDLER
        else:
            owner = getattr(func, "__self__", None)  # builtins: a module, or a bound object
            if "<" in func.__qualname__ or not (
                    owner is None or isinstance(owner, types.ModuleType | type)):
                return None  # lambdas, local functions, methods of objects
            try:
                ref = pickle.dumps(func, pickle.HIGHEST_PROTOCOL)
            except Exception:
                return None  # the full pickle raises the error the user sees
            flag = FLAG_FUNCTION_REF
        prefix = (REF_LENGTH.pack(len(ref)) + ref, flag)
        self.prefixes[func] = prefix
        return prefix

    def _resolve(self, prefix: bytes, flags: int) -> Callable:
        """The function or handler a call's payload prefix names (a table lookup after the
        first call; a module-level name is checked against its module on every call, so a
        function replaced in its module is found again)."""
        entry = self.targets.get(prefix)
        if entry is not None:
            func, namespace, name = entry
            if namespace is None or namespace.get(name) is func:
                return func
        if flags & FLAG_HANDLER:
            func, namespace, name = self.plugins.named(prefix[2:].decode()), None, ""
        else:
            func = pickle.loads(prefix[2:])
            module = sys.modules.get(getattr(func, "__module__", None) or "")
            name = getattr(func, "__qualname__", "")
            namespace = vars(module) if module is not None and "." not in name else None
            if namespace is not None and namespace.get(name) is not func:
                namespace = None
        self.targets[prefix] = (func, namespace, name)
        return func

    def decode(self, env: Envelope, load: Loader) -> tuple[Callable, tuple, dict]:
        """``(func, args, kwargs)`` of a received call or notification; an error that says
        what the callee could not unpickle and what to do."""
        try:
            flags = env.flags
            if flags & (FLAG_HANDLER | FLAG_FUNCTION_REF):
                payload = env.payload
                end = 2 + (payload[0] | payload[1] << 8)
                func = self._resolve(bytes(payload[:end]), flags)
                if len(payload) == end:
                    return func, (), {}
                if flags & FLAG_TENSOR_SLOTS:  # (sent by the compiled path)
                    holes, kwargs, slots = pickle.loads(payload[end:])
                    tensors = env.tensors
                    return func, tuple(item if slot < 0 else tensors[slot]
                                       for item, slot in zip(holes, slots, strict=True)), kwargs
                args, kwargs = load(payload[end:], env)
                return func, args, kwargs
            func, args, kwargs = load(env.payload, env)
        except RPCError:
            raise
        except Exception as exc:
            detail = (f"could not unpickle a call from {self.peers.name(env.src)} on "
                      f"{self.peers.where()}: {exc}. The function and the classes of its "
                      f"arguments must be importable on the callee (defined at module level "
                      f"in a module every rank imports).")
            if isinstance(exc, AttributeError | ImportError):  # torch's RuntimeError text
                raise wrap_error(exc, f"{exc}. Default RPC pickler does not serialize "
                                      f"function code. Ensure that UDFs are defined on both "
                                      f"caller and callee modules: {detail}") from exc
            try:
                raise type(exc)(detail) from exc
            except TypeError:  # an exception type whose __init__ takes other arguments
                raise SerializationError(detail) from exc
        return func, args or (), kwargs or {}
