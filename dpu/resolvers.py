"""Reading a slot-server source (:mod:`edgepath.dpu.discovery`) off the caller's loop.

:func:`resolve` asks once: a DNS name's addresses, or a directory's sockets.  :class:`Follower` asks again
every resolve interval on a thread of its own -- a DNS answer may take seconds, and neither the edge's event
loop nor an agent process's loop waits for it -- and hands each answer to its
:class:`~edgepath.dpu.discovery.Membership`, whose changes the caller applies to its links.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from edgepath.dpu.discovery import Changes, Membership, Source

log = logging.getLogger("edgepath.discovery")

#: ``socket.getaddrinfo``'s shape: a test passes its own (names it controls, no DNS server)
AddrInfo = Callable[..., list[tuple[Any, ...]]]
#: what getaddrinfo says of a name with no address now -- NXDOMAIN (EAI_NONAME), or a name that exists without
#: one (EAI_NODATA: glibc's answer to NOERROR with no A or AAAA record, seen against a real DNS server in
#: tests/system/test_dns_discovery.py): every slot server of the source gone, not a failure to keep the set through
NO_RECORDS = frozenset({socket.EAI_NONAME, socket.EAI_NODATA})
#: a resolution: the addresses a source names now, or None when it could not be read (the set is kept)
Resolve = Callable[[Source], "set[str] | None"]


def resolve(source: Source, getaddrinfo: AddrInfo = socket.getaddrinfo) -> set[str] | None:
    """The slot-server addresses ``source`` names now; None when it could not be read (a DNS failure, a
    directory that cannot be listed) -- which is not the same as an answer naming none (a name without
    records, a directory without sockets or not made yet: every slot server gone)."""
    if source.kind == "dir":
        try:
            return {str(path) for path in Path(source.name).glob("*.sock") if path.is_socket()}
        except OSError as exc:
            log.warning("slot servers from %s: cannot read the directory: %s", source, exc)
            return None
    try:
        infos = getaddrinfo(source.name, source.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in NO_RECORDS:
            return set()  # the name has no records now: a headless Service with no ready pod
        log.warning("slot servers from %s: cannot resolve %s: %s", source, source.name, exc)
        return None
    return {f"{info[4][0]}:{source.port}" for info in infos}


class Follower:
    """Resolves ``source`` every ``membership.interval`` seconds on a thread of its own; :meth:`poll` (cheap,
    at every tick of the caller's loop) starts a resolution that is due and returns what the last finished one
    changed."""

    def __init__(
        self,
        source: Source,
        membership: Membership,
        resolver: Resolve = resolve,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.membership = membership
        self._resolver = resolver
        self._clock = clock
        self._pending: Future[set[str] | None] | None = None

    def first(self) -> Changes:
        """Resolve now, on the caller's thread (at start, before serving)."""
        return self._take(self._resolve())

    def poll(self) -> Changes:
        """What the resolution that finished since the last call changed (nothing if none did); starts the
        next one when it is due."""
        changes = Changes()
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            changes = self._take(pending.result())
        if self._pending is None and self.membership.due(self._clock()):
            future: Future[set[str] | None] = Future()
            self._pending = future
            threading.Thread(target=lambda: future.set_result(self._resolve()), name="resolve", daemon=True).start()
        return changes

    def _resolve(self) -> set[str] | None:
        try:
            return self._resolver(self.source)
        except Exception:  # a resolver that raises is a failed resolution: say why, keep the set
            log.exception("slot servers from %s: resolving failed", self.source)
            return None

    def _take(self, addresses: set[str] | None) -> Changes:
        changes = self.membership.resolved(addresses, self._clock())
        for address in changes.attach:
            log.info("slot servers from %s: %s appeared", self.source, address)
        for address in changes.drain:
            log.info("slot servers from %s: %s is gone: draining it", self.source, address)
        return changes
