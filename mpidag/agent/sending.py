"""Sending: pickling for a destination, device maps, and the per-peer message counters."""

from __future__ import annotations

from typing import Any

import torch

from mpidag.agent.fastpath import make_counters
from mpidag.agent.handlers import detaches_parameters
from mpidag.agent.peers import Peers
from mpidag.errors import WorkerFailedError
from mpidag.transport.base import Transport
from mpidag.transport.frames import Codecs, Envelope, dumps

__all__ = ["DeviceMaps", "Sender"]

#: device_maps[src_name][dst_name] = {src_device: dst_device}, for every rank
DeviceMaps = dict[str, dict[str, dict[torch.device, torch.device]]]


class Sender:
    """Every message this rank sends goes through here and is counted, per peer.

    The counts (sent to each rank, received from each and finished handling) are what the
    shutdown's termination test adds up (:mod:`mpidag.agent.quiescence`); a failed rank's
    counts are left out of it.

    Example::

        >>> sender = runtime.agent.sender
        >>> before = sender.sent
        >>> runtime.agent.notify(1, time.sleep, (0,))     # one message to worker1
        >>> sender.sent - before
        1
    """

    def __init__(self, transport: Transport, peers: Peers, device_maps: DeviceMaps,
                 codecs: Codecs, compiled: bool = True) -> None:
        self.transport = transport
        self.peers = peers
        self.device_maps = device_maps
        self.codecs = codecs
        #: sent to each rank and handled from each: the compiled call path's counters
        #: (atomic under the GIL, shared with it) or their Python twin
        self.counters = make_counters(peers.world_size, compiled)

    # ------------------------------------------------------------- devices
    def devices_for(self, dst: int, tensors: list[torch.Tensor], reply: bool) -> list[str]:
        """Where each tensor lands on ``dst``: CPU stays CPU, CUDA follows the device map.

        Requests use the sender's map to ``dst``; replies use the inverse of ``dst``'s map
        to this rank (torch's rule).
        """
        if not tensors:
            return []
        out: list[str] = []
        mapping: dict[torch.device, torch.device] | None = None
        for t in tensors:
            if t.device.type == "cpu":
                out.append("cpu")
                continue
            if mapping is None:
                mapping = self._map_to(dst, reply)
            target = mapping.get(t.device)
            if target is None:
                dst_name = self.peers.name(dst)
                raise ValueError(
                    f"cannot send a tensor on {t.device} to {dst_name}: no device map entry "
                    f"for {t.device} (map: {mapping or 'none'}). Call "
                    f"options.set_device_map({dst_name!r}, {{{t.device.index}: <device>}}) "
                    f"before init_rpc, or move the tensor to the CPU first."
                )
            out.append(str(target))
        return out

    def _map_to(self, dst: int, reply: bool) -> dict[torch.device, torch.device]:
        me, peer = self.peers.info.name, self.peers.name(dst)
        if not reply:
            return self.device_maps.get(me, {}).get(peer, {})
        forward = self.device_maps.get(peer, {}).get(me, {})
        return {v: k for k, v in forward.items()}

    # ------------------------------------------------------------- pickling
    def dumps_for(self, dst: int, obj: Any, call: tuple[Any, tuple] | None = None,
                  prefix: bytes = b"") -> tuple[bytes | memoryview, list[torch.Tensor]]:
        """Pickle ``obj`` for rank ``dst`` (the ``context`` the codecs' reduce functions see:
        RRefs fork for their destination). ``call``: the ``(func, args)`` whose arguments or
        result this is (how parameters travel, see :func:`detaches_parameters`).
        ``prefix``: bytes that start the payload."""
        if call is None:
            return dumps(obj, codecs=self.codecs, prefix=prefix, context=dst)
        return dumps(obj, lambda: detaches_parameters(*call), self.codecs, prefix, dst)

    # ------------------------------------------------------------- sending
    def send(self, dst: int, env: Envelope, reply: bool) -> None:
        """Send ``env`` to ``dst`` (counted); a failed ``dst`` raises its
        ``WorkerFailedError``."""
        devices = self.devices_for(dst, env.tensors, reply)
        self.counters.sent(dst)
        try:
            self.transport.send(dst, env, devices)
        except BaseException as exc:
            self.counters.unsent(dst)
            if isinstance(exc, WorkerFailedError):
                raise self.peers.failed_error(dst) from None
            raise

    def send_answer(self, request: Envelope, reply: Envelope, devices: list[str]) -> bool:
        """Send the answer to ``request``: the request counts as handled once its answer
        is on its way. Returns false when the caller died meanwhile (nobody to answer)."""
        src = request.src
        self.counters.answered(src)
        try:
            self.transport.send(src, reply, devices)
        except WorkerFailedError:
            return False
        return True

    def mark_processed(self, src: int) -> None:
        """A message from ``src`` is handled (one that needed no answer, or answered
        through :meth:`send`)."""
        self.counters.processed(src)

    # ------------------------------------------------------------- counts
    @property
    def sent(self) -> int:
        """Messages this rank sent."""
        return self.counters.sent_total

    @property
    def processed(self) -> int:
        """Messages this rank received and finished handling."""
        return self.counters.processed_total

    def totals(self) -> tuple[int, int]:
        """``(sent, processed)`` with the failed ranks' messages left out."""
        return self.counters.totals(self.peers.failed)
