"""Peers come and go: one connection manager for every listening side (slot server, agent process).

It runs on its own thread: it accepts peers on a listener -- ``admit`` decides about each one before the
peer is told it is accepted (see :meth:`~edgepath.transports.base.Listener.accept`) -- and watches every
accepted connection for its end.  It never touches the data path: the owner's loop asks :meth:`gone`
for the connections that ended and cleans up after them in its own thread.
"""

from __future__ import annotations

import logging
import selectors
import threading

from edgepath.transports.base import Admit, Connection, Listener, TransportError

log = logging.getLogger("edgepath.connections")


class ConnectionManager:
    """Accepts peers on ``listener`` with ``admit`` and reports the connections that ended."""

    def __init__(self, listener: Listener, admit: Admit, name: str) -> None:
        self.listener = listener
        self.admit = admit
        self.name = name
        self._gone: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

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
        sel.register(self.listener.fileno(), selectors.EVENT_READ, None)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                conn: Connection | None = key.data
                if conn is None:
                    accepted = self._accept()
                    if accepted is not None:
                        sel.register(accepted.fileno(), selectors.EVENT_READ, accepted)
                elif not conn.check_alive():
                    sel.unregister(key.fd)
                    with self._lock:
                        self._gone.append(conn.conn_id)
        sel.close()

    def _accept(self) -> Connection | None:
        try:
            return self.listener.accept(timeout=1.0, admit=self.admit)
        except (OSError, TransportError, ValueError) as exc:
            log.warning("%s: connection refused: %s", self.name, exc)
            return None

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting and watching, and close the listener (connections already accepted stay up)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self.listener.close()
