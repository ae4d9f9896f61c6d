"""The quota ledger several edges share: its home, a region of bucket words, and an edge's view of it, which
CASes those words over the transport (:mod:`edgepath.edge.tenancy.quota` makes every decision; the
edge reaches memory only through this layer, the agent side).

The home does nothing per request -- it registers the region, accepts edges that prove they hold the peer secret
(:mod:`edgepath.transports.peer_auth`) and lets go of those gone -- so
quotas across edges need no middle layer: an edge's CAS lands in the home's memory (shared memory on loopback,
through the NIC over verbs) and is the admission decision itself.  ``edgepath ledger --listen ADDRESS`` keeps one
in a process of its own (:mod:`edgepath.dpu.ledger_service`: one ledger for a deployment's edges, its words kept in a
file across its restarts); ``serve --workers N`` keeps one in the supervising process for its workers; ``serve
--quota-listen ADDRESS`` keeps one in a serve for edges elsewhere.  Edges reach one with ``--quota-home ADDRESS``.
The address says the transport: a socket path is loopback (edges on one machine), ``HOST:PORT`` is verbs (edges on
several hosts, with the data path's device; a host name is resolved again at every connect).

Failure: an edge that loses its home (a failed operation, the connection closed) refuses every request of a
tenant with a quota (:class:`LedgerUnavailable`: 503 ``quota_unavailable``, fail closed)
while a thread reconnects with bounded back-off; what it could not give back meanwhile stays charged.  A home that
starts again starts from the words it is given (a ledger process: its file, :mod:`edgepath.dpu.ledger_file`), else
with every bucket full.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edgepath.contract import wire
from edgepath.dpu.backoff import Backoff, Retry
from edgepath.transports.base import Connection, Listener, RemoteRegion, Transport, TransportError
from edgepath.transports.connections import ConnectionManager

log = logging.getLogger("edgepath.ledger")


class LedgerUnavailable(RuntimeError):
    """The ledger's words cannot be reached (the message says where and why): quotas fail closed."""


#: seconds between checks that the home is still there (a check is a system call; an operation that fails is
#: noticed at once)
CHECK_INTERVAL = 0.1


def transport_kind(address: str) -> str:
    """The transport a ledger address is reached over: a socket path is loopback, ``HOST:PORT`` verbs."""
    return "loopback" if "/" in address else "verbs"


def resolved(address: str, getaddrinfo: Callable[..., list[tuple[Any, ...]]] = socket.getaddrinfo) -> str:
    """``address`` as the transport connects to it: a verbs ``HOST:PORT`` whose host is a name (a StatefulSet
    pod's DNS name, which outlives its IP address) made ``IP:PORT`` -- asked again at every connect, so a ledger
    restarted at another address is found; an IP address or a socket path as it is."""
    if transport_kind(address) == "loopback":
        return address
    host, _, port = address.rpartition(":")
    try:
        ipaddress.ip_address(host)
        return address
    except ValueError:
        pass
    try:
        infos = getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TransportError(f"cannot resolve {host}: {exc}") from None
    if not infos:
        raise TransportError(f"cannot resolve {host}: no address")
    return f"{infos[0][4][0]}:{port}"


class LedgerHome:
    """The ledger's region (``entries`` pairs of words: ``words``, as a ledger file kept them, or all 0: every bucket
    full) exported at ``address`` to every edge that connects and proves it holds the peer secret (a connection
    manager sets peers up, refuses and counts the others), and a thread that closes the connections of edges gone."""

    def __init__(
        self, transport: Transport, address: str, entries: int = wire.LEDGER_ENTRIES, words: bytes | None = None
    ) -> None:
        self.address = address
        self.region = transport.register(wire.LEDGER_REGION, 16 * entries, wire.LEDGER_ACCESS)
        if words is not None:
            self.region.buf[:] = np.frombuffer(words, dtype=np.uint8)  # before any edge can connect
        listener: Listener = transport.listen(address, [self.region], wire.ledger_hello(entries))
        self._edges: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self.connections = ConnectionManager(listener, self._admit, "ledger-home")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._reap, name="ledger-home", daemon=True)
        self.connections.start()
        self._thread.start()

    def words(self) -> bytes:
        """A copy of the words as they are now (each aligned 64-bit word read whole; words may change meanwhile,
        each is a bucket or a key of its own)."""
        return self.region.buf.view(np.uint64).tobytes()

    @property
    def edges(self) -> int:
        """Edges connected now."""
        return len(self._edges)

    @property
    def refused(self) -> int:
        """Peers refused so far (the log says who and why)."""
        return self.connections.refusals

    def _admit(self, conn: Connection) -> dict[str, object]:
        with self._lock:
            self._edges[conn.conn_id] = conn
        return {}

    def _reap(self) -> None:
        while not self._stop.wait(0.2):
            for conn_id in self.connections.gone():
                with self._lock:
                    edge = self._edges.pop(conn_id, None)
                if edge is not None:
                    edge.close()

    def close(self) -> None:
        """Stop accepting and let go of every edge (the transport's owner closes the region with it)."""
        self._stop.set()
        self._thread.join(timeout=2)
        self.connections.close()
        with self._lock:
            edges, self._edges = list(self._edges.values()), {}
        for edge in edges:
            edge.close()


