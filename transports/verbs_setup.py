"""Connection setup for the verbs transport: the rdma_cm handshake (RDMA_PS_TCP, external QPs) and
the hello exchange that tells each side the other's exports.

1. The connecting side creates its QP, publishes a *hello* (its exports and info, JSON) in a region
   peers may only READ, and connects; the rdma_cm private data (56 bytes at most) carries a magic,
   its connection id and the hello's address, rkey and length.
2. The accepting side moves its QP to RTS, accepts (private data: magic, its connection id, its own
   hello's address, rkey and capacity), waits for ESTABLISHED, RDMA READs the connector's hello,
   runs ``admit(conn)`` and only then writes its own hello (exports, info, or a refusal) and sets
   its ready word last.
3. The connecting side RDMA READs the acceptor's hello header until the ready word is set, then
   reads the rest.  ``connect`` returns only then, so a connection is never used before the
   acceptor has admitted it.

Each connection's rdma_cm id has an event channel of its own (accepted ids are migrated to one),
whose descriptor is the connection's ``fileno``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepath.transports.base import Access, Admit, Listener, MemoryRegion, RemoteRegion, TransportError
from edgepath.transports.verbs_datapath import (
    CTL_HEADER,
    HELLO_CAP,
    VerbsConnection,
    VerbsRegion,
    cm_event_nowait,
    own_regions,
)
from edgepath.transports.verbs_shim import cm_channel_fd, cm_id_handle, lib, raw_handle

if TYPE_CHECKING:
    from edgepath.transports.verbs import VerbsTransport

log = logging.getLogger("edgepath.verbs")

_MAGIC = b"EPv1"
_CONNECT_PDATA = struct.Struct("<4sIQII")  # magic, conn id, hello addr, hello rkey, hello length
_ACCEPT_PDATA = struct.Struct("<4sIQII")  # magic, conn id, hello addr, hello rkey, hello capacity
_HELLO_HEADER = 8  # u32 length | u32 state, written last by the acceptor
_ACCEPTED, _REFUSED = 1, 2


def split_address(address: str) -> tuple[str, int]:
    """``IP:PORT`` as (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"verbs address {address!r} is not IP:PORT")
    return host, int(port)


