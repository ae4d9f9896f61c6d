"""The ``loopback`` transport: RDMA semantics between processes on one machine.

Registered memory is a ``memfd`` mapped by both sides; remote CAS is a C11 atomic
on the shared word; WRITE is one ``memcpy`` into the peer's mapping (the DMA a
NIC would do); WRITE_WITH_IMM additionally posts to the peer's completion queue,
a shared-memory MPSC ring with an eventfd for sleeping consumers.  Connection
management (the rdma_cm role) is a Unix ``SOCK_SEQPACKET`` socket: each side
sends the descriptors of the regions it exports, and nothing else, so a peer can
only ever touch exported memory, with the access it was granted.  The socket
stays open; its EOF is the disconnect event.

Caller-owned memory (``register(..., buffer=)``) is registered in place.  It can
be exported only when it lies inside memory this process got from a loopback
registration (it is then shared through that memfd, at its offset): any other
memory has no descriptor a peer could map, so exporting it is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import socket
import weakref
from typing import Any

import numpy as np

from edgepath.native.abi import ffi, lib
from edgepath.transports.base import (
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
    check_buffer,
)

PROTOCOL_VERSION = 1
DEFAULT_CQ_CAPACITY = 1 << 14
_MAX_MESSAGE = 1 << 16
_MAX_FDS = 64
# Plain ints for the per-operation access checks (IntFlag arithmetic costs microseconds).


class _Mapping:
    """A shared mapping of ``length`` bytes at ``offset`` of ``fd``, plus the cffi pointer the C
    primitives use (mmap itself needs a page-aligned offset: the slack before is mapped, not shown)."""

    def __init__(self, fd: int, length: int, writable: bool = True, offset: int = 0) -> None:
        self.length = length
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.mm = mmap.mmap(fd, length + offset - start, flags=mmap.MAP_SHARED, prot=prot, offset=start)
        self.array = np.frombuffer(self.mm, dtype=np.uint8, count=length, offset=offset - start)
        self.ptr = ffi.cast("char *", ffi.from_buffer(self.mm)) + (offset - start)


class LoopbackRegion(MemoryRegion):
    """A registered region: ``fd`` and ``offset`` say where peers map it (``fd`` is None for
    caller-owned memory that is not shared memory: usable locally, never exported)."""

    def __init__(self, name: str, buf: np.ndarray, access: Access, fd: int | None, offset: int = 0) -> None:
        super().__init__(name=name, buf=buf, access=access)
        self.fd = fd
        self.offset = offset
        self.ptr = ffi.cast("char *", ffi.from_buffer(buf))
        self._map: _Mapping | None = None

    @classmethod
    def allocate(cls, name: str, length: int, access: Access) -> LoopbackRegion:
        """Fresh shared memory: a memfd of ``length`` bytes, mapped here."""
        fd = os.memfd_create(f"edgepath-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, length)
        mapping = _Mapping(fd, length)
        region = cls(name, mapping.array, access, fd)
        region._map = mapping
        _SHARED.add(region)
        return region

    @classmethod
    def wrap(cls, name: str, buffer: np.ndarray, access: Access) -> LoopbackRegion:
        """``buffer`` in place, shared through the memfd of the loopback region it lies in, if any."""
        start = int(buffer.ctypes.data)
        for owner in list(_SHARED):
            base = int(owner.buf.ctypes.data)
            if owner.fd is not None and base <= start and start + buffer.nbytes <= base + owner.buf.nbytes:
                return cls(name, buffer, access, os.dup(owner.fd), owner.offset + start - base)
        return cls(name, buffer, access, None)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "length": self.buf.nbytes, "access": int(self.access), "offset": self.offset}

    def export_fd(self) -> int:
        """The descriptor a peer maps this region by; refuses memory that has none."""
        if self.fd is None:
            raise TransportError(
                f"region {self.name!r} wraps caller memory that is not loopback shared memory, so no peer can "
                "map it: register it without buffer=, or with a view of a loopback-registered region"
            )
        return self.fd

    def close(self) -> None:
        _SHARED.discard(self)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# Live regions that own shared memory: where register(buffer=) looks for a memfd to export by.
_SHARED: weakref.WeakSet[LoopbackRegion] = weakref.WeakSet()


class LoopbackCQ(CompletionQueue):
    """An MPSC ring in shared memory, plus the eventfd a sleeping consumer waits on."""

    def __init__(self, capacity: int = DEFAULT_CQ_CAPACITY) -> None:
        self.capacity = capacity
        size = int(lib.ep_cq_size(capacity))
        self.mem_fd = os.memfd_create("edgepath-cq", os.MFD_CLOEXEC)
        os.ftruncate(self.mem_fd, size)
        self._map = _Mapping(self.mem_fd, size)
        if lib.ep_cq_init(self._map.ptr, capacity) != lib.EP_OK:
            raise ValueError(f"CQ capacity must be a power of two, got {capacity}")
        self.event_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._out = ffi.new("uint64_t[]", 256)

    def _convert(self, n: int) -> list[Completion]:
        if n < 0:
            raise TransportError(f"completion queue wait failed ({n})")
        out = self._out
        return [Completion(int(out[i]) >> 32, int(out[i]) & 0xFFFFFFFF) for i in range(n)]

    def poll(self, max_entries: int = 64) -> list[Completion]:
        return self._convert(lib.ep_cq_poll(self._map.ptr, self._out, min(max_entries, 256)))

    def wait(self, timeout: float | None, spin: float = 0.0, max_entries: int = 64) -> list[Completion]:
        timeout_ns = -1 if timeout is None else int(timeout * 1e9)
        n = lib.ep_cq_wait(self._map.ptr, self.event_fd, self._out, min(max_entries, 256), timeout_ns, int(spin * 1e9))
        return self._convert(n)

    def fileno(self) -> int:
        return self.event_fd

    def arm(self) -> bool:
        return bool(lib.ep_cq_rearm(self._map.ptr, self.event_fd))

    def close(self) -> None:
        """Idempotent: a descriptor closed twice could be another one's by then."""
        for fd in (self.event_fd, self.mem_fd):
            if fd >= 0:
                os.close(fd)
        self.event_fd = self.mem_fd = -1


