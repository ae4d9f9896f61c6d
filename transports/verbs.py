"""The ``verbs`` transport: the data path over RDMA verbs (a real NIC or soft-RoCE ``rxe``).

Control plane on pyverbs (rdma-core): the device context, the protection domain, memory regions
with only the remote access each needs, a completion channel, CQs, one shared receive queue, RC
queue pairs, and rdma_cm for connection setup.  Data plane in C (``native/edgepath_verbs.c``):
posting a work request and waiting for its completion, and polling the receive CQ, are one cffi
call each, so an operation costs one Python-to-C crossing.

This module owns the endpoint's resources; the work is split by concern:

- :mod:`edgepath.transports.verbs_datapath`: regions, the connection's operations, the receive CQ;
- :mod:`edgepath.transports.verbs_setup`: the rdma_cm handshake and hello exchange (listen, connect);
- :mod:`edgepath.transports.verbs_shim`: the raw C handles of pyverbs objects the C code needs.

WRITE_WITH_IMM completions of all connections arrive on one receive CQ (with a completion channel
for ``fileno``/``arm``) fed by one SRQ whose receive WRs are reposted by the C poller; completions
carry the QP number, mapped here to this side's connection id.  Each connection has its own small
send CQ that only its caller polls (operations are synchronous).

Atomics: remote CAS goes through the NIC (``IBV_WR_ATOMIC_CMP_AND_SWP``).  On ``rxe``
(ATOMIC_HCA) a NIC atomic is atomic only against other NIC atomics.  The slot server's own
transitions are CPU CASes on the same words; that is safe because a remote CAS only ever succeeds
from FREE, and the server never writes a FREE word (it moves its own CLAIMED/READY/RUNNING/DONE
words only).

Peer memory cannot be mapped locally over verbs: :meth:`VerbsConnection.local_view` refuses.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from typing import Any

import numpy as np

from edgepath.transports.base import (
    DEFAULT_HANG_TIMEOUT,
    Access,
    MemoryRegion,
    Transport,
    TransportUnavailable,
    check_buffer,
)
from edgepath.transports.peer_auth import HANDSHAKE_TIMEOUT, PeerKeys
from edgepath.transports.verbs_datapath import (
    VerbsConnection,
    VerbsCQ,
    VerbsDeviceRegion,
    VerbsRegion,
    ibv_access,
    op_timeout_ns,
)
from edgepath.transports.verbs_setup import VerbsListener, connect
from edgepath.transports.verbs_shim import comp_channel_handle, context_handle, cq_handle, srq_handle

__all__ = [
    "NO_DEVICE",
    "VerbsCQ",
    "VerbsConnection",
    "VerbsDeviceRegion",
    "VerbsListener",
    "VerbsRegion",
    "VerbsTransport",
]

log = logging.getLogger("edgepath.verbs")

NO_DEVICE = (
    "verbs transport: no RDMA device found ({why}); use --data-path loopback, or create a soft-RoCE device "
    "(modprobe rdma_rxe; rdma link add rxe0 type rxe netdev <netdev>)"
)


class VerbsTransport(Transport):
    """An endpoint on one RDMA device (``device``, default the first); ``keys``: the peer secrets every peer must
    prove it holds (:mod:`edgepath.transports.peer_auth`); ``gid_index`` is checked to exist (rdma_cm picks the GID
    from the IP address of each connection); ``hang_timeout``: the one its peers are judged by, which bounds how long
    one operation waits (:func:`op_timeout_ns`); ``handshake_timeout``: seconds a peer has to finish proving it."""

    name = "verbs"

    def __init__(
        self,
        keys: PeerKeys,
        device: str | None = None,
        gid_index: int | None = None,
        port: int = 1,
        recv_depth: int = 1024,
        cq_entries: int = 4096,
        hang_timeout: float = DEFAULT_HANG_TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self.keys = keys
        self.handshake_timeout = handshake_timeout
        self.op_timeout_ns = op_timeout_ns(hang_timeout)
        try:
            from pyverbs import device as d
            from pyverbs.cq import CQ, CompChannel
            from pyverbs.pd import PD
            from pyverbs.pyverbs_error import PyverbsError
            from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr
        except ImportError as exc:
            raise TransportUnavailable(
                f"verbs transport: pyverbs is not importable ({exc}); apt-get install python3-pyverbs and use "
                "/usr/bin/python3 (or a venv made with --system-site-packages), or use --data-path loopback"
            ) from exc
        try:
            names = [dev.name.decode() for dev in d.get_device_list()]
        except PyverbsError as exc:
            raise TransportUnavailable(NO_DEVICE.format(why=exc)) from exc
        if not names:
            raise TransportUnavailable(NO_DEVICE.format(why="the device list is empty"))
        self.device = device or names[0]
        if self.device not in names:
            raise TransportUnavailable(
                NO_DEVICE.format(why=f"no device named {self.device!r}; this machine has {', '.join(names)}")
            )
        self.ctx = d.Context(name=self.device)
        self.ctx_ptr = context_handle(self.ctx, self.ctx.cmd_fd)
        attr = self.ctx.query_device()
        if attr.atomic_caps == 0:
            raise TransportUnavailable(f"verbs transport: {self.device} has no remote atomics (needed for claims)")
        self.port = port
        if gid_index is not None:
            gid = str(self.ctx.query_gid(port, gid_index))
            if gid.replace("0", "").replace(":", "") == "":
                raise TransportUnavailable(
                    f"verbs transport: {self.device} port {port} has no GID at index {gid_index}"
                )
        self.gid_index = gid_index
        self.pd = PD(self.ctx)
        self.cc = CompChannel(self.ctx)
        self.channel_ptr = comp_channel_handle(self.cc, self.ctx_ptr)
        self.rcq = CQ(self.ctx, cq_entries, None, self.cc, 0)
        self.rcq_ptr = cq_handle(self.rcq, self.ctx_ptr, self.rcq.cqe)
        self.srq = SRQ(self.pd, SrqInitAttr(SrqAttr(max_wr=recv_depth, max_sge=1)))
        self.srq_ptr = srq_handle(self.srq, self.ctx_ptr)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.connections: dict[int, VerbsConnection] = {}
        #: QP number -> connection id, replaced (never mutated) so the CQ reads it without a lock
        self.conn_by_qpn: dict[int, int] = {}
        self.cq = VerbsCQ(self, recv_depth)
        self._regions: list[VerbsRegion] = []
        self._listeners: list[VerbsListener] = []
        # What a QP lets its peer do once the peer has proved it holds the peer secret (before, nothing): READ (of
        # a connector's hello) and what some registered region grants; MRs narrow it per region.
        self.qp_access = ibv_access(Access.REMOTE_READ)

    def next_id(self) -> int:
        """A fresh connection id (the tag the peer's completions carry, a slot server's claimant id)."""
        with self._lock:
            return next(self._ids)

    def track(self, conn: VerbsConnection) -> None:
        """Route ``conn``'s receive completions to it and close it with the transport."""
        with self._lock:
            self.connections[conn.conn_id] = conn
            self.conn_by_qpn = {**self.conn_by_qpn, conn.qp.qp_num: conn.conn_id}

    def _forget(self, conn: VerbsConnection) -> None:
        with self._lock:
            self.connections.pop(conn.conn_id, None)
            self.conn_by_qpn = {q: c for q, c in self.conn_by_qpn.items() if c != conn.conn_id}

    def register(self, name: str, length: int, access: Access, buffer: np.ndarray | None = None) -> VerbsRegion:
        """Allocate and register ``length`` bytes, or register ``buffer`` (memory someone else owns,
        e.g. the agent's frames, shared with edges) as it is: the NIC reads and writes it in place."""
        if buffer is None:
            if length <= 0:
                raise ValueError(f"region {name!r}: length must be positive, got {length}")
        else:
            check_buffer(name, length, buffer)
        # The QP must allow every kind of remote access some region grants; MRs then restrict it.
        self.qp_access |= ibv_access(access)
        if buffer is None:
            region = VerbsRegion.allocate(self.pd, name, length, access)
        else:
            region = VerbsRegion.register(self.pd, name, buffer, access, keep=buffer)
        self._regions.append(region)
        return region

    def register_device(
        self, name: str, memory: Any, access: Access, offset: int = 0, length: int | None = None
    ) -> VerbsDeviceRegion:
        """Register GPU memory -- ``length`` bytes (default: the rest) from byte ``offset`` -- for peers to access as
        ``access`` allows: ``memory`` is a :class:`edgepath.slots.gpu.DeviceSlots`, whose ``register_for_rdma``
        tries dma-buf first and nvidia-peermem as the logged fallback (``RdmaRegistrationError`` naming both)."""
        length = int(memory.nbytes) - offset if length is None else length
        self.qp_access |= ibv_access(access)
        mr, how = memory.register_for_rdma(self.pd, ibv_access(access), offset, length)
        # pyverbs' DmaBufMR registers with iova = its offset into the dma-buf; peermem, at the pointer.
        addr = int(mr.offset) if how == "dma-buf" else int(memory.address) + offset
        region = VerbsDeviceRegion(name, length, access, mr, addr, how)
        self._regions.append(region)
        log.info("%s: %d bytes of GPU memory registered through %s", name, region.length, how)
        return region

    def listen(self, address: str, exports: list[MemoryRegion], info: dict[str, Any]) -> VerbsListener:
        listener = VerbsListener(self, address, exports, info)
        self._listeners.append(listener)
        return listener

    def connect(
        self, address: str, exports: list[MemoryRegion], info: dict[str, Any], timeout: float = 5.0
    ) -> VerbsConnection:
        return connect(self, address, exports, info, timeout)

    def close(self) -> None:
        for conn in list(self.connections.values()):
            conn.close()
        for listener in self._listeners:
            listener.close()
        for region in self._regions:
            with contextlib.suppress(Exception):
                region.close()
        self.cq.close()
        for obj in (self.srq, self.rcq, self.cc, self.pd, self.ctx):
            with contextlib.suppress(Exception):
                obj.close()
