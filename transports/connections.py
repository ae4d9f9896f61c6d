"""Peers come and go: one connection manager for every listening side (slot server, agent process, quota ledger).

It runs on its own thread: it takes each peer that knocks on a listener and sets it up on a thread of its own --
the peer-secret handshake (:mod:`edgepath.transports.peer_auth`), then ``admit``, which decides about the peer
before it is told it is accepted (see :meth:`~edgepath.transports.base.Incoming.complete`) -- so a peer that stalls
mid-handshake holds one such thread until the listener's handshake timeout, never the listener: at most
:data:`MAX_HANDSHAKES` are under way at once, and a peer beyond them is let go of at once.  A peer that is refused
is one log line (who, why; never the secret) and one count in :attr:`ConnectionManager.refused`.  It watches
every accepted connection for its end and never touches the data path: the owner's loop asks :meth:`gone` for
the connections that ended and cleans up after them in its own thread.
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import threading
import time

from edgepath.transports.base import Admit, Connection, Incoming, Listener, TransportError
from edgepath.transports.peer_auth import TOO_MANY, PeerRefused

log = logging.getLogger("edgepath.connections")

#: peers being set up at once; one more is let go of at once (and counted): a flood of stalled handshakes costs
#: this many threads for a handshake timeout, and the listener stays free for the others
MAX_HANDSHAKES = 32
#: what a refusal is counted as when it is no handshake failure (a peer the owner's ``admit`` refused, a setup error)
NOT_ADMITTED = "not admitted"

_LISTENER, _WAKE = object(), object()


class ConnectionManager:
    """Accepts peers on ``listener`` with ``admit`` and reports the connections that ended."""

    def __init__(self, listener: Listener, admit: Admit, name: str) -> None:
        self.listener = listener
        self.admit = admit
        self.name = name
        #: peers refused, by reason (:class:`~edgepath.transports.peer_auth.PeerRefused`'s, or :data:`NOT_ADMITTED`)
        self.refused: collections.Counter[str] = collections.Counter()
        self._gone: list[int] = []
        self._accepted: list[Connection] = []
        self._handshakes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def refusals(self) -> int:
        """Peers refused so far, whatever the reason."""
        return sum(self.refused.values())

    def gone(self) -> list[int]:
        """Connection ids of the peers that went away since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def pending(self) -> bool:
        """Whether :meth:`gone` has something (a cheap check for a hot loop)."""
        return bool(self._gone)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener.fileno(), selectors.EVENT_READ, _LISTENER)
        sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                if key.data is _LISTENER:
                    self._knock()
                elif key.data is _WAKE:
                    for conn in self._take_accepted():
                        sel.register(conn.fileno(), selectors.EVENT_READ, conn)
                elif not key.data.check_alive():
                    sel.unregister(key.fd)
                    with self._lock:
                        self._gone.append(key.data.conn_id)
        sel.close()

    def _take_accepted(self) -> list[Connection]:
        while True:
            try:
                if not os.read(self._wake_r, 4096):
                    break
            except BlockingIOError:
                break
        with self._lock:
            accepted, self._accepted = self._accepted, []
        return accepted

    def _knock(self) -> None:
        """Take the peer that knocked and set it up on a thread of its own (or let it go: too many under way)."""
        try:
            pending = self.listener.incoming(timeout=0)
        except (OSError, TransportError, ValueError) as exc:
            self._refused("a peer", exc)
            return
        if pending is None:
            return
        with self._lock:
            busy = self._handshakes >= MAX_HANDSHAKES
            if not busy:
                self._handshakes += 1
        if busy:
            pending.abort()
            self._refused(pending.peer, PeerRefused(TOO_MANY, f"{MAX_HANDSHAKES} are being set up"))
            return
        threading.Thread(target=self._set_up, args=(pending,), name=f"{self.name}-handshake", daemon=True).start()

    def _set_up(self, pending: Incoming) -> None:
        admitted: list[int] = []

        def admit(conn: Connection) -> dict[str, object]:
            info = self.admit(conn)
            admitted.append(conn.conn_id)
            return info

        try:
            conn = pending.complete(admit, time.monotonic() + self.listener.handshake_timeout)
        except (OSError, TransportError, ValueError) as exc:
            self._refused(pending.peer, exc)
            with self._lock:
                self._gone.extend(admitted)  # admitted, then lost before it was told: its owner lets go of it
            return
        finally:
            with self._lock:
                self._handshakes -= 1
        with self._lock:
            if self._stop.is_set():  # nobody watches it any more
                conn.close()
                return
            self._accepted.append(conn)
            os.write(self._wake_w, b"!")

    def _refused(self, peer: str, exc: Exception) -> None:
        reason = exc.reason if isinstance(exc, PeerRefused) else NOT_ADMITTED
        why = str(exc) if isinstance(exc, PeerRefused) else f"{reason}: {exc}"
        log.warning("%s: %s refused: %s", self.name, peer, why)  # logged, then counted: a count has its line
        with self._lock:
            self.refused[reason] += 1

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting and watching, and close the listener (connections already accepted stay up)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self.listener.close()
        with self._lock:
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
