"""The ``loopback`` transport: RDMA semantics between processes on one machine.

Registered memory is a ``memfd`` mapped by both sides; remote CAS is a C11 atomic
on the shared word; WRITE is one ``memcpy`` into the peer's mapping (the DMA a
NIC would do); WRITE_WITH_IMM additionally posts to the peer's completion queue,
a shared-memory MPSC ring with an eventfd for sleeping consumers.  Connection
management (the rdma_cm role) is a Unix ``SOCK_SEQPACKET`` socket: first the
peer-secret handshake (:mod:`edgepath.transports.peer_auth`: opening, answer,
proof), then each side sends the descriptors of the regions it exports, and
nothing else -- the connector with its proof, once the listener proved itself;
the listener once the connector's proof checked out.  The socket stays open;
its EOF is the disconnect event.

Every memfd is sealed at its size (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``),
and a peer's descriptors are mapped only when sealed against shrinking and as
long as their regions say: a peer cannot truncate memory this side writes into
and make it fault (SIGBUS).  A peer holds the whole memfd it was given, so on
one machine access is enforced by the verbs' checks in this process, not by the
kernel (docs/DATAPATH.md, "Who may touch what").

Caller-owned memory (``register(..., buffer=)``) is registered in place.  It can
be exported only when it lies inside memory this process got from a loopback
registration (it is then shared through that memfd, at its offset): any other
memory has no descriptor a peer could map, so exporting it is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import mmap
import os
import socket
import struct
import time
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
    Incoming,
    Listener,
    MemoryRegion,
    RemoteRegion,
    TransferCounters,
    Transport,
    TransportError,
    check_buffer,
)
from edgepath.transports.peer_auth import (
    HANDSHAKE_TIMEOUT,
    MALFORMED,
    NO_HANDSHAKE,
    TIMED_OUT,
    ConnectorHandshake,
    ListenerHandshake,
    PeerKeys,
    PeerRefused,
)

#: 2: the peer-secret handshake before any descriptor is sent (1 sent them at once)
PROTOCOL_VERSION = 2
#: a refusal's reason: a peer's memory that could shrink under this side's mapping, or is shorter than described
UNSEALED = "memory not sealed"
#: what every memfd here is sealed with once sized: it can neither shrink nor grow, and no seal can be taken off
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
DEFAULT_CQ_CAPACITY = 1 << 14
_MAX_MESSAGE = 1 << 16
_MAX_FDS = 64
# Plain ints for the per-operation access checks (IntFlag arithmetic costs microseconds).


def sealed_memfd(name: str, length: int) -> int:
    """A memfd of ``length`` bytes sealed at that size (:data:`SEALS`)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def check_peer_memory(fd: int, end: int, what: str) -> None:
    """Refuse a peer's descriptor that could shrink under this side's mapping (a write there would fault: SIGBUS):
    it must be a memfd sealed against shrinking, at least ``end`` bytes long."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise PeerRefused(UNSEALED, f"the peer's {what} is not a memfd sealed against shrinking (F_SEAL_SHRINK)")
    size = os.fstat(fd).st_size
    if size < end:
        raise PeerRefused(UNSEALED, f"the peer's {what} holds {size} bytes, fewer than the {end} it describes")


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
        """Fresh shared memory: a memfd of ``length`` bytes, sealed at that size, mapped here."""
        fd = sealed_memfd(f"edgepath-{name}", length)
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
        self.mem_fd = sealed_memfd("edgepath-cq", size)
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
        try:
            size = int(lib.ep_cq_size(capacity))
            check_peer_memory(mem_fd, size, "completion queue")
            self._map = _Mapping(mem_fd, size)
        except BaseException:
            os.close(event_fd)
            raise
        finally:
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


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _recv(sock: socket.socket, deadline: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """The next setup message and the descriptors that came with it; by ``deadline`` (``time.monotonic()``) when
    given, else within the socket's timeout.  A refusal from the peer is raised as :class:`PeerRefused`."""
    if deadline is not None:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
    if not data:
        _close_all(fds)
        raise TransportError("peer closed the connection during setup")
    try:
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        _close_all(fds)
        raise PeerRefused(MALFORMED, f"a connection message that is not JSON ({exc})") from exc
    if message.get("version") != PROTOCOL_VERSION:
        _close_all(fds)
        raise PeerRefused(
            NO_HANDSHAKE,
            f"the peer speaks loopback protocol {message.get('version')!r}, this side {PROTOCOL_VERSION} "
            "(which opens with the peer-secret handshake)",
        )
    if "refused" in message:
        _close_all(fds)
        raise PeerRefused(str(message.get("reason", "refused")), f"the peer refused: {message['refused']}")
    return message, fds