def _event(channel: Any, fd: int, timeout: float) -> Any | None:
    """The next rdma_cm event on ``channel`` (non-blocking fd), or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        ev = cm_event_nowait(channel)
        if ev is not None:
            return ev
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        select.select([fd], [], [], left)


def _expect(channel: Any, fd: int, wanted: int, timeout: float, doing: str) -> Any:
    """Wait for event ``wanted``; anything else (REJECTED, UNREACHABLE, ...) is a setup failure."""
    ev = _event(channel, fd, timeout)
    if ev is None:
        raise TransportError(f"{doing}: no rdma_cm event within {timeout:.1f} s")
    if ev.event_type != wanted:
        name = ev.event_str()
        ev.ack_cm_event()
        raise TransportError(f"{doing}: rdma_cm reported {name}")
    return ev


#: The RC ACK timeout exponent set at RTR -> RTS (4.096 us x 2^14 = 67 ms; it cannot change in RTS). rdma_cm
#: picks 19 (2.1 s) here, which makes every lost packet cost 2.1 s and outlasts the slot server's 1 s lease,
#: so a retransmitted doorbell arrives after its slot was reclaimed (docs/VERBS.md, "Two hosts on a wire").
ACK_TIMEOUT = 14
#: Retransmissions of an unacknowledged packet before the work request fails (RETRY_EXC_ERR), set at
#: RTR -> RTS: 6, not the 7 rdma_cm is usually given, because rxe treats a retry count of 7 like an RNR
#: retry count of 7 -- for ever (``rxe_completer``: ``if (qp->comp.retry_cnt != 7) qp->comp.retry_cnt--``).
#: With 7 an operation to a peer that is gone never fails (it waited out the data plane's 4 s instead) and
#: stays queued after that wait, to run when the wire is back.  6 x 67 ms: a silent peer fails an operation in
#: about 0.5 s on rxe and on a hardware NIC alike (docs/VERBS.md, "A peer that is gone").
RETRY_COUNT = 6


def _conn_param(qp_num: int, private: bytes) -> Any:
    from pyverbs.cmid import ConnParam

    param = ConnParam(
        resources=16, depth=16, retry=RETRY_COUNT, rnr_retry=7, srq=1, qp_num=qp_num, data_len=len(private)
    )
    param.set_private_data(private)
    return param


def _modify(conn: VerbsConnection, state: int) -> None:
    from pyverbs import enums as e

    attr, mask = conn.cmid.init_qp_attr(state)
    if state == e.IBV_QPS_INIT:
        attr.qp_access_flags = conn.transport.qp_access
    elif state == e.IBV_QPS_RTS:
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_COUNT  # an acceptor's comes from the connector's request: set it on both sides
        mask |= e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT
    conn.qp.modify(attr, mask)


#: READs of a peer's hello before it is called malformed: a hello is written once, before it is offered, so a READ
#: that does not parse and a later one that does can only be the transfer's fault -- seen once in the soft-RoCE
#: lane (2026-12-07, rxe: a hello whose JSON broke off at byte 256; not reproduced); each such READ is logged
HELLO_READS = 3


def _read_hello(conn: VerbsConnection, addr: int, rkey: int, length: int) -> dict[str, Any]:
    if not 0 < length <= HELLO_CAP:
        raise TransportError(f"peer hello of {length} bytes (limit {HELLO_CAP})")
    error = ValueError("not read")
    for _ in range(HELLO_READS):
        conn.post_wait(lib.EP_V_READ, conn.ctl.addr + CTL_HEADER, conn.ctl.lkey, length, addr, rkey, 0, "read hello")
        try:
            return json.loads(bytes(conn.ctl.buf[CTL_HEADER : CTL_HEADER + length]))
        except ValueError as exc:
            error = exc
            log.warning("verbs: a READ of the peer's %d-byte hello did not parse (%s)", length, exc)
    raise TransportError(f"malformed hello from peer ({HELLO_READS} reads of {length} bytes): {error}") from error


def _learn(conn: VerbsConnection, hello: dict[str, Any]) -> None:
    """The peer's info and exports; a remote region's handle is its (address, rkey)."""
    conn.peer_info = dict(hello.get("info", {}))
    for desc in hello.get("exports", []):
        handle = (int(desc["addr"]), int(desc["rkey"]))
        conn.remote[desc["name"]] = RemoteRegion(desc["name"], int(desc["length"]), Access(int(desc["access"])), handle)


def _publish(hello: VerbsRegion, message: dict[str, Any], state: int) -> None:
    """Write the hello body, then its header as one 8-byte store: the peer polls the header."""
    data = json.dumps(message).encode()
    if len(data) > HELLO_CAP:
        raise TransportError(f"hello of {len(data)} bytes exceeds {HELLO_CAP}")
    hello.buf[_HELLO_HEADER : _HELLO_HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
    hello.buf[:8].view(np.uint64)[0] = np.uint64(len(data) | (state << 32))


def _await_hello(
    conn: VerbsConnection, addr: int, rkey: int, cap: int, deadline: float, address: str
) -> dict[str, Any]:
    """RDMA READ the acceptor's hello header until it is published, then its body."""
    words = conn.ctl.buf[8:16].view(np.uint64)
    pause = 1e-4
    while True:
        conn.post_wait(lib.EP_V_READ, conn.ctl.addr + 8, conn.ctl.lkey, 8, addr, rkey, 0, "read hello header")
        header = int(words[0])
        if header:
            break
        if time.monotonic() > deadline:
            raise TransportError(f"{address}: accepted at the RDMA level but never admitted this side")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    length, state = header & 0xFFFFFFFF, header >> 32
    if length > cap:
        raise TransportError(f"{address}: hello of {length} bytes exceeds its region of {cap}")
    message = _read_hello(conn, addr + _HELLO_HEADER, rkey, length)
    if state != _ACCEPTED:
        raise TransportError(f"{address} refused the connection: {message.get('refused', 'no reason given')}")
    return message