class _PeerCQ:
    """The peer's completion queue, mapped for posting."""

    def __init__(self, mem_fd: int, event_fd: int, capacity: int) -> None:
        self._map = _Mapping(mem_fd, int(lib.ep_cq_size(capacity)))
        os.close(mem_fd)
        self.ptr = self._map.ptr
        self.event_fd = event_fd

    def close(self) -> None:
        os.close(self.event_fd)


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps(message).encode()
    if len(data) > _MAX_MESSAGE:
        raise TransportError("connection message too large")
    socket.send_fds(sock, [data], fds)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        raise TransportError("peer closed the connection during setup")
    try:
        message = json.loads(data)
    except ValueError as exc:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"malformed connection message: {exc}") from exc
    if message.get("version") != PROTOCOL_VERSION:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"peer speaks loopback protocol {message.get('version')!r}, this side {PROTOCOL_VERSION}")
    return message, fds


class LoopbackConnection(Connection):
    def __init__(
        self,
        transport: LoopbackTransport,
        sock: socket.socket,
        conn_id: int,
        message: dict[str, Any],
        fds: list[int],
    ) -> None:
        self.transport = transport
        self.sock = sock
        self.conn_id = conn_id
        self.peer_assigned_id = int(message["conn_id"])
        self.peer_info = dict(message.get("info", {}))
        self.counters = TransferCounters()
        self._tag = self.peer_assigned_id << 32
        self._alive = True
        self._peer_cq = _PeerCQ(fds[0], fds[1], int(message["cq_capacity"]))
        self.remote: dict[str, RemoteRegion] = {}
        self._maps: list[_Mapping] = []
        for desc, fd in zip(message["exports"], fds[2:], strict=True):
            access = Access(int(desc["access"]))
            writable = bool(access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC))
            mapping = _Mapping(fd, int(desc["length"]), writable, int(desc.get("offset", 0)))
            os.close(fd)
            self._maps.append(mapping)
            self.remote[desc["name"]] = RemoteRegion(desc["name"], int(desc["length"]), access, mapping)

    # -- the verbs' primitives (checked by Connection) -------------------------------
    def _cas(self, remote: RemoteRegion, offset: int, expected: int, desired: int) -> int:
        return int(lib.ep_cas64(ffi.cast("uint64_t *", remote.handle.ptr + offset), expected, desired))

    def _put(self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int, imm: int | None) -> None:
        if imm is None:
            lib.ep_copy(remote.handle.ptr + ro, _local(local, lo, n), n)
            return
        peer_cq = self._peer_cq
        rc = lib.ep_write_imm(
            remote.handle.ptr + ro, _local(local, lo, n), n, peer_cq.ptr, self._tag | imm, peer_cq.event_fd
        )
        self._posted(rc)

    def _posted(self, rc: int) -> None:
        if rc != lib.EP_OK:
            raise TransportError(f"peer completion queue overrun on connection {self.conn_id}")

    def _put_then_imm(
        self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int, bell: tuple[int, int, int], imm: int
    ) -> None:
        """The data and the doorbell copied in place, then the doorbell's completion: one C call."""
        bo, bro, bn = bell
        peer_cq = self._peer_cq
        base = remote.handle.ptr
        rc = lib.ep_write_then_imm(
            base + ro,
            _local(local, lo, n),
            n,
            base + bro,
            _local(local, bo, bn),
            bn,
            peer_cq.ptr,
            self._tag | imm,
            peer_cq.event_fd,
        )
        self._posted(rc)

    def _get(self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int) -> None:
        lib.ep_copy(_local(local, lo, n), remote.handle.ptr + ro, n)

    def local_view(self, remote: RemoteRegion) -> np.ndarray:
        if not self._alive:
            self._closed()
        if self.remote.get(remote.name) is not remote:
            raise TransportError(f"remote region {remote.name!r} does not belong to connection {self.conn_id}")
        return remote.handle.array

    # -- management ------------------------------------------------------------
    def fileno(self) -> int:
        return self.sock.fileno()

    def check_alive(self) -> bool:
        if not self._alive:
            return False
        try:
            data = self.sock.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self._alive = False
        return self._alive

    def close(self) -> None:
        if self.sock.fileno() < 0:
            return
        self._alive = False
        self.sock.close()
        self._peer_cq.close()
        self.transport._forget(self)


