"""The ``verbs`` transport: the data path over RDMA verbs (a real NIC or soft-RoCE ``rxe``).

Control plane on pyverbs (rdma-core): the device context, the protection domain,
memory regions with only the remote access each needs, a completion channel,
CQs, one shared receive queue, RC queue pairs, and rdma_cm (``CMID``) for
connection setup.  Data plane in C (``native/edgepath_verbs.c``): posting a work
request and waiting for its completion, and polling the receive CQ, are one
cffi call each, so an operation costs one Python-to-C crossing.

Connection setup (rdma_cm, RDMA_PS_TCP, external QPs):

1. The connecting side creates its QP, publishes a *hello* (its exports and
   info, JSON) in a region peers may only READ, and connects; the rdma_cm
   private data (56 bytes at most) carries a magic, its connection id and the
   hello's address, rkey and length.
2. The accepting side moves its QP to RTS, accepts (private data: magic, its
   connection id, its own hello's address, rkey and capacity), waits for
   ESTABLISHED, RDMA READs the connector's hello, runs ``admit(conn)`` and only
   then writes its own hello (exports, info, or a refusal) and sets its ready
   word last.
3. The connecting side RDMA READs the acceptor's hello header until the ready
   word is set, then reads the rest.  ``connect`` returns only then, so a
   connection is never used before the acceptor has admitted it.

WRITE_WITH_IMM completions of all connections arrive on one receive CQ (with a
completion channel for ``fileno``/``arm``) fed by one SRQ whose receive WRs are
reposted by the C poller; completions carry the QP number, mapped here to this
side's connection id.  Each connection has its own small send CQ that only its
caller polls (operations are synchronous).  Each connection's rdma_cm id has an
event channel of its own (accepted ids are migrated to one), whose descriptor is
the connection's ``fileno``: DISCONNECTED there means the peer has gone.

Atomics: remote CAS goes through the NIC (``IBV_WR_ATOMIC_CMP_AND_SWP``).  On
``rxe`` (ATOMIC_HCA) a NIC atomic is atomic only against other NIC atomics.  The
slot server's own transitions are CPU CASes on the same words; that is safe
because a remote CAS only ever succeeds from FREE, and the server never writes a
FREE word (it moves its own CLAIMED/READY/RUNNING/DONE words only).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import logging
import mmap
import select
import struct
import threading
import time
from typing import Any

import numpy as np

from edgepath.dma.transport import (
    Access,
    Admit,
    Completion,
    CompletionQueue,
    Connection,
    Listener,
    MemoryRegion,
    RemoteRegion,
    TransferCounters,
    Transport,
    TransportError,
    TransportUnavailable,
)

log = logging.getLogger("edgepath.verbs")

try:
    from edgepath.native._verbs import ffi as _ffi
    from edgepath.native._verbs import lib as _lib
except ImportError as _exc:  # no rdma-core headers at build time
    raise ImportError(
        "edgepath.native._verbs is not built (apt-get install libibverbs-dev librdmacm-dev, then make build)"
    ) from _exc

NO_DEVICE = (
    "verbs transport: no RDMA device found ({why}); use --transport loopback, or create a soft-RoCE device "
    "(modprobe rdma_rxe; rdma link add rxe0 type rxe netdev <netdev>)"
)
_MAGIC = b"EPv1"
_CONNECT_PDATA = struct.Struct("<4sIQII")  # magic, conn id, hello addr, hello rkey, hello length
_ACCEPT_PDATA = struct.Struct("<4sIQII")  # magic, conn id, hello addr, hello rkey, hello capacity
_HELLO_HEADER = 8  # u32 length | u32 state, written last by the acceptor
_HELLO_CAP = 16384
_ACCEPTED, _REFUSED = 1, 2
# pyverbs keeps each object's C handle in the first field after its base (Cython layout: object
# header, __weakref__, logger, vtable); checked against independent values before any use.
_HANDLE_OFFSET = 40
_OP_TIMEOUT_NS = 10_000_000_000  # beyond rxe's retry budget: a dead peer shows as a failed completion first
_ATOMIC, _WRITE, _READ = int(Access.REMOTE_ATOMIC), int(Access.REMOTE_WRITE), int(Access.REMOTE_READ)
_OP_WRITE, _OP_WRITE_IMM, _T = _lib.EP_V_WRITE, _lib.EP_V_WRITE_IMM, _OP_TIMEOUT_NS


def _raw(obj: object) -> int:
    return ctypes.c_void_p.from_address(id(obj) + _HANDLE_OFFSET).value or 0


def _checked(what: str, rc: int) -> None:
    if rc != 0:
        raise TransportUnavailable(
            f"verbs transport: this pyverbs build lays out its {what} differently than expected; "
            "use Debian's python3-pyverbs (rdma-core 44) or --transport loopback"
        )


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"verbs address {address!r} is not IP:PORT")
    return host, int(port)


def _ibv_access(access: Access) -> int:
    from pyverbs import enums as e

    flags = e.IBV_ACCESS_LOCAL_WRITE  # the NIC writes READ results and CAS results into local memory
    if Access.REMOTE_WRITE in access:
        flags |= e.IBV_ACCESS_REMOTE_WRITE
    if Access.REMOTE_READ in access:
        flags |= e.IBV_ACCESS_REMOTE_READ
    if Access.REMOTE_ATOMIC in access:
        flags |= e.IBV_ACCESS_REMOTE_ATOMIC
    return flags


class VerbsRegion(MemoryRegion):
    """Memory registered with the PD: ``addr``/``lkey``/``rkey`` of its MR."""

    def __init__(self, name: str, buf: np.ndarray, access: Access, mr: Any, keep: Any = None) -> None:
        super().__init__(name=name, buf=buf, access=access)
        self.mr = mr
        self.addr = int(buf.ctypes.data)
        self.length = buf.nbytes
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)
        self._keep = keep  # the mmap that owns the memory, when this region allocated it

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "length": self.buf.nbytes,
            "access": int(self.access),
            "addr": self.addr,
            "rkey": self.rkey,
        }

    def close(self) -> None:
        self.mr.close()


class VerbsDeviceRegion(VerbsRegion):
    """GPU memory registered with the PD (``--slots gpu-device``): the host cannot read it, so ``buf``
    is empty; ``addr`` is where the MR's address space starts (a dma-buf MR's iova, or the device
    pointer for nvidia-peermem), which is what peers and local work requests name."""

    def __init__(self, name: str, length: int, access: Access, mr: Any, addr: int, how: str) -> None:
        MemoryRegion.__init__(self, name=name, buf=np.empty(0, dtype=np.uint8), access=access)
        self.mr = mr
        self.addr = addr
        self.length = length
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)
        self.how = how
        self._keep = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "length": self.length}


def _event(channel: Any, fd: int, timeout: float) -> Any | None:
    """The next rdma_cm event on ``channel`` (non-blocking fd), or None after ``timeout`` seconds."""
    from pyverbs.cmid import CMEvent
    from pyverbs.pyverbs_error import PyverbsRDMAError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return CMEvent(channel)
        except PyverbsRDMAError as exc:
            if exc.error_code not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise TransportError(f"rdma_cm event channel failed: {exc}") from exc
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


def _conn_param(qp_num: int, private: bytes) -> Any:
    from pyverbs.cmid import ConnParam

    param = ConnParam(resources=16, depth=16, retry=7, rnr_retry=7, srq=1, qp_num=qp_num, data_len=len(private))
    param.set_private_data(private)
    return param


class VerbsConnection(Connection):
    """One RC QP plus its rdma_cm id, event channel, send CQ and setup regions."""

    def __init__(self, transport: VerbsTransport, conn_id: int, cmid: Any, channel: Any, hello: VerbsRegion) -> None:
        from pyverbs import enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.transport = transport
        self.conn_id = conn_id
        self.peer_assigned_id = 0
        self.remote: dict[str, RemoteRegion] = {}
        self.peer_info: dict[str, Any] = {}
        self.counters = TransferCounters()
        self.cmid = cmid
        self.channel = channel
        self.hello = hello
        self._fd = _lib.ep_v_cm_channel_fd(_raw(channel))
        _checked("CMEventChannel", 0 if self._fd >= 0 else -1)
        self._alive = True
        self.scq = CQ(transport.ctx, 16, None, None, 0)
        self._scq = _raw(self.scq)
        _checked("CQ", _lib.ep_v_check_cq(self._scq, transport.ctx_ptr, self.scq.cqe))
        cap = QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.scq, rcq=transport.rcq, srq=transport.srq, cap=cap)
        self.qp = QP(transport.pd, init)
        self._qp = _raw(self.qp)
        _checked("QP", _lib.ep_v_check_qp(self._qp, transport.ctx_ptr, self.qp.qp_num))
        self.ctl = transport._alloc("ctl", 64 + _HELLO_CAP, Access.NONE, track=False)
        self._ctl_ptr = _ffi.cast("uint64_t *", self.ctl.addr)
        self._ctl_lkey = self.ctl.lkey

    # -- setup -----------------------------------------------------------------------
    def _modify(self, state: int) -> None:
        from pyverbs import enums as e

        attr, mask = self.cmid.init_qp_attr(state)
        if state == e.IBV_QPS_INIT:
            attr.qp_access_flags = self.transport.qp_access
        self.qp.modify(attr, mask)

    def _to_rts(self) -> None:
        from pyverbs import enums as e

        for state in (e.IBV_QPS_INIT, e.IBV_QPS_RTR, e.IBV_QPS_RTS):
            self._modify(state)

    def _read_hello(self, addr: int, rkey: int, length: int) -> dict[str, Any]:
        if not 0 < length <= _HELLO_CAP:
            raise TransportError(f"peer hello of {length} bytes (limit {_HELLO_CAP})")
        self._op(_lib.EP_V_READ, self.ctl.addr + 64, self.ctl.lkey, length, addr, rkey, 0, "read hello")
        try:
            return json.loads(bytes(self.ctl.buf[64 : 64 + length]))
        except ValueError as exc:
            raise TransportError(f"malformed hello from peer: {exc}") from exc

    def _learn(self, hello: dict[str, Any]) -> None:
        self.peer_info = dict(hello.get("info", {}))
        for desc in hello.get("exports", []):
            handle = (int(desc["addr"]), int(desc["rkey"]))
            self.remote[desc["name"]] = RemoteRegion(
                desc["name"], int(desc["length"]), Access(int(desc["access"])), handle
            )

    # -- verbs -----------------------------------------------------------------------
    def _op(self, op: int, laddr: int, lkey: int, length: int, raddr: int, rkey: int, imm: int, what: str) -> None:
        rc = _lib.ep_v_post_wait(self._qp, self._scq, op, laddr, lkey, length, raddr, rkey, imm, _OP_TIMEOUT_NS)
        if rc:
            self._failed(rc, what)

    def _failed(self, rc: int, what: str) -> None:
        self._alive = False
        if rc == _lib.EP_V_E_TIMEOUT:
            why = "no completion in time"
        elif rc < 0:
            why = "could not post the work request"
        else:
            why = _ffi.string(_lib.ep_v_status_str(rc)).decode()
        raise TransportError(f"{what} on connection {self.conn_id} failed: {why}")

    def _live(self) -> None:
        if not self._alive:
            raise TransportError(f"connection {self.conn_id} is closed")

    # Hot path: one access check per side, one cffi call, no further Python calls when it succeeds.
    def compare_and_swap(self, remote: RemoteRegion, offset: int, expected: int, desired: int) -> int:
        if not self._alive:
            self._live()
        remote.check(offset, 8, _ATOMIC)
        if offset & 7:
            raise TransportError(f"atomic at offset {offset} is not 8-byte aligned")
        addr, rkey = remote.handle
        rc = _lib.ep_v_cas(
            self._qp, self._scq, self._ctl_ptr, self._ctl_lkey, addr + offset, rkey, expected, desired, _T
        )
        if rc:
            self._failed(rc, "compare-and-swap")
        self.counters.cas += 1
        return int(self._ctl_ptr[0])

    def write(
        self, local: MemoryRegion, local_offset: int, remote: RemoteRegion, remote_offset: int, length: int
    ) -> None:
        if not self._alive:
            self._live()
        remote.check(remote_offset, length, _WRITE)
        laddr, lkey = _local(local, local_offset, length)
        addr, rkey = remote.handle
        rc = _lib.ep_v_post_wait(self._qp, self._scq, _OP_WRITE, laddr, lkey, length, addr + remote_offset, rkey, 0, _T)
        if rc:
            self._failed(rc, "write")
        counters = self.counters
        counters.writes += 1
        counters.bytes_written += length

    def write_with_imm(
        self,
        local: MemoryRegion,
        local_offset: int,
        remote: RemoteRegion,
        remote_offset: int,
        length: int,
        imm: int,
    ) -> None:
        if not self._alive:
            self._live()
        remote.check(remote_offset, length, _WRITE)
        laddr, lkey = _local(local, local_offset, length)
        addr, rkey = remote.handle
        rc = _lib.ep_v_post_wait(
            self._qp, self._scq, _OP_WRITE_IMM, laddr, lkey, length, addr + remote_offset, rkey, imm & 0xFFFFFFFF, _T
        )
        if rc:
            self._failed(rc, "write-with-immediate")
        counters = self.counters
        counters.writes += 1
        counters.bytes_written += length

    def write_then_imm(
        self,
        local: MemoryRegion,
        local_offset: int,
        remote: RemoteRegion,
        remote_offset: int,
        length: int,
        bell_offset: int,
        bell_remote_offset: int,
        bell_length: int,
        imm: int,
    ) -> None:
        """Both work requests in one post, one completion waited for: one round trip, one cffi call."""
        if not self._alive:
            self._live()
        remote.check(remote_offset, length, _WRITE)
        remote.check(bell_remote_offset, bell_length, _WRITE)
        laddr, lkey = _local(local, local_offset, length)
        bell_laddr, _ = _local(local, bell_offset, bell_length)
        addr, rkey = remote.handle
        rc = _lib.ep_v_write_then_imm(
            self._qp,
            self._scq,
            laddr,
            lkey,
            length,
            addr + remote_offset,
            rkey,
            bell_laddr,
            bell_length,
            addr + bell_remote_offset,
            imm & 0xFFFFFFFF,
            _T,
        )
        if rc:
            self._failed(rc, "write + doorbell")
        counters = self.counters
        counters.writes += 2
        counters.bytes_written += length + bell_length

    def read(
        self, local: MemoryRegion, local_offset: int, remote: RemoteRegion, remote_offset: int, length: int
    ) -> None:
        if not self._alive:
            self._live()
        remote.check(remote_offset, length, _READ)
        laddr, lkey = _local(local, local_offset, length)
        addr, rkey = remote.handle
        self._op(_lib.EP_V_READ, laddr, lkey, length, addr + remote_offset, rkey, 0, "read")
        self.counters.reads += 1
        self.counters.bytes_read += length

    # -- management ------------------------------------------------------------------
    def fileno(self) -> int:
        return self._fd

    def check_alive(self) -> bool:
        from pyverbs import cm_enums as ce

        while self._alive:
            ev = _event(self.channel, self._fd, 0.0)
            if ev is None:
                break
            kind = ev.event_type
            ev.ack_cm_event()
            if kind in (ce.RDMA_CM_EVENT_DISCONNECTED, ce.RDMA_CM_EVENT_DEVICE_REMOVAL, ce.RDMA_CM_EVENT_TIMEWAIT_EXIT):
                self._alive = False
        return self._alive

    @property
    def alive(self) -> bool:
        return self._alive

    def close(self) -> None:
        if self.cmid is None:
            return
        self._alive = False
        self.transport._forget(self)
        with contextlib.suppress(Exception):
            self.cmid.disconnect()
        for obj in (self.qp, self.scq, self.cmid, self.channel):
            with contextlib.suppress(Exception):
                obj.close()
        for region in (self.ctl, self.hello):
            with contextlib.suppress(Exception):
                region.close()
        self.cmid = None


def _local(local: MemoryRegion, offset: int, length: int) -> tuple[int, int]:
    """(address, lkey) of ``[offset, offset+length)`` of a region registered with this transport."""
    if not isinstance(local, VerbsRegion):
        raise TransportError(f"region {local.name!r} was not registered with the verbs transport")
    if offset < 0 or length < 0 or offset + length > local.length:
        raise TransportError(
            f"local access [{offset}, {offset + length}) outside region {local.name!r} of {local.length} bytes"
        )
    return local.addr + offset, local.lkey


class VerbsCQ(CompletionQueue):
    """The receive CQ of all connections, with its completion channel and SRQ (C poller)."""

    def __init__(self, transport: VerbsTransport, recv_depth: int) -> None:
        self._transport = transport
        self._q = _lib.ep_vcq_new(transport.rcq_ptr, transport.channel_ptr, transport.srq_ptr, recv_depth)
        if self._q == _ffi.NULL:
            raise TransportError("could not post the shared receive queue's work requests")
        self._out = _ffi.new("uint64_t[]", 256)

    def _convert(self, n: int) -> list[Completion]:
        if n < 0:
            raise TransportError(f"receive completion queue failed ({n})")
        by_qpn = self._transport._by_qpn
        out = []
        for i in range(n):
            v = int(self._out[i])
            conn_id = by_qpn.get(v >> 32)
            if conn_id is not None:
                out.append(Completion(conn_id, v & 0xFFFFFFFF))
        return out

    def poll(self, max_entries: int = 64) -> list[Completion]:
        return self._convert(_lib.ep_vcq_poll(self._q, self._out, min(max_entries, 256)))

    def wait(self, timeout: float | None, spin: float = 0.0, max_entries: int = 64) -> list[Completion]:
        timeout_ns = -1 if timeout is None else int(timeout * 1e9)
        return self._convert(_lib.ep_vcq_wait(self._q, self._out, min(max_entries, 256), timeout_ns, int(spin * 1e9)))

    def fileno(self) -> int:
        return int(_lib.ep_vcq_fd(self._q))

    def arm(self) -> bool:
        rc = _lib.ep_vcq_arm(self._q)
        if rc < 0:
            raise TransportError(f"could not arm the receive completion queue ({rc})")
        return rc > 0

    @property
    def errors(self) -> int:
        """Receive completions that failed (e.g. flushed when a peer's QP went away)."""
        return int(_lib.ep_vcq_errors(self._q))

    def close(self) -> None:
        if self._q != _ffi.NULL:
            _lib.ep_vcq_free(self._q)
            self._q = _ffi.NULL


class VerbsListener(Listener):
    def __init__(
        self, transport: VerbsTransport, address: str, exports: list[VerbsRegion], info: dict[str, Any]
    ) -> None:
        from pyverbs import cm_enums as ce
        from pyverbs.cmid import CMID, AddrInfo, CMEventChannel
        from pyverbs.pyverbs_error import PyverbsError

        self.transport = transport
        self.address = address
        self._exports = exports
        self._info = info
        host, port = _split_address(address)
        self.channel = CMEventChannel()
        self._fd = _lib.ep_v_cm_channel_fd(_raw(self.channel))
        _checked("CMEventChannel", 0 if self._fd >= 0 else -1)
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
        _checked("rdma_cm id", _lib.ep_v_cm_id_check(_raw(child), _raw(self.channel)))
        channel = CMEventChannel()
        rc = _lib.ep_v_cm_migrate(_raw(child), _raw(channel))
        if rc:
            child.close()
            channel.close()
            raise TransportError(f"rdma_migrate_id failed ({rc})")
        hello = t._alloc("hello", _HELLO_HEADER + _HELLO_CAP, Access.REMOTE_READ, track=False)
        conn = VerbsConnection(t, t._next_id(), child, channel, hello)
        try:
            conn._to_rts()
            child.accept(
                _conn_param(
                    conn.qp.qp_num, _ACCEPT_PDATA.pack(_MAGIC, conn.conn_id, hello.addr, hello.rkey, _HELLO_CAP)
                )
            )
            _expect(
                channel, conn.fileno(), ce.RDMA_CM_EVENT_ESTABLISHED, 5.0, f"accepting on {self.address}"
            ).ack_cm_event()
            conn.peer_assigned_id = peer_id
            conn._learn(conn._read_hello(h_addr, h_rkey, h_len))
            t._track(conn)
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


def _publish(hello: VerbsRegion, message: dict[str, Any], state: int) -> None:
    """Write the hello body, then its header as one 8-byte store: the peer polls the header."""
    data = json.dumps(message).encode()
    if len(data) > _HELLO_CAP:
        raise TransportError(f"hello of {len(data)} bytes exceeds {_HELLO_CAP}")
    hello.buf[_HELLO_HEADER : _HELLO_HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
    hello.buf[:8].view(np.uint64)[0] = np.uint64(len(data) | (state << 32))


class VerbsTransport(Transport):
    """An endpoint on one RDMA device (``device``, default the first); ``gid_index`` is checked
    to exist (rdma_cm picks the GID from the IP address of each connection)."""

    name = "verbs"

    def __init__(
        self,
        device: str | None = None,
        gid_index: int | None = None,
        port: int = 1,
        recv_depth: int = 1024,
        cq_entries: int = 4096,
    ) -> None:
        try:
            from pyverbs import device as d
            from pyverbs.cq import CQ, CompChannel
            from pyverbs.pd import PD
            from pyverbs.pyverbs_error import PyverbsError
            from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr
        except ImportError as exc:
            raise TransportUnavailable(
                f"verbs transport: pyverbs is not importable ({exc}); apt-get install python3-pyverbs and use "
                "/usr/bin/python3 (or a venv made with --system-site-packages), or use --transport loopback"
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
        self.ctx_ptr = _raw(self.ctx)
        _checked("Context", _lib.ep_v_check_context(self.ctx_ptr, self.ctx.cmd_fd))
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
        self.channel_ptr = _raw(self.cc)
        _checked("CompChannel", 0 if _lib.ep_v_comp_channel_fd(self.channel_ptr, self.ctx_ptr) >= 0 else -1)
        self.rcq = CQ(self.ctx, cq_entries, None, self.cc, 0)
        self.rcq_ptr = _raw(self.rcq)
        _checked("CQ", _lib.ep_v_check_cq(self.rcq_ptr, self.ctx_ptr, self.rcq.cqe))
        self.srq = SRQ(self.pd, SrqInitAttr(SrqAttr(max_wr=recv_depth, max_sge=1)))
        self.srq_ptr = _raw(self.srq)
        _checked("SRQ", _lib.ep_v_check_srq(self.srq_ptr, self.ctx_ptr))
        self.cq = VerbsCQ(self, recv_depth)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.connections: dict[int, VerbsConnection] = {}
        self._by_qpn: dict[int, int] = {}
        self._regions: list[VerbsRegion] = []
        self._listeners: list[VerbsListener] = []
        # Every QP lets the peer READ (it reads this side's hello at setup); MRs narrow it per region.
        self.qp_access = _ibv_access(Access.REMOTE_READ)

    def _next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def _track(self, conn: VerbsConnection) -> None:
        with self._lock:
            self.connections[conn.conn_id] = conn
            self._by_qpn = {**self._by_qpn, conn.qp.qp_num: conn.conn_id}

    def _forget(self, conn: VerbsConnection) -> None:
        with self._lock:
            self.connections.pop(conn.conn_id, None)
            self._by_qpn = {q: c for q, c in self._by_qpn.items() if c != conn.conn_id}

    def _alloc(self, name: str, length: int, access: Access, track: bool = True) -> VerbsRegion:
        mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return self._register_buffer(name, np.frombuffer(mm, dtype=np.uint8), access, keep=mm, track=track)

    def _register_buffer(self, name: str, buf: np.ndarray, access: Access, keep: Any, track: bool) -> VerbsRegion:
        from pyverbs.mr import MR

        mr = MR(self.pd, buf.nbytes, _ibv_access(access), address=int(buf.ctypes.data))
        region = VerbsRegion(name, buf, access, mr, keep)
        if track:
            self._regions.append(region)
        return region

    def register(self, name: str, length: int, access: Access, buffer: np.ndarray | None = None) -> VerbsRegion:
        """Allocate and register ``length`` bytes, or register ``buffer`` (memory someone else owns,
        e.g. the agent's frames, shared with edges) as it is: the NIC reads and writes it in place."""
        if length <= 0:
            raise ValueError(f"region {name!r}: length must be positive, got {length}")
        # The QP must allow every kind of remote access some region grants; MRs then restrict it.
        self.qp_access |= _ibv_access(access)
        if buffer is None:
            return self._alloc(name, length, access)
        if buffer.dtype != np.uint8 or buffer.nbytes != length or not buffer.flags.c_contiguous:
            raise ValueError(f"region {name!r}: buffer must be {length} contiguous bytes (uint8)")
        return self._register_buffer(name, buffer, access, keep=buffer, track=True)

    def register_device(self, name: str, memory: Any, access: Access) -> VerbsDeviceRegion:
        """Register GPU memory for peers to access as ``access`` allows: ``memory`` is a
        :class:`edgepath.dma.gpu.DeviceSlots`, whose ``register_for_rdma`` tries dma-buf first and
        nvidia-peermem as the logged fallback (``RdmaRegistrationError`` naming both reasons)."""
        self.qp_access |= _ibv_access(access)
        mr, how = memory.register_for_rdma(self.pd, _ibv_access(access))
        # pyverbs' DmaBufMR registers with iova = its offset into the dma-buf; peermem, at the pointer.
        addr = int(mr.offset) if how == "dma-buf" else int(memory.address)
        region = VerbsDeviceRegion(name, int(memory.nbytes), access, mr, addr, how)
        self._regions.append(region)
        log.info("%s: %d bytes of GPU memory registered through %s", name, region.length, how)
        return region

    def listen(self, address: str, exports: list[MemoryRegion], info: dict[str, Any]) -> VerbsListener:
        listener = VerbsListener(self, address, _own(exports), info)
        self._listeners.append(listener)
        return listener

    def connect(
        self, address: str, exports: list[MemoryRegion], info: dict[str, Any], timeout: float = 5.0
    ) -> VerbsConnection:
        from pyverbs import cm_enums as ce
        from pyverbs import enums as e
        from pyverbs.cmid import CMID, AddrInfo, CMEventChannel
        from pyverbs.pyverbs_error import PyverbsError

        host, port = _split_address(address)
        regions = _own(exports)
        body = json.dumps({"exports": [r.describe() for r in regions], "info": info}).encode()
        if len(body) > _HELLO_CAP:
            raise TransportError(f"hello of {len(body)} bytes exceeds {_HELLO_CAP}")
        hello = self._alloc("hello", len(body), Access.REMOTE_READ, track=False)
        hello.buf[:] = np.frombuffer(body, dtype=np.uint8)
        channel = CMEventChannel()
        cmid = CMID(creator=channel, port_space=ce.RDMA_PS_TCP)
        conn = VerbsConnection(self, self._next_id(), cmid, channel, hello)
        fd = conn.fileno()
        deadline = time.monotonic() + timeout
        try:
            try:
                cmid.resolve_addr(
                    AddrInfo(dst=host, dst_service=str(port), port_space=ce.RDMA_PS_TCP), int(timeout * 1000)
                )
                _expect(channel, fd, ce.RDMA_CM_EVENT_ADDR_RESOLVED, timeout, f"resolving {address}").ack_cm_event()
                cmid.resolve_route(int(timeout * 1000))
                _expect(channel, fd, ce.RDMA_CM_EVENT_ROUTE_RESOLVED, timeout, f"route to {address}").ack_cm_event()
                conn._modify(e.IBV_QPS_INIT)
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
            conn._modify(e.IBV_QPS_RTR)
            conn._modify(e.IBV_QPS_RTS)
            cmid.establish()
            conn.peer_assigned_id = peer_id
            conn._learn(self._await_hello(conn, h_addr, h_rkey, h_cap, deadline, address))
        except Exception:
            conn.close()
            raise
        self._track(conn)
        return conn

    def _await_hello(
        self, conn: VerbsConnection, addr: int, rkey: int, cap: int, deadline: float, address: str
    ) -> dict[str, Any]:
        """RDMA READ the acceptor's hello header until it is published, then its body."""
        words = conn.ctl.buf[8:16].view(np.uint64)
        pause = 1e-4
        while True:
            conn._op(_lib.EP_V_READ, conn.ctl.addr + 8, conn.ctl.lkey, 8, addr, rkey, 0, "read hello header")
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
        message = conn._read_hello(addr + _HELLO_HEADER, rkey, length)
        if state != _ACCEPTED:
            raise TransportError(f"{address} refused the connection: {message.get('refused', 'no reason given')}")
        return message

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


def _own(exports: list[MemoryRegion]) -> list[VerbsRegion]:
    for region in exports:
        if not isinstance(region, VerbsRegion):
            raise TransportError(f"region {region.name!r} was not registered with the verbs transport")
    return list(exports)  # type: ignore[arg-type]
