"""The verbs transport's data path: registered memory, the RC connection's one-sided operations and
the shared receive completion queue, each operation one call into ``native/edgepath_verbs.c``
(post the work request, wait for its completion) with no further Python calls when it succeeds.

Connection setup (rdma_cm, the hello exchange) is :mod:`edgepath.transports.verbs_setup`; the device,
protection domain and queues are owned by :class:`edgepath.transports.verbs.VerbsTransport`.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepath.transports.base import (
    Access,
    Completion,
    CompletionQueue,
    Connection,
    MemoryRegion,
    RemoteRegion,
    TransferCounters,
    TransportError,
    TransportUnavailable,
)
from edgepath.transports.verbs_shim import cm_channel_fd, cq_handle, ffi, lib, qp_handle

if TYPE_CHECKING:
    from edgepath.transports.verbs import VerbsTransport

#: bytes of a connection's control region before its hello buffer (CAS result, hello header)
CTL_HEADER = 64
#: largest hello (exports and info, JSON) either side publishes
HELLO_CAP = 16384
_OP_WRITE, _OP_WRITE_IMM = lib.EP_V_WRITE, lib.EP_V_WRITE_IMM


def op_timeout_ns(hang_timeout: float) -> int:
    """How long one synchronous operation may wait for its completion before it fails (and its link is down):
    0.8 of the hang timeout its peers are judged by, since whoever waits -- an agent, or a slot server writing a
    result -- stands still meanwhile (its loop, its heartbeat: a slot server waiting longer on an agent that died
    would be called hung by every other agent; an edge's event loop waits with its agent).  Far above the retry
    budget (6 retries of a 67 ms ACK timeout: an operation to a peer that is gone fails by retries first,
    verbs_setup.RETRY_COUNT), so this wait is a backstop; an operation that does run out of it is stopped (its QP
    moved to ERR), never left queued to run later."""
    return int(0.8 * hang_timeout * 1e9)


def ibv_access(access: Access) -> int:
    """The MR/QP access flags for ``access``, plus local write (READ and CAS results land locally)."""
    from pyverbs import enums as e

    flags = e.IBV_ACCESS_LOCAL_WRITE
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

    @classmethod
    def register(cls, pd: Any, name: str, buf: np.ndarray, access: Access, keep: Any) -> VerbsRegion:
        """Register ``buf`` in place with protection domain ``pd``."""
        from pyverbs.mr import MR

        return cls(name, buf, access, MR(pd, buf.nbytes, ibv_access(access), address=int(buf.ctypes.data)), keep)

    @classmethod
    def allocate(cls, pd: Any, name: str, length: int, access: Access) -> VerbsRegion:
        """Fresh anonymous memory of ``length`` bytes, registered."""
        mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return cls.register(pd, name, np.frombuffer(mm, dtype=np.uint8), access, keep=mm)

    def describe(self) -> dict[str, Any]:
        """What a peer needs to reach this region (its hello entry)."""
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


def own_regions(regions: list[MemoryRegion]) -> list[VerbsRegion]:
    """``regions``, checked to be registered with a verbs transport."""
    owned = []
    for region in regions:
        if not isinstance(region, VerbsRegion):
            raise TransportError(f"region {region.name!r} was not registered with the verbs transport")
        owned.append(region)
    return owned


def cm_event_nowait(channel: Any) -> Any | None:
    """The next rdma_cm event on ``channel`` (a non-blocking channel), or None if there is none."""
    from pyverbs.cmid import CMEvent
    from pyverbs.pyverbs_error import PyverbsRDMAError

    try:
        return CMEvent(channel)
    except PyverbsRDMAError as exc:
        if exc.error_code not in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise TransportError(f"rdma_cm event channel failed: {exc}") from exc
    return None


class VerbsConnection(Connection):
    """One RC QP plus its rdma_cm id, event channel, send CQ and control region (CAS results, the
    peer's hello).  ``hello``: a connector's hello region (its hello for the acceptor to READ, and the mailbox the
    acceptor WRITEs its own into); an acceptor has none -- it writes from its control region."""

    def __init__(
        self, transport: VerbsTransport, conn_id: int, cmid: Any, channel: Any, hello: VerbsRegion | None
    ) -> None:
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
        self._fd = cm_channel_fd(channel)
        self._alive = True
        self.scq = CQ(transport.ctx, 16, None, None, 0)
        self._scq = cq_handle(self.scq, transport.ctx_ptr, self.scq.cqe)
        cap = QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        # sq_sig_all=0: pyverbs signals every WR by default, which gave write_then_imm's unsignaled WRITE a
        # completion of its own; each op waits for exactly one, so later ops returned on stale ones.
        init = QPInitAttr(
            qp_type=e.IBV_QPT_RC, scq=self.scq, rcq=transport.rcq, srq=transport.srq, cap=cap, sq_sig_all=0
        )
        self.qp = QP(transport.pd, init)
        self._qp = qp_handle(self.qp, transport.ctx_ptr, self.qp.qp_num)
        self.ctl = VerbsRegion.allocate(transport.pd, "ctl", CTL_HEADER + HELLO_CAP, Access.NONE)
        self._ctl_ptr = ffi.cast("uint64_t *", self.ctl.addr)
        self._ctl_lkey = self.ctl.lkey
        self._t = transport.op_timeout_ns

    def post_wait(
        self, op: int, laddr: int, lkey: int, length: int, raddr: int, rkey: int, imm: int, what: str
    ) -> None:
        """One work request (``lib.EP_V_*``), waited for; a failure closes the connection for use."""
        rc = lib.ep_v_post_wait(self._qp, self._scq, op, laddr, lkey, length, raddr, rkey, imm, self._t)
        if rc:
            self._failed(rc, what)

    def _failed(self, rc: int, what: str) -> None:
        self._alive = False
        if rc == lib.EP_V_E_TIMEOUT:
            self._stop_queue()
            why = "no completion in time"
        elif rc < 0:
            why = "could not post the work request"
        else:
            why = ffi.string(lib.ep_v_status_str(rc)).decode()
        raise TransportError(f"{what} on connection {self.conn_id} failed: {why}")

    def _stop_queue(self) -> None:
        """Move the QP to ERR: a work request given up on is flushed, not retransmitted until the wire is back
        and run then -- a doorbell the agent already answered 503, a result into a frame it has reused."""
        from pyverbs import enums as e
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QPAttr

        attr = QPAttr()
        attr.qp_state = e.IBV_QPS_ERR
        with contextlib.suppress(PyverbsError):  # already in ERR (nothing is queued then)
            self.qp.modify(attr, e.IBV_QP_STATE)

    # Hot path: one cffi call per verb, no further Python calls when it succeeds (Connection checked it).
    def _cas(self, remote: RemoteRegion, offset: int, expected: int, desired: int) -> int:
        addr, rkey = remote.handle
        rc = lib.ep_v_cas(
            self._qp, self._scq, self._ctl_ptr, self._ctl_lkey, addr + offset, rkey, expected, desired, self._t
        )
        if rc:
            self._failed(rc, "compare-and-swap")
        return int(self._ctl_ptr[0])

    def _put(self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int, imm: int | None) -> None:
        laddr, lkey = _local(local, lo, n)
        addr, rkey = remote.handle
        op = _OP_WRITE if imm is None else _OP_WRITE_IMM
        rc = lib.ep_v_post_wait(self._qp, self._scq, op, laddr, lkey, n, addr + ro, rkey, imm or 0, self._t)
        if rc:
            self._failed(rc, "write" if imm is None else "write-with-immediate")

    def _put_then_imm(
        self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int, bell: tuple[int, int, int], imm: int
    ) -> None:
        """Both work requests in one post, one completion waited for: one round trip, one cffi call."""
        laddr, lkey = _local(local, lo, n)
        bell_laddr, _ = _local(local, bell[0], bell[2])
        addr, rkey = remote.handle
        rc = lib.ep_v_write_then_imm(
            self._qp, self._scq, laddr, lkey, n, addr + ro, rkey, bell_laddr, bell[2], addr + bell[1], imm, self._t
        )
        if rc:
            self._failed(rc, "write + doorbell")

    def _get(self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int) -> None:
        laddr, lkey = _local(local, lo, n)
        addr, rkey = remote.handle
        self.post_wait(lib.EP_V_READ, laddr, lkey, n, addr + ro, rkey, 0, "read")

    def local_view(self, remote: RemoteRegion) -> np.ndarray:
        raise TransportUnavailable(
            f"verbs transport: remote region {remote.name!r} is in the peer's memory, which this side cannot "
            "map; read it with Connection.read into a registered region, or connect over --data-path loopback"
        )

    # -- management ------------------------------------------------------------------
    def fileno(self) -> int:
        return self._fd

    def check_alive(self) -> bool:
        from pyverbs import cm_enums as ce

        while self._alive:
            ev = cm_event_nowait(self.channel)
            if ev is None:
                break
            kind = ev.event_type
            ev.ack_cm_event()
            if kind in (ce.RDMA_CM_EVENT_DISCONNECTED, ce.RDMA_CM_EVENT_DEVICE_REMOVAL, ce.RDMA_CM_EVENT_TIMEWAIT_EXIT):
                self._alive = False
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
            if region is not None:
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
    """The receive CQ of all connections, with its completion channel and SRQ (C poller); a
    completion's QP number is mapped to this side's connection id by ``transport.conn_by_qpn``."""

    def __init__(self, transport: VerbsTransport, recv_depth: int) -> None:
        self._transport = transport
        self._q = lib.ep_vcq_new(transport.rcq_ptr, transport.channel_ptr, transport.srq_ptr, recv_depth)
        if self._q == ffi.NULL:
            raise TransportError("could not post the shared receive queue's work requests")
        self._out = ffi.new("uint64_t[]", 256)

    def _convert(self, n: int) -> list[Completion]:
        if n < 0:
            raise TransportError(f"receive completion queue failed ({n})")
        by_qpn = self._transport.conn_by_qpn
        out = []
        for i in range(n):
            v = int(self._out[i])
            conn_id = by_qpn.get(v >> 32)
            if conn_id is not None:
                out.append(Completion(conn_id, v & 0xFFFFFFFF))
        return out

    def poll(self, max_entries: int = 64) -> list[Completion]:
        return self._convert(lib.ep_vcq_poll(self._q, self._out, min(max_entries, 256)))

    def wait(self, timeout: float | None, spin: float = 0.0, max_entries: int = 64) -> list[Completion]:
        timeout_ns = -1 if timeout is None else int(timeout * 1e9)
        return self._convert(lib.ep_vcq_wait(self._q, self._out, min(max_entries, 256), timeout_ns, int(spin * 1e9)))

    def fileno(self) -> int:
        return int(lib.ep_vcq_fd(self._q))

    def arm(self) -> bool:
        rc = lib.ep_vcq_arm(self._q)
        if rc < 0:
            raise TransportError(f"could not arm the receive completion queue ({rc})")
        return rc > 0

    @property
    def errors(self) -> int:
        """Receive completions that failed (e.g. flushed when a peer's QP went away)."""
        return int(lib.ep_vcq_errors(self._q))

    def close(self) -> None:
        if self._q != ffi.NULL:
            lib.ep_vcq_free(self._q)
            self._q = ffi.NULL