def _local(local: MemoryRegion, offset: int, length: int) -> Any:
    """The C pointer to ``[offset, offset+length)`` of a region registered with this transport."""
    if not isinstance(local, LoopbackRegion):
        raise TransportError(f"region {local.name!r} was not registered with the loopback transport")
    if offset < 0 or length < 0 or offset + length > local.buf.nbytes:
        raise TransportError(
            f"local access [{offset}, {offset + length}) outside region {local.name!r} of {local.buf.nbytes} bytes"
        )
    return local.ptr + offset


class LoopbackListener(Listener):
    def __init__(
        self, transport: LoopbackTransport, address: str, exports: list[LoopbackRegion], info: dict[str, Any]
    ) -> None:
        self.transport = transport
        self.address = address
        self._exports = exports
        self._info = info
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        _claim_path(address)
        self.sock.bind(address)
        self.sock.listen(64)

    def accept(self, timeout: float | None = None, admit: Admit | None = None) -> LoopbackConnection | None:
        self.sock.settimeout(timeout)
        try:
            sock, _ = self.sock.accept()
        except TimeoutError:
            return None
        sock.settimeout(5.0)
        conn = None
        try:
            message, fds = _recv(sock)
            conn = LoopbackConnection(self.transport, sock, self.transport._next_id(), message, fds)
            info = dict(self._info)
            if admit is not None:
                info.update(admit(conn))
            _send(
                sock, self.transport._hello(conn.conn_id, self._exports, info), self.transport._hello_fds(self._exports)
            )
        except (OSError, TransportError, KeyError, ValueError):
            if conn is not None:
                conn.close()
            sock.close()
            raise
        sock.settimeout(None)
        self.transport._track(conn)
        return conn

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)