def connect(
    transport: VerbsTransport, address: str, exports: list[MemoryRegion], info: dict[str, Any], timeout: float
) -> VerbsConnection:
    """The connecting side of the handshake; returns once the acceptor has admitted this side."""
    from pyverbs import cm_enums as ce
    from pyverbs import enums as e
    from pyverbs.cmid import CMID, AddrInfo, CMEventChannel
    from pyverbs.pyverbs_error import PyverbsError

    host, port = split_address(address)
    regions = own_regions(exports)
    body = json.dumps({"exports": [r.describe() for r in regions], "info": info}).encode()
    if len(body) > HELLO_CAP:
        raise TransportError(f"hello of {len(body)} bytes exceeds {HELLO_CAP}")
    hello = VerbsRegion.allocate(transport.pd, "hello", len(body), Access.REMOTE_READ)
    hello.buf[:] = np.frombuffer(body, dtype=np.uint8)
    channel = CMEventChannel()
    cmid = CMID(creator=channel, port_space=ce.RDMA_PS_TCP)
    conn = VerbsConnection(transport, transport.next_id(), cmid, channel, hello)
    fd = conn.fileno()
    deadline = time.monotonic() + timeout
    try:
        try:
            cmid.resolve_addr(AddrInfo(dst=host, dst_service=str(port), port_space=ce.RDMA_PS_TCP), int(timeout * 1000))
            _expect(channel, fd, ce.RDMA_CM_EVENT_ADDR_RESOLVED, timeout, f"resolving {address}").ack_cm_event()
            cmid.resolve_route(int(timeout * 1000))
            _expect(channel, fd, ce.RDMA_CM_EVENT_ROUTE_RESOLVED, timeout, f"route to {address}").ack_cm_event()
            _modify(conn, e.IBV_QPS_INIT)
            private = _CONNECT_PDATA.pack(_MAGIC, conn.conn_id, hello.addr, hello.rkey, len(body))
            cmid.connect(_conn_param(conn.qp.qp_num, private))
        except PyverbsError as exc:
            raise TransportError(f"cannot reach {address} over RDMA: {exc}") from exc
        ev = _expect(channel, fd, ce.RDMA_CM_EVENT_CONNECT_RESPONSE, timeout, f"connecting to {address}")
        reply = bytes(ev.private_data or b"")
        ev.ack_cm_event()
        magic, peer_id, h_addr, h_rkey, h_cap = _ACCEPT_PDATA.unpack_from(reply)
        if magic != _MAGIC:
            raise TransportError(f"{address} is not an edgepath verbs endpoint")
        _modify(conn, e.IBV_QPS_RTR)
        _modify(conn, e.IBV_QPS_RTS)
        cmid.establish()
        conn.peer_assigned_id = peer_id
        _learn(conn, _await_hello(conn, h_addr, h_rkey, h_cap, deadline, address))
    except PyverbsError as exc:
        conn.close()
        raise TransportError(f"connecting to {address} over RDMA: {exc}") from exc
    except Exception:
        conn.close()
        raise
    transport.track(conn)
    return conn


