"""Which slot servers an agent should be attached to, followed from a source that changes: sans I/O.

A platform (Kubernetes, say) adds, moves and removes slot servers; an agent given a fixed ``--slot-server``
list would need a restart for each change.  ``--slot-servers-from SOURCE`` names where the current set is
read instead:

* ``dns:NAME:PORT`` -- every address NAME resolves to (a headless Service's records: one per ready pod),
  each as ``IP:PORT`` (the verbs data path's rdma_cm address);
* ``dir:PATH`` -- every ``*.sock`` in a directory (the loopback data path's Unix sockets, e.g. a host
  directory the slot-server pods of one node share; a slot server's socket goes away when it stops).

:class:`Membership` turns each resolved set into what changed: addresses to attach (new ones) and to drain
(gone ones).  It keeps the last good set, so a failed resolution (a DNS timeout, an unreadable directory)
changes nothing -- only an answer does; and it says when the next resolution is due.  The resolving itself
(:mod:`edgepath.dpu.resolvers`) and acting on the changes (:meth:`edgepath.dpu.links.LinkSet.add` /
:meth:`~edgepath.dpu.links.LinkSet.remove`) are elsewhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass

#: seconds between resolutions, by default (``--resolve-interval``): a new slot server is attached within
#: about this long (plus its first attach), well within the 5 s the deployment promises
DEFAULT_RESOLVE_INTERVAL = 2.0
KINDS = ("dns", "dir")


@dataclass(frozen=True)
class Source:
    """Where the set of slot servers is read: ``kind`` dns (``name``, ``port``) or dir (``name``: a path)."""

    kind: str
    name: str
    port: int = 0

    def __str__(self) -> str:
        return f"dns:{self.name}:{self.port}" if self.kind == "dns" else f"dir:{self.name}"


def parse_source(text: str) -> Source:
    """``dns:NAME:PORT`` or ``dir:PATH`` as a :class:`Source`; anything else is a ValueError saying what is
    allowed."""
    kind, _, rest = text.partition(":")
    allowed = "give dns:NAME:PORT (a headless Service's name) or dir:PATH (a directory of slot-server sockets)"
    if kind == "dns":
        name, _, port = rest.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r}: a dns source is dns:NAME:PORT with a port in 1..65535; {allowed}")
        return Source("dns", name, int(port))
    if kind == "dir" and rest:
        return Source("dir", rest)
    raise ValueError(f"{text!r} is not a slot-server source; {allowed}")


def checked_source(text: str) -> str:
    """``text`` if it parses as a source (the option's parser, an argparse type: the configuration keeps the
    text; a wrong one is an ArgumentTypeError saying what is allowed)."""
    try:
        parse_source(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@dataclass(frozen=True)
class Changes:
    """What one resolution changed: addresses to attach and addresses to drain (each sorted)."""

    attach: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.attach or self.drain)


class Membership:
    """The slot servers a source names, as last resolved, and when to resolve again (sans I/O: addresses and
    ``now`` in, changes out)."""

    def __init__(self, interval: float = DEFAULT_RESOLVE_INTERVAL) -> None:
        if not interval > 0:
            raise ValueError(f"resolve interval must be positive seconds, got {interval}")
        self.interval = interval
        self.members: frozenset[str] = frozenset()
        self.resolutions = 0  # answers taken
        self.failures = 0  # resolutions that failed (the set was kept)
        self._next_at = 0.0

    def due(self, now: float) -> bool:
        """Whether the next resolution is due (the first one is due at once)."""
        return now >= self._next_at

    def resolved(self, addresses: Iterable[str] | None, now: float) -> Changes:
        """A resolution at ``now`` answered ``addresses`` (None: it failed -- the last set is kept): the
        new ones to attach, the vanished ones to drain; the next resolution is due an interval later."""
        self._next_at = now + self.interval
        if addresses is None:
            self.failures += 1
            return Changes()
        self.resolutions += 1
        now_members = frozenset(addresses)
        changes = Changes(tuple(sorted(now_members - self.members)), tuple(sorted(self.members - now_members)))
        self.members = now_members
        return changes
