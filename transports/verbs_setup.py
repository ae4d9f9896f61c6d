"""Connection setup for the verbs transport: the rdma_cm handshake (RDMA_PS_TCP, external QPs), the peer-secret
handshake (:mod:`edgepath.transports.peer_auth`) in its private data, and the hello exchange that tells each side
the other's exports -- each side's only once the other has proved it holds the peer secret.

1. The connecting side creates its QP -- granting no remote access -- and a *hello* region (its own hello, then a
   mailbox for the acceptor's), and connects; the rdma_cm private data (56 bytes at most) carries a magic, its
   connection id, the hello region's address and rkey, and the handshake's opening (a nonce, the ids of the
   secrets it holds).
2. The accepting side answers in the accept's private data (a nonce, the secret it chose, its proof) -- or rejects
   the request when it holds none of the secrets offered.  Its QP grants no remote access yet and it exports
   nothing: a peer that has proved nothing can reach none of its memory.
3. The connecting side checks the acceptor's proof; only then does its QP grant the access its regions need, and it
   publishes its hello (its proof, exports and info; the header word written last) for the acceptor to READ.
   A wrong proof ends the connection there: nothing of this side was described.
4. The acceptor READs the connector's hello until it is published and checks the proof; only then does its QP
   grant the access its regions need (a QP's access can change in RTS), it runs ``admit(conn)`` and WRITEs its own
   hello (exports, info -- or a refusal) into the connector's mailbox, its header word last.
5. The connecting side waits for its mailbox's header; ``connect`` returns only then, so a connection is never
   used before the acceptor has admitted it.

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

from edgepath.transports.base import Access, Admit, Incoming, Listener, MemoryRegion, RemoteRegion, TransportError
from edgepath.transports.peer_auth import (
    ANSWER,
    MALFORMED,
    NO_HANDSHAKE,
    OPENING,
    TIMED_OUT,
    UNKNOWN_SECRET,
    ConnectorHandshake,
    ListenerHandshake,
    PeerRefused,
)
from edgepath.transports.verbs_datapath import (
    CTL_HEADER,
    HELLO_CAP,
    VerbsConnection,
    VerbsRegion,
    cm_event_nowait,
    own_regions,
)
from edgepath.transports.verbs_shim import cm_channel_fd, cm_id_handle, ffi, lib, raw_handle

if TYPE_CHECKING:
    from edgepath.transports.verbs import VerbsTransport

log = logging.getLogger("edgepath.verbs")

#: v2: the peer-secret handshake in the private data (v1 had none: such a peer is rejected)
_MAGIC = b"EPv2"
_CONNECT_PDATA = struct.Struct(f"<4sIQI{OPENING.size}s")  # magic, conn id, hello addr, hello rkey, opening
_ACCEPT_PDATA = struct.Struct(f"<4sI{ANSWER.size}s")  # magic, conn id, answer
assert _CONNECT_PDATA.size <= 56, "RDMA_PS_TCP carries 56 bytes of private data in a connect request"
_REJECT_PDATA = 148  # bytes of private data a reject carries at most (IB CM's REJ)
_HELLO_HEADER = 8  # u32 length | u32 state, written last
_ACCEPTED, _REFUSED = 1, 2
#: a connector's hello region: its own hello (the acceptor READs it), then its mailbox (the acceptor WRITEs there)
HELLO_HALF = _HELLO_HEADER + HELLO_CAP


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


def _modify(conn: VerbsConnection, state: int, access: int | None = None) -> None:
    """Move ``conn``'s QP to ``state``; ``access`` (ibv access flags): what it lets the peer do from then on (at INIT
    it is always none: a peer gets access only once it has proved it holds the peer secret)."""
    from pyverbs import enums as e

    attr, mask = conn.cmid.init_qp_attr(state)
    if state == e.IBV_QPS_INIT:
        attr.qp_access_flags = 0
    elif state == e.IBV_QPS_RTS:
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_COUNT  # an acceptor's comes from the connector's request: set it on both sides
        mask |= e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT
    if access is not None:
        attr.qp_access_flags = access
        mask |= e.IBV_QP_ACCESS_FLAGS
    conn.qp.modify(attr, mask)


def _grant(conn: VerbsConnection, access: int) -> None:
    """Let the peer of an established ``conn`` (its QP in RTS) reach what ``access`` allows."""
    from pyverbs import enums as e
    from pyverbs.qp import QPAttr

    attr = QPAttr()
    attr.qp_access_flags = access
    conn.qp.modify(attr, e.IBV_QP_ACCESS_FLAGS)


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
            message = json.loads(bytes(conn.ctl.buf[CTL_HEADER : CTL_HEADER + length]))
            if isinstance(message, dict):
                return message
            error = ValueError("not a JSON object")
        except ValueError as exc:
            error = exc
        log.warning("verbs: a READ of the peer's %d-byte hello did not parse (%s)", length, error)
    raise TransportError(f"malformed hello from peer ({HELLO_READS} reads of {length} bytes): {error}") from error


def _learn(conn: VerbsConnection, hello: dict[str, Any]) -> None:
    """The peer's info and exports; a remote region's handle is its (address, rkey)."""
    try:
        conn.peer_info = dict(hello.get("info", {}))
        for desc in hello.get("exports", []):
            handle = (int(desc["addr"]), int(desc["rkey"]))
            region = RemoteRegion(str(desc["name"]), int(desc["length"]), Access(int(desc["access"])), handle)
            conn.remote[region.name] = region
    except (KeyError, TypeError, ValueError) as exc:
        raise TransportError(f"malformed hello from the peer: {exc!r}") from exc


def _encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    if len(data) > HELLO_CAP:
        raise TransportError(f"hello of {len(data)} bytes exceeds {HELLO_CAP}")
    return data


def _publish(hello: VerbsRegion, message: dict[str, Any], state: int) -> None:
    """Write this side's hello into the first half of ``hello``, then its header as one 8-byte store: the peer
    READs the header until it is set."""
    data = _encode(message)
    hello.buf[_HELLO_HEADER : _HELLO_HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
    hello.buf[:8].view(np.uint64)[0] = np.uint64(len(data) | (state << 32))


def _deliver(conn: VerbsConnection, addr: int, rkey: int, message: dict[str, Any], state: int) -> None:
    """WRITE ``message`` into the connector's mailbox at ``addr``: the body, then the header word (RC places them
    in that order)."""
    data = _encode(message)
    ctl = conn.ctl
    ctl.buf[CTL_HEADER : CTL_HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
    body, word = ctl.addr + CTL_HEADER, ctl.addr + 8
    conn.post_wait(lib.EP_V_WRITE, body, ctl.lkey, len(data), addr + _HELLO_HEADER, rkey, 0, "write hello")
    ctl.buf[8:16].view(np.uint64)[0] = np.uint64(len(data) | (state << 32))
    conn.post_wait(lib.EP_V_WRITE, word, ctl.lkey, 8, addr, rkey, 0, "write hello header")


def _await_own_mailbox(hello: VerbsRegion, deadline: float, address: str) -> dict[str, Any]:
    """The acceptor's hello, once it has WRITten it into this side's mailbox (the hello region's second half)."""
    box = hello.buf[HELLO_HALF:]
    words = box[:8].view(np.uint64)
    pause = 1e-4
    while not int(words[0]):
        if time.monotonic() > deadline:
            raise PeerRefused(TIMED_OUT, f"{address}: accepted at the RDMA level but never admitted this side")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    header = int(words[0])
    length, state = header & 0xFFFFFFFF, header >> 32
    if not 0 < length <= HELLO_CAP:
        raise TransportError(f"{address}: a hello of {length} bytes (limit {HELLO_CAP})")
    error: Exception = ValueError("not read")
    for _ in range(HELLO_READS):
        try:
            message = json.loads(bytes(box[_HELLO_HEADER : _HELLO_HEADER + length]))
            if isinstance(message, dict):
                break
            error = ValueError("not a JSON object")
        except ValueError as exc:
            error = exc
        time.sleep(1e-3)  # placed in order by RC; a body that does not parse yet is read once more
    else:
        raise TransportError(f"{address}: malformed hello ({error})")
    if state != _ACCEPTED:
        reason = str(message.get("reason", "refused"))
        raise PeerRefused(reason, f"{address} refused the connection: {message.get('refused', 'no reason given')}")
    return message


def connect(
    transport: VerbsTransport, address: str, exports: list[MemoryRegion], info: dict[str, Any], timeout: float
) -> VerbsConnection:
    """The connecting side of the handshake; returns once the acceptor has proved itself and admitted this side."""
    from pyverbs import cm_enums as ce
    from pyverbs import enums as e
    from pyverbs.cmid import CMID, AddrInfo, CMEventChannel
    from pyverbs.pyverbs_error import PyverbsError

    from edgepath.transports.verbs_datapath import ibv_access

    host, port = split_address(address)
    regions = own_regions(exports)
    body = {"exports": [r.describe() for r in regions], "info": info}
    _encode({**body, "proof": "00" * 32})  # too large a hello is refused before anything is set up
    hello = VerbsRegion.allocate(transport.pd, "hello", 2 * HELLO_HALF, Access.REMOTE_READ | Access.REMOTE_WRITE)
    channel = CMEventChannel()
    cmid = CMID(creator=channel, port_space=ce.RDMA_PS_TCP)
    conn = VerbsConnection(transport, transport.next_id(), cmid, channel, hello)
    fd = conn.fileno()
    deadline = time.monotonic() + timeout
    handshake = ConnectorHandshake(transport.keys, time.monotonic())
    try:
        try:
            cmid.resolve_addr(AddrInfo(dst=host, dst_service=str(port), port_space=ce.RDMA_PS_TCP), int(timeout * 1000))
            _expect(channel, fd, ce.RDMA_CM_EVENT_ADDR_RESOLVED, timeout, f"resolving {address}").ack_cm_event()
            cmid.resolve_route(int(timeout * 1000))
            _expect(channel, fd, ce.RDMA_CM_EVENT_ROUTE_RESOLVED, timeout, f"route to {address}").ack_cm_event()
            _modify(conn, e.IBV_QPS_INIT)
            private = _CONNECT_PDATA.pack(_MAGIC, conn.conn_id, hello.addr, hello.rkey, handshake.opening())
            cmid.connect(_conn_param(conn.qp.qp_num, private))
        except PyverbsError as exc:
            raise TransportError(f"cannot reach {address} over RDMA: {exc}") from exc
        ev = _event(channel, fd, max(deadline - time.monotonic(), 0.0))
        if ev is None:
            raise TransportError(f"connecting to {address}: no rdma_cm event within {timeout:.1f} s")
        kind, reply = ev.event_type, bytes(ev.private_data or b"")
        name = ev.event_str()
        ev.ack_cm_event()
        if kind == ce.RDMA_CM_EVENT_REJECTED:
            raise _rejected(address, reply)
        if kind != ce.RDMA_CM_EVENT_CONNECT_RESPONSE:
            raise TransportError(f"connecting to {address}: rdma_cm reported {name}")
        try:
            magic, peer_id, answer = _ACCEPT_PDATA.unpack_from(reply)
        except struct.error:
            magic = b""
        if magic != _MAGIC:
            raise PeerRefused(NO_HANDSHAKE, f"{address} is not an edgepath verbs endpoint that proves itself")
        try:
            proof = handshake.proof(answer)
        except PeerRefused as exc:
            _reject(cmid, channel, exc)  # the connection ends here: nothing of this side was described
            raise PeerRefused(exc.reason, f"{address}: {exc}") from None
        # The acceptor proved it holds the secret: now (and not before) the QP lets it reach this side's regions.
        _modify(conn, e.IBV_QPS_RTR, transport.qp_access | ibv_access(Access.REMOTE_READ | Access.REMOTE_WRITE))
        _modify(conn, e.IBV_QPS_RTS)
        cmid.establish()
        conn.peer_assigned_id = peer_id
        _publish(hello, {**body, "proof": proof.hex()}, _ACCEPTED)
        _learn(conn, _await_own_mailbox(hello, deadline, address))
    except PyverbsError as exc:
        conn.close()
        raise TransportError(f"connecting to {address} over RDMA: {exc}") from exc
    except Exception:
        conn.close()
        raise
    transport.track(conn)
    return conn


def _rejected(address: str, reply: bytes) -> PeerRefused:
    """What a rejected connect request says: the acceptor's reason, when it gave one (its private data)."""
    text = reply.rstrip(b"\0").decode("utf-8", "replace")
    if not text.startswith("EP "):
        return PeerRefused(NO_HANDSHAKE, f"{address} rejected the connection request (not an edgepath v2 listener?)")
    reason, _, _ = text[3:].partition(": ")
    return PeerRefused(reason or "refused", f"{address} rejected the connection: {text[3:]}")


def _reject(child: Any, channel: Any, refused: PeerRefused) -> None:
    """Reject a connection request, ``refused``'s reason in the reject's private data (``EP reason: detail``)."""
    why = f"EP {refused}".encode()[:_REJECT_PDATA]
    rc = lib.ep_v_cm_reject(cm_id_handle(child, channel), why, len(why))
    if rc:
        log.debug("rejecting a connection request failed (%d)", rc)


def _peer_of(child: Any, channel: Any) -> str:
    """The address a connection request came from, for a log line."""
    out = ffi.new("char[]", 64)
    if lib.ep_v_cm_peer(cm_id_handle(child, channel), out, 64) == 0:
        return ffi.string(out).decode()
    return "a peer"


class VerbsIncoming(Incoming):
    """A connection request taken from the listener (its rdma_cm id migrated to a channel of its own), not
    answered yet."""

    def __init__(self, listener: VerbsListener, child: Any, channel: Any, private: bytes, peer: str) -> None:
        self.listener = listener
        self.child = child
        self.channel = channel
        self.private = private
        self.peer = peer

    def complete(self, admit: Admit | None, deadline: float) -> VerbsConnection:
        from pyverbs import cm_enums as ce
        from pyverbs import enums as e
        from pyverbs.pyverbs_error import PyverbsError

        t, child, channel = self.listener.transport, self.child, self.channel
        _magic, peer_id, h_addr, h_rkey, opening = _CONNECT_PDATA.unpack_from(self.private)
        handshake = ListenerHandshake(t.keys, time.monotonic())
        try:
            answer = handshake.answer(opening)
        except PeerRefused as refused:
            self._reject(refused)
            raise
        conn = VerbsConnection(t, t.next_id(), child, channel, None)
        try:
            for state in (e.IBV_QPS_INIT, e.IBV_QPS_RTR, e.IBV_QPS_RTS):
                _modify(conn, state)  # no remote access: the peer has proved nothing yet
            child.accept(_conn_param(conn.qp.qp_num, _ACCEPT_PDATA.pack(_MAGIC, conn.conn_id, answer)))
            left = max(deadline - time.monotonic(), 0.0)
            ev = _event(channel, conn.fileno(), left)
            if ev is None:
                raise PeerRefused(TIMED_OUT, "the peer did not establish the connection in time")
            kind, name = ev.event_type, ev.event_str()
            ev.ack_cm_event()
            if kind != ce.RDMA_CM_EVENT_ESTABLISHED:  # e.g. it found this side's proof wrong and rejected
                raise PeerRefused(UNKNOWN_SECRET, f"the peer ended the handshake ({name})")
            conn.peer_assigned_id = peer_id
            hello = self._await_hello(conn, h_addr, h_rkey, deadline)
            mailbox = h_addr + HELLO_HALF
            try:
                try:
                    proof = bytes.fromhex(str(hello.get("proof", "")))
                except ValueError:
                    raise PeerRefused(MALFORMED, "a proof that is not hex") from None
                handshake.verify(proof)
            except PeerRefused as refused:
                _deliver(conn, mailbox, h_rkey, {"refused": str(refused), "reason": refused.reason}, _REFUSED)
                raise
            _grant(conn, t.qp_access)  # proved: the peer may now reach what this side's regions grant
            _learn(conn, hello)
            t.track(conn)
            info = dict(self.listener.info)
            try:
                if admit is not None:
                    info.update(admit(conn))
            except ValueError as exc:
                _deliver(conn, mailbox, h_rkey, {"refused": str(exc), "reason": "not admitted"}, _REFUSED)
                raise
            exports = [r.describe() for r in self.listener.exports]
            _deliver(conn, mailbox, h_rkey, {"exports": exports, "info": info}, _ACCEPTED)
        except PyverbsError as exc:  # e.g. the connecting side gave up and destroyed its id meanwhile
            conn.close()
            raise TransportError(f"accepting on {self.listener.address}: {exc}") from exc
        except Exception:
            conn.close()
            raise
        return conn

    @staticmethod
    def _await_hello(conn: VerbsConnection, addr: int, rkey: int, deadline: float) -> dict[str, Any]:
        """RDMA READ the connector's hello header until it is published, then its body."""
        words = conn.ctl.buf[8:16].view(np.uint64)
        pause = 1e-4
        while True:
            conn.post_wait(lib.EP_V_READ, conn.ctl.addr + 8, conn.ctl.lkey, 8, addr, rkey, 0, "read hello header")
            header = int(words[0])
            if header:
                break
            if time.monotonic() > deadline:
                raise PeerRefused(TIMED_OUT, "the peer published no hello within the handshake timeout")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return _read_hello(conn, addr + _HELLO_HEADER, rkey, header & 0xFFFFFFFF)

    def _reject(self, refused: PeerRefused) -> None:
        """Reject the request, saying why in its private data; let go of its id."""
        _reject(self.child, self.channel, refused)
        self.abort()

    def abort(self) -> None:
        for obj in (self.child, self.channel):
            with contextlib.suppress(Exception):
                obj.close()


class VerbsListener(Listener):
    """The accepting side of the handshake, on an rdma_cm id bound to ``address`` (IP:PORT)."""

    transport: VerbsTransport

    def __init__(
        self, transport: VerbsTransport, address: str, exports: list[MemoryRegion], info: dict[str, Any]
    ) -> None:
        from pyverbs import cm_enums as ce
        from pyverbs.cmid import CMID, AddrInfo, CMEventChannel
        from pyverbs.pyverbs_error import PyverbsError

        super().__init__(transport, address)
        self.exports = own_regions(exports)
        self.info = info
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

    def incoming(self, timeout: float | None = None) -> VerbsIncoming | None:
        from pyverbs import cm_enums as ce
        from pyverbs.cmid import CMID, CMEventChannel

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
        peer = _peer_of(child, self.channel)
        try:
            magic = _CONNECT_PDATA.unpack_from(private)[0]
        except struct.error:
            magic = b""
        if magic != _MAGIC:
            log.debug("connection request with private data %r", private[:64])
            refused = PeerRefused(NO_HANDSHAKE, f"{peer}: a connection request without the peer-secret handshake")
            _reject(child, self.channel, refused)
            child.close()
            raise refused
        child_ptr = cm_id_handle(child, self.channel)
        channel = CMEventChannel()
        rc = lib.ep_v_cm_migrate(child_ptr, raw_handle(channel))
        if rc:
            child.close()
            channel.close()
            raise TransportError(f"rdma_migrate_id failed ({rc})")
        return VerbsIncoming(self, child, channel, private, peer)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        for obj in (self.cmid, self.channel):
            with contextlib.suppress(Exception):
                obj.close()