def _claim_path(address: str) -> None:
    """Remove a stale socket file (nobody listening) so a restart can bind again."""
    if not os.path.exists(address):
        os.makedirs(os.path.dirname(address) or ".", exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(address)
        return
    finally:
        probe.close()
    raise TransportError(f"{address}: another process is already listening there")


class LoopbackTransport(Transport):
    """Shared-memory transport; ``cq_capacity`` bounds this endpoint's outstanding completions."""

    name = "loopback"

    def __init__(self, cq_capacity: int = DEFAULT_CQ_CAPACITY) -> None:
        self.cq: LoopbackCQ = LoopbackCQ(cq_capacity)
        self._ids = itertools.count(1)
        self.connections: dict[int, LoopbackConnection] = {}
        self._regions: list[LoopbackRegion] = []

    def _next_id(self) -> int:
        return next(self._ids)

    def _track(self, conn: LoopbackConnection) -> None:
        self.connections[conn.conn_id] = conn

    def _forget(self, conn: LoopbackConnection) -> None:
        self.connections.pop(conn.conn_id, None)

    def register(self, name: str, length: int, access: Access, buffer: np.ndarray | None = None) -> LoopbackRegion:
        if buffer is None:
            if length <= 0:
                raise ValueError(f"region {name!r}: length must be positive, got {length}")
            region = LoopbackRegion.allocate(name, length, access)
        else:
            check_buffer(name, length, buffer)
            region = LoopbackRegion.wrap(name, buffer, access)
        self._regions.append(region)
        return region

    def _hello(self, conn_id: int, exports: list[LoopbackRegion], info: dict[str, Any]) -> dict[str, Any]:
        """Connection private data: this side's id for the connection (the tag the peer posts
        completions with, and a slot server's claimant id for the agent), CQ and exports."""
        return {
            "version": PROTOCOL_VERSION,
            "conn_id": conn_id,
            "cq_capacity": self.cq.capacity,
            "exports": [r.describe() for r in exports],
            "info": info,
        }

    def _hello_fds(self, exports: list[LoopbackRegion]) -> list[int]:
        return [self.cq.mem_fd, self.cq.event_fd, *(r.export_fd() for r in exports)]

    def listen(self, address: str, exports: list[MemoryRegion], info: dict[str, Any]) -> LoopbackListener:
        return LoopbackListener(self, address, _own(exports), info)

    def connect(
        self, address: str, exports: list[MemoryRegion], info: dict[str, Any], timeout: float = 5.0
    ) -> LoopbackConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise TransportError(f"nothing is listening at {address} ({exc.strerror})") from exc
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        conn_id = self._next_id()
        regions = _own(exports)
        try:
            _send(sock, self._hello(conn_id, regions, info), self._hello_fds(regions))
            message, fds = _recv(sock)
        except OSError as exc:  # a peer too slow to answer within the timeout, or gone meanwhile
            sock.close()
            raise TransportError(f"connection setup with {address} failed: {exc}") from exc
        except TransportError:
            sock.close()
            raise
        conn = LoopbackConnection(self, sock, conn_id, message, fds)
        sock.settimeout(None)
        self._track(conn)
        return conn

    def close(self) -> None:
        """Idempotent."""
        for conn in list(self.connections.values()):
            conn.close()
        self.cq.close()
        for region in self._regions:
            region.close()
        self._regions.clear()


def _own(exports: list[MemoryRegion]) -> list[LoopbackRegion]:
    owned = []
    for region in exports:
        if not isinstance(region, LoopbackRegion):
            raise TransportError(f"region {region.name!r} was not registered with the loopback transport")
        region.export_fd()
        owned.append(region)
    return owned