def _field(message: dict[str, Any], key: str) -> bytes:
    """A handshake message's field (hex) as bytes; :class:`PeerRefused` when it is missing or not hex."""
    try:
        return bytes.fromhex(message[key])
    except (KeyError, TypeError, ValueError):
        raise PeerRefused(
            NO_HANDSHAKE if key == "opening" else MALFORMED, f"no {key!r} in the peer's message"
        ) from None


def _refuse(sock: socket.socket, refused: PeerRefused) -> None:
    """Tell the peer why (best effort: it may be gone, or not reading)."""
    with contextlib.suppress(OSError):
        sock.settimeout(0.1)
        data = json.dumps({"version": PROTOCOL_VERSION, "refused": str(refused), "reason": refused.reason})
        sock.send(data.encode())


class LoopbackConnection(Connection):
    def __init__(
        self,
        transport: LoopbackTransport,
        sock: socket.socket,
        conn_id: int,
        message: dict[str, Any],
        fds: list[int],
    ) -> None:
        """Takes ``fds`` (the peer's CQ memfd and eventfd, then one per export): each is closed here, mapped or
        not; a descriptor that is not sealed memory of the length described is refused (TransportError)."""
        self.transport = transport
        self.sock = sock
        self.conn_id = conn_id
        self.counters = TransferCounters()
        self._alive = True
        self.remote: dict[str, RemoteRegion] = {}
        self._maps: list[_Mapping] = []
        left = list(fds)
        try:
            self.peer_assigned_id = int(message["conn_id"])
            self.peer_info = dict(message.get("info", {}))
            self._tag = self.peer_assigned_id << 32
            exports = list(message["exports"])
            if len(left) != 2 + len(exports):
                raise TransportError(f"the peer sent {len(left)} descriptors for {len(exports)} exports")
            mem_fd, event_fd = left.pop(0), left.pop(0)
            self._peer_cq = _PeerCQ(mem_fd, event_fd, int(message["cq_capacity"]))
            for desc in exports:
                fd = left.pop(0)
                try:
                    name, length, offset = str(desc["name"]), int(desc["length"]), int(desc.get("offset", 0))
                    if length <= 0 or offset < 0:
                        raise TransportError(f"the peer's region {name!r}: length {length} at offset {offset}")
                    check_peer_memory(fd, offset + length, f"region {name!r}")
                    access = Access(int(desc["access"]))
                    writable = bool(access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC))
                    mapping = _Mapping(fd, length, writable, offset)
                finally:
                    os.close(fd)
                self._maps.append(mapping)
                self.remote[name] = RemoteRegion(name, length, access, mapping)
        except (KeyError, TypeError, ValueError) as exc:
            _close_all(left)
            raise TransportError(f"malformed hello from the peer: {exc!r}") from exc
        except BaseException:
            _close_all(left)
            raise

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
    transport: LoopbackTransport

    def __init__(
        self, transport: LoopbackTransport, address: str, exports: list[LoopbackRegion], info: dict[str, Any]
    ) -> None:
        super().__init__(transport, address)
        self._exports = exports
        self._info = info
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        _claim_path(address)
        self.sock.bind(address)
        self.sock.listen(64)

    def incoming(self, timeout: float | None = None) -> LoopbackIncoming | None:
        self.sock.settimeout(timeout)
        try:
            sock, _ = self.sock.accept()
        except (TimeoutError, BlockingIOError):
            return None
        return LoopbackIncoming(self, sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)


def _peer_process(sock: socket.socket) -> str:
    """Who is at the other end of a Unix socket: its process and user (SO_PEERCRED)."""
    try:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return "a peer"
    return f"pid {pid} (uid {uid})"