class VerbsListener(Listener):
    """The accepting side of the handshake, on an rdma_cm id bound to ``address`` (IP:PORT)."""

    def __init__(
        self, transport: VerbsTransport, address: str, exports: list[MemoryRegion], info: dict[str, Any]
    ) -> None:
        from pyverbs import cm_enums as ce
        from pyverbs.cmid import CMID, AddrInfo, CMEventChannel
        from pyverbs.pyverbs_error import PyverbsError

        self.transport = transport
        self.address = address
        self._exports = own_regions(exports)
        self._info = info
        host, port = split_address(address)
        self.channel = CMEventChannel()
        self._fd = cm_channel_fd(self.channel)
        self.cmid = CMID(creator=self.channel, port_space=ce.RDMA_PS_TCP)
        try:
            self.cmid.bind_addr(
                AddrInfo(src=host, src_service=str(port), port_space=ce.RDMA_PS_TCP, flags=ce.RAI_PASSIVE)
            )
            self.cmid.listen(64)
        except PyverbsError as exc:
            self.close()
            raise TransportError(f"cannot listen on {address} over RDMA: {exc}") from exc

    def accept(self, timeout: float | None = None, admit: Admit | None = None) -> VerbsConnection | None:
        from pyverbs import cm_enums as ce
        from pyverbs import enums as e
        from pyverbs.cmid import CMID, CMEventChannel
        from pyverbs.pyverbs_error import PyverbsError

        ev = _event(self.channel, self._fd, 1e9 if timeout is None else timeout)
        if ev is None:
            return None
        if ev.event_type != ce.RDMA_CM_EVENT_CONNECT_REQUEST:
            name = ev.event_str()
            ev.ack_cm_event()
            log.debug("listener %s: ignoring %s", self.address, name)
            return None
        child = CMID(creator=ev, listen_id=self.cmid)
        private = bytes(ev.private_data or b"")
        ev.ack_cm_event()
        t = self.transport
        try:
            magic, peer_id, h_addr, h_rkey, h_len = _CONNECT_PDATA.unpack_from(private)
        except struct.error:
            magic = b""
        if magic != _MAGIC:
            log.debug("connection request with private data %r", private[:64])
            with contextlib.suppress(Exception):
                child.reject()
            child.close()
            raise TransportError("connection request without an edgepath verbs hello")
        child_ptr = cm_id_handle(child, self.channel)
        channel = CMEventChannel()
        rc = lib.ep_v_cm_migrate(child_ptr, raw_handle(channel))
        if rc:
            child.close()
            channel.close()
            raise TransportError(f"rdma_migrate_id failed ({rc})")
        hello = VerbsRegion.allocate(t.pd, "hello", _HELLO_HEADER + HELLO_CAP, Access.REMOTE_READ)
        conn = VerbsConnection(t, t.next_id(), child, channel, hello)
        try:
            for state in (e.IBV_QPS_INIT, e.IBV_QPS_RTR, e.IBV_QPS_RTS):
                _modify(conn, state)
            child.accept(
                _conn_param(conn.qp.qp_num, _ACCEPT_PDATA.pack(_MAGIC, conn.conn_id, hello.addr, hello.rkey, HELLO_CAP))
            )
            _expect(
                channel, conn.fileno(), ce.RDMA_CM_EVENT_ESTABLISHED, 5.0, f"accepting on {self.address}"
            ).ack_cm_event()
            conn.peer_assigned_id = peer_id
            _learn(conn, _read_hello(conn, h_addr, h_rkey, h_len))
            t.track(conn)
            info = dict(self._info)
            try:
                if admit is not None:
                    info.update(admit(conn))
            except ValueError as exc:
                _publish(hello, {"refused": str(exc)}, _REFUSED)
                # Let the connector read the reason (it disconnects then) before this side tears down.
                _event(channel, conn.fileno(), 2.0)
                raise
            _publish(hello, {"exports": [r.describe() for r in self._exports], "info": info}, _ACCEPTED)
        except PyverbsError as exc:  # e.g. the connecting side gave up and destroyed its id meanwhile
            conn.close()
            raise TransportError(f"accepting on {self.address}: {exc}") from exc
        except Exception:
            conn.close()
            raise
        return conn

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        for obj in (self.cmid, self.channel):
            with contextlib.suppress(Exception):
                obj.close()