class RemoteLedger:
    """An edge's view of a ledger home at ``address`` (a :class:`~edgepath.edge.tenancy.quota.Ledger`): each CAS
    one remote compare-and-swap.  ``connect`` is made at once (a home that does not answer is the caller's error);
    lost later, every CAS raises :class:`LedgerUnavailable` until a thread has connected again."""

    def __init__(
        self,
        transport: Transport,
        address: str,
        timeout: float = 5.0,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self._transport, self._timeout, self._clock = transport, timeout, clock
        self._retry = Retry(backoff or Backoff(0.1, 2.0))
        self._conn: Connection | None = None
        self._region: RemoteRegion | None = None
        self._checked = 0.0
        self._why = ""
        self._reconnecting: threading.Thread | None = None
        self._closed = False
        self.reconnects = 0
        conn, region, self.entries = self._connect()
        self._conn, self._region = conn, region

    def _connect(self) -> tuple[Connection, RemoteRegion, int]:
        conn = self._transport.connect(resolved(self.address), [], {}, timeout=self._timeout)
        try:
            entries = wire.read_ledger_hello(conn.peer_info)
            region = conn.remote[wire.LEDGER_REGION]
        except (wire.InfoInvalid, KeyError) as exc:
            conn.close()
            raise TransportError(f"{self.address} is not a quota ledger home: {exc}") from None
        return conn, region, entries

    def cas(self, word: int, expected: int, desired: int) -> int:
        conn, region = self._conn, self._region
        if conn is None or region is None:
            raise LedgerUnavailable(f"quota ledger at {self.address}: {self._why}")
        now = self._clock()
        try:
            if now - self._checked >= CHECK_INTERVAL:
                self._checked = now
                if not conn.check_alive():
                    raise TransportError("its home has gone")
            return conn.compare_and_swap(region, 8 * word, expected, desired)
        except TransportError as exc:
            self._lost(conn, str(exc))
            raise LedgerUnavailable(f"quota ledger at {self.address}: {self._why}") from None

    def _lost(self, conn: Connection, why: str) -> None:
        """The home is out of reach: fail closed, and connect again on a thread."""
        self._conn = self._region = None
        self._why = why
        log.error("quota ledger at %s: %s; tenants with a quota are refused (503) until it is back", self.address, why)
        conn.close()
        if self._reconnecting is None or not self._reconnecting.is_alive():
            self._reconnecting = threading.Thread(target=self._reconnect, name="ledger-reconnect", daemon=True)
            self._reconnecting.start()

    def _reconnect(self) -> None:
        lost = self._why
        while not self._closed:
            time.sleep(self._retry.failed(self._clock()))
            try:
                conn, region, entries = self._connect()
            except TransportError as exc:
                self._why = f"{lost}; reconnecting: {exc}"
                continue
            if self._closed or entries != self.entries:
                conn.close()
                self._why = f"{lost}; its home came back with {entries} entries, not {self.entries}"
                continue
            self._retry.reset()
            self._region, self._conn = region, conn
            self.reconnects += 1
            log.info("quota ledger at %s: connected again", self.address)
            return

    def close(self) -> None:
        self._closed = True
        conn, self._conn, self._region = self._conn, None, None
        self._why = "closed"
        if conn is not None:
            conn.close()