class LoopbackIncoming(Incoming):
    """A peer accepted on the socket, not set up yet."""

    def __init__(self, listener: LoopbackListener, sock: socket.socket) -> None:
        self.listener = listener
        self.sock = sock
        self.peer = _peer_process(sock)

    def complete(self, admit: Admit | None, deadline: float) -> LoopbackConnection:
        listener, transport, sock = self.listener, self.listener.transport, self.sock
        conn = None
        try:
            try:
                opening, fds = _recv(sock, deadline)
                if fds:
                    _close_all(fds)
                    raise PeerRefused(MALFORMED, "descriptors sent before the handshake")
                handshake = ListenerHandshake(transport.keys, time.monotonic())
                answer = handshake.answer(_field(opening, "opening"))
                _send(sock, {"version": PROTOCOL_VERSION, "answer": answer.hex()}, [])
                message, fds = _recv(sock, deadline)
                try:
                    handshake.verify(_field(message, "proof"))
                except PeerRefused:
                    _close_all(fds)  # the unproved peer's descriptors, never mapped
                    raise
            except PeerRefused as refused:
                _refuse(sock, refused)
                raise
            except TimeoutError as exc:
                raise PeerRefused(TIMED_OUT, "nothing more from the peer within the handshake timeout") from exc
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                conn = LoopbackConnection(transport, sock, transport._next_id(), message, fds)
            except TransportError as exc:
                _refuse(sock, exc if isinstance(exc, PeerRefused) else PeerRefused(MALFORMED, str(exc)))
                raise
            info = dict(listener._info)
            if admit is not None:
                try:
                    info.update(admit(conn))
                except ValueError as exc:
                    _refuse(sock, PeerRefused("not admitted", str(exc)))
                    raise
            exports = listener._exports
            _send(sock, transport._hello(conn.conn_id, exports, info), transport._hello_fds(exports))
        except BaseException:
            if conn is not None:
                conn.close()
            sock.close()
            raise
        return transport._established(conn)

    def abort(self) -> None:
        self.sock.close()


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

    def __init__(
        self, keys: PeerKeys, cq_capacity: int = DEFAULT_CQ_CAPACITY, handshake_timeout: float = HANDSHAKE_TIMEOUT
    ) -> None:
        """``keys``: the peer secrets (:class:`~edgepath.transports.peer_auth.PeerKeys`) every peer must prove it
        holds, and this side proves it holds; ``handshake_timeout``: seconds a peer has to finish proving it."""
        self.keys = keys
        self.handshake_timeout = handshake_timeout
        self.cq: LoopbackCQ = LoopbackCQ(cq_capacity)
        self._ids = itertools.count(1)
        self.connections: dict[int, LoopbackConnection] = {}
        self._regions: list[LoopbackRegion] = []

    def _next_id(self) -> int:
        return next(self._ids)

    def _established(self, conn: LoopbackConnection) -> LoopbackConnection:
        """``conn`` through its handshake, on either side: its socket blocking again (the handshake's deadline is
        over), and tracked until it closes."""
        conn.sock.settimeout(None)
        self.connections[conn.conn_id] = conn
        return conn

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
        deadline = time.monotonic() + timeout
        try:
            try:
                handshake = ConnectorHandshake(self.keys, time.monotonic())
                _send(sock, {"version": PROTOCOL_VERSION, "opening": handshake.opening().hex()}, [])
                answer, fds = _recv(sock, deadline)
                _close_all(fds)  # nothing comes with the answer; whatever did is not mapped
                proof = handshake.proof(_field(answer, "answer"))
                hello = {**self._hello(conn_id, regions, info), "proof": proof.hex()}
                _send(sock, hello, self._hello_fds(regions))
                message, fds = _recv(sock, deadline)
                conn = LoopbackConnection(self, sock, conn_id, message, fds)
            except PeerRefused as exc:
                raise PeerRefused(exc.reason, f"{address}: {exc}") from None
            except OSError as exc:  # a peer too slow to answer within the timeout, or gone meanwhile
                raise TransportError(f"connection setup with {address} failed: {exc}") from exc
        except BaseException:  # whatever went wrong, the half-made connection holds no socket
            sock.close()
            raise
        return self._established(conn)

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
