"""``edgepath ledger``: one quota ledger for every edge of a deployment, in a process of its own.

A ledger kept in an edge (``serve --quota-listen``) goes when that edge goes, and edges of several pods cannot
share the ledger of one of them; so a deployment runs one ledger process (a StatefulSet of one, on a volume of its
own) at an address every edge is given (``serve --quota-home``).  It registers the region, accepts edges and lets
go of those gone (:class:`~edgepath.dpu.ledger.LedgerHome`; it does nothing per request), and -- given a file --
starts from the words the file kept and saves them as they change (:mod:`edgepath.dpu.ledger_file`), so a restart
forgives nothing after a stop and at most the last save interval's spending after a kill.

Stopping (SIGTERM, SIGINT): the edges are let go first (they fail closed -- 503 ``quota_unavailable`` for tenants
with a quota -- and connect again when a ledger is back), then, once no edge can still be CASing (an edge notices
a home gone within :data:`~edgepath.dpu.ledger.CHECK_INTERVAL`), the words are saved a last time.
"""

from __future__ import annotations

import logging
import threading
import time

from edgepath.contract import wire
from edgepath.dpu.ledger import CHECK_INTERVAL, LedgerHome
from edgepath.dpu.ledger_file import LedgerFile, Saver
from edgepath.transports.base import Transport

log = logging.getLogger("edgepath.ledger")

#: seconds between letting the edges go and the last save: two of their checks, so that none is still CASing
SETTLE = 3 * CHECK_INTERVAL


class LedgerService:
    """A ledger home at ``address`` over ``transport`` (which it closes), its words from and to ``state`` (a path;
    None: kept in memory only, every bucket full at each start)."""

    def __init__(
        self,
        transport: Transport,
        address: str,
        state: str | None = None,
        save_interval: float = 1.0,
        entries: int = wire.LEDGER_ENTRIES,
    ) -> None:
        self.transport = transport
        self.file = LedgerFile(state, entries) if state is not None else None
        words = self.file.load() if self.file is not None else None  # a file it cannot read: refused here
        self.home = LedgerHome(transport, address, entries, words)
        self.saver = Saver(self.file, self.home.words, save_interval, words) if self.file is not None else None
        kept = "every bucket full" if words is None else f"the words of {state}"
        log.info("quota ledger at %s: %d entries, starting from %s", address, entries, kept)
        self._stopped = threading.Event()

    def serve(self) -> None:
        """Until :meth:`stop`: the home's thread accepts edges, the saver's saves."""
        while not self._stopped.wait(1.0):
            pass

    def stop(self) -> None:
        self._stopped.set()

    def close(self) -> None:
        """Let the edges go, wait until none can still CAS, save the words a last time, close the transport."""
        self._stopped.set()
        self.home.close()
        if self.saver is not None:
            time.sleep(SETTLE)
            saves = self.saver.saves
            if self.saver.stop() and self.saver.saves > saves:
                log.info("quota ledger: its words saved to %s", self.saver.file.path)
        self.transport.close()

    def describe(self) -> str:
        saves = "" if self.saver is None else f", {self.saver.saves} saves ({self.saver.failures} failed)"
        return f"quota ledger at {self.home.address}: {self.home.edges} edges connected{saves}"
