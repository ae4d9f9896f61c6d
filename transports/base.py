"""The transport interface: the handful of one-sided RDMA verbs the data path needs.

Transports are interchangeable: ``loopback`` (shared memory between processes,
C11 atomics) and ``verbs`` (pyverbs / rdma-core) implement the same classes, and
the agent and slot server are written only against these.

Model (RDMA's): an endpoint *registers* memory regions with the access peers may
have, *exports* some of them when a connection is set up (the peer learns only
those, like rkeys in rdma_cm private data, and only once both sides proved they
hold the peer secret: :mod:`edgepath.transports.peer_auth`), and owns one
completion queue on which immediate-data completions from all of its connections
arrive.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from edgepath.transports.peer_auth import PeerKeys

#: seconds of a still heartbeat after which agents call a slot server unresponsive (``--hang-timeout``): about
#: 30x the longest silence the llama handler left here, beating from inside its steps (docs/DATAPATH.md).  Here
#: because a transport's own per-operation wait follows it (the verbs one waits 0.8 of it).
DEFAULT_HANG_TIMEOUT = 5.0


class TransportError(RuntimeError):
    """A verb failed: remote access error, bounds, a closed connection, a CQ overrun."""


class TransportUnavailable(TransportError):
    """The transport cannot be used on this machine (no device, no driver, no package)."""


class Access(enum.IntFlag):
    """What a peer may do to a region (RDMA's remote access flags)."""

    NONE = 0
    REMOTE_READ = 1
    REMOTE_WRITE = 2
    REMOTE_ATOMIC = 4


_ATOMIC, _WRITE, _READ = int(Access.REMOTE_ATOMIC), int(Access.REMOTE_WRITE), int(Access.REMOTE_READ)


@dataclass(frozen=True, slots=True)
class Completion:
    """An immediate-data completion: which connection it arrived on, and the 32-bit immediate."""

    conn_id: int
    imm: int


@dataclass(eq=False)
class MemoryRegion:
    """Local memory registered with a transport. ``buf`` is a uint8 view of all of it."""

    name: str
    buf: np.ndarray
    access: Access


@dataclass(eq=False)
class RemoteRegion:
    """A peer's exported region as this side sees it: a name, a length, the access granted.

    ``handle`` is the transport's own reference to the peer memory (a mapping on loopback, an
    address and rkey on verbs): only the transport that made it reads it; callers go through the
    :class:`Connection` operations or :meth:`Connection.local_view`."""

    name: str
    length: int
    access: Access
    handle: Any = field(repr=False, default=None)

    def __post_init__(self) -> None:
        self._bits = int(self.access)  # plain int: IntFlag arithmetic is slow on the hot path

    def check(self, offset: int, length: int, need: int) -> None:
        """Raise unless ``[offset, offset+length)`` is inside the region and ``need`` is granted."""
        if need & ~self._bits:
            raise TransportError(f"remote region {self.name!r} does not grant {Access(need).name}")
        if offset < 0 or length < 0 or offset + length > self.length:
            raise TransportError(
                f"access [{offset}, {offset + length}) outside remote region {self.name!r} of {self.length} bytes"
            )


@dataclass
class TransferCounters:
    """What crossed a connection: the copy counter of the zero-copy claim."""

    cas: int = 0
    reads: int = 0
    writes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class Connection(abc.ABC):
    """A reliable connection to one peer (an RC queue pair).

    The verbs are written once, here: each checks that the connection is open and that the peer granted
    the access and the bounds, moves the data through the transport's own primitive (``_cas``, ``_put``,
    ``_get``, and ``_put_then_imm`` where it can post a write and its doorbell at once), and counts what
    crossed.  A transport implements the primitives and the connection's management."""

    #: the id this side's completions carry for this connection
    conn_id: int
    #: the id the peer gave this side (an agent's claimant id on a slot server)
    peer_assigned_id: int
    #: the peer's exported regions, by name
    remote: dict[str, RemoteRegion]
    #: the peer's connection private data (e.g. pool dimensions)
    peer_info: dict[str, Any]
    counters: TransferCounters
    #: False once the connection is closed (or failed): every verb refuses
    _alive: bool

    def _closed(self) -> None:
        raise TransportError(f"connection {self.conn_id} is closed")

    def _check(self, remote: RemoteRegion, offset: int, length: int, need: int) -> None:
        """The connection is open, and ``remote`` grants ``need`` on ``[offset, offset + length)``."""
        if not self._alive:
            self._closed()
        remote.check(offset, length, need)

    def compare_and_swap(self, remote: RemoteRegion, offset: int, expected: int, desired: int) -> int:
        """Atomic CAS on a remote u64; returns the value found (== expected on success)."""
        self._check(remote, offset, 8, _ATOMIC)
        if offset & 7:
            raise TransportError(f"atomic at offset {offset} is not 8-byte aligned")
        found = self._cas(remote, offset, expected, desired)
        self.counters.cas += 1
        return found

    def write(
        self, local: MemoryRegion, local_offset: int, remote: RemoteRegion, remote_offset: int, length: int
    ) -> None:
        """RDMA WRITE; returns once the data is placed (the send completion)."""
        self._check(remote, remote_offset, length, _WRITE)
        self._put(local, local_offset, remote, remote_offset, length, None)
        counters = self.counters
        counters.writes += 1
        counters.bytes_written += length

    def write_with_imm(
        self, local: MemoryRegion, local_offset: int, remote: RemoteRegion, remote_offset: int, length: int, imm: int
    ) -> None:
        """RDMA WRITE_WITH_IMM: the data, then a completion carrying ``imm`` on the peer's CQ."""
        self._check(remote, remote_offset, length, _WRITE)
        self._put(local, local_offset, remote, remote_offset, length, imm & 0xFFFFFFFF)
        counters = self.counters
        counters.writes += 1
        counters.bytes_written += length

    def read(
        self, local: MemoryRegion, local_offset: int, remote: RemoteRegion, remote_offset: int, length: int
    ) -> None:
        """RDMA READ into local memory."""
        self._check(remote, remote_offset, length, _READ)
        self._get(local, local_offset, remote, remote_offset, length)
        counters = self.counters
        counters.reads += 1
        counters.bytes_read += length

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
        """A WRITE, then a WRITE_WITH_IMM (the doorbell) from the same local region to the same remote
        one; RC ordering places the data before the doorbell's completion.  A transport may post both
        at once and wait for the second only (verbs does: one round trip instead of two)."""
        self._check(remote, remote_offset, length, _WRITE)
        remote.check(bell_remote_offset, bell_length, _WRITE)
        bell = (bell_offset, bell_remote_offset, bell_length)
        self._put_then_imm(local, local_offset, remote, remote_offset, length, bell, imm & 0xFFFFFFFF)
        counters = self.counters
        counters.writes += 2
        counters.bytes_written += length + bell_length

    # -- what a transport implements (arguments checked already) -------------------------------------
    @abc.abstractmethod
    def _cas(self, remote: RemoteRegion, offset: int, expected: int, desired: int) -> int:
        """The CAS itself; the value found."""

    @abc.abstractmethod
    def _put(self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int, imm: int | None) -> None:
        """``n`` bytes of ``local`` from ``lo`` placed at ``ro`` of ``remote``, then, when ``imm`` is given, a
        completion carrying it on the peer's CQ; returns once placed."""

    @abc.abstractmethod
    def _get(self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int) -> None:
        """``n`` bytes at ``ro`` of ``remote`` read into ``local`` from ``lo``."""

    def _put_then_imm(
        self, local: MemoryRegion, lo: int, remote: RemoteRegion, ro: int, n: int, bell: tuple[int, int, int], imm: int
    ) -> None:
        """A write, then ``bell`` (local offset, remote offset, length) with ``imm``: two posts by default."""
        self._put(local, lo, remote, ro, n, None)
        self._put(local, bell[0], remote, bell[1], bell[2], imm)

    @abc.abstractmethod
    def local_view(self, remote: RemoteRegion) -> np.ndarray:
        """All of ``remote`` as local uint8 memory, read-only unless the region grants REMOTE_WRITE or
        REMOTE_ATOMIC: what a peer on the same machine reads without a round trip (an edge reading
        its replies).  Raises TransportUnavailable where peer memory cannot be mapped (verbs: use
        :meth:`read`)."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """A descriptor that turns readable when the connection has a management event."""

    @abc.abstractmethod
    def check_alive(self) -> bool:
        """Handle pending management events; False once the peer has gone."""

    @abc.abstractmethod
    def close(self) -> None:
        """Disconnect (the peer sees it through :meth:`check_alive`) and release the connection's
        resources; its remote regions and local views must not be used afterwards.  Idempotent."""


class CompletionQueue(abc.ABC):
    """Receive completions of all of an endpoint's connections."""

    @abc.abstractmethod
    def poll(self, max_entries: int = 64) -> list[Completion]:
        """What has arrived, without waiting."""

    @abc.abstractmethod
    def wait(self, timeout: float | None, spin: float = 0.0, max_entries: int = 64) -> list[Completion]:
        """Spin up to ``spin`` seconds, then sleep (no core burned) until something arrives or
        ``timeout`` seconds pass (None: forever). Returns [] on timeout."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """A descriptor an event loop can watch; readable after :meth:`arm` when entries arrive."""

    @abc.abstractmethod
    def arm(self) -> bool:
        """Request a notification on :meth:`fileno` for the next completion (ibv_req_notify_cq)
        and consume the pending one. True if completions are already waiting: poll again
        before sleeping, or one may be missed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the queue; :meth:`Transport.close` calls it."""


Admit = Callable[["Connection"], dict[str, Any]]


class Incoming(abc.ABC):
    """A peer that knocked on a listener and has not been set up yet: taken at once (:meth:`Listener.incoming`),
    set up -- the peer-secret handshake (:mod:`edgepath.transports.peer_auth`), then the exchange of exports --
    by :meth:`complete`, which may take a while and so may run on a thread of its own."""

    #: who knocked, for a log line (a process id on loopback, an address on verbs)
    peer: str

    @abc.abstractmethod
    def complete(self, admit: Admit | None, deadline: float) -> Connection:
        """The handshake, then ``admit(conn)`` on the fully set-up connection *before* the peer is told it is
        accepted (so the peer can never use a connection this side has not yet registered; it returns
        per-connection private data for the reply, as rdma_accept's private data does; ValueError from it refuses
        the peer), then the reply with this side's exports.  Nothing of this side is described to the peer before
        it has proved it holds the peer secret.  Raises :class:`~edgepath.transports.peer_auth.PeerRefused` when
        the peer fails the handshake or does not finish it by ``deadline`` (``time.monotonic()``),
        TransportError or ValueError when setup fails otherwise; the peer is then let go of."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Let go of the peer without setting it up."""


class Listener(abc.ABC):
    """Where peers of ``transport`` knock at ``address``: each is accepted (set up on the transport) or let go of."""

    def __init__(self, transport: Transport, address: str) -> None:
        self.transport = transport
        self.address = address

    @property
    def handshake_timeout(self) -> float:
        """Seconds a peer has to finish the handshake (:meth:`accept`; a connection manager uses it for each peer):
        the transport's, so every listener on it gives peers the same time."""
        return self.transport.handshake_timeout

    @abc.abstractmethod
    def incoming(self, timeout: float | None = None) -> Incoming | None:
        """The next peer that knocked (None after ``timeout`` seconds): quick, nothing set up yet."""

    def accept(self, timeout: float | None = None, admit: Admit | None = None) -> Connection | None:
        """Accept one connection: :meth:`incoming`, then :meth:`Incoming.complete` within the handshake timeout."""
        pending = self.incoming(timeout)
        if pending is None:
            return None
        return pending.complete(admit, time.monotonic() + self.handshake_timeout)

    @abc.abstractmethod
    def fileno(self) -> int:
        """A descriptor that turns readable when a peer is waiting to be accepted."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop listening; connections already accepted stay up."""


class Transport(abc.ABC):
    """One endpoint: its registered memory, its completion queue, its connections; ``keys`` (a
    :class:`~edgepath.transports.peer_auth.PeerKeys`): the peer secrets its peers must prove they hold, and which it
    proves it holds to them."""

    name: str
    cq: CompletionQueue
    keys: PeerKeys
    #: seconds a peer has to finish proving it holds a peer secret (its listeners' :attr:`Listener.handshake_timeout`)
    handshake_timeout: float

    @abc.abstractmethod
    def register(self, name: str, length: int, access: Access, buffer: np.ndarray | None = None) -> MemoryRegion:
        """Register ``length`` bytes that peers may access as ``access`` allows: freshly allocated,
        or ``buffer`` (``length`` contiguous uint8 bytes owned by the caller, e.g. frames shared with
        edges) in place, so that what the caller writes there is what peers see, with no copy.  A
        transport raises TransportError where it cannot export such memory (see its docstring)."""

    @abc.abstractmethod
    def listen(self, address: str, exports: list[MemoryRegion], info: dict[str, Any]) -> Listener:
        """Accept connections at ``address``; each peer learns ``exports`` and ``info``."""

    @abc.abstractmethod
    def connect(
        self, address: str, exports: list[MemoryRegion], info: dict[str, Any], timeout: float = 5.0
    ) -> Connection:
        """Connect to a listener; returns once the peer has admitted this side."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close every connection, listener, region and the completion queue of this endpoint."""


def check_buffer(name: str, length: int, buffer: np.ndarray) -> None:
    """Raise unless ``buffer`` can be registered in place as ``length`` bytes."""
    if length <= 0:
        raise ValueError(f"region {name!r}: length must be positive, got {length}")
    if buffer.dtype != np.uint8 or buffer.nbytes != length or not buffer.flags.c_contiguous:
        raise ValueError(
            f"region {name!r}: buffer must be {length} C-contiguous uint8 bytes, got {buffer.nbytes} bytes "
            f"of {buffer.dtype}{'' if buffer.flags.c_contiguous else ', not contiguous'}"
        )
