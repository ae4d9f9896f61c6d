"""Watching the slot server ``serve`` supervises for hangs, from serve's own process.

A frozen slot server (a stuck GPU kernel, a wedged driver, SIGSTOP) does not die, so its supervisor never
learns of it by waiting.  :class:`HangWatch` attaches a link set of its own (it only reads the pool's
heartbeat: no frames, nothing to claim) on its own transport and thread -- so it judges the same way with one edge or
with ``--workers``, whatever the edges are doing -- and asks the supervisor to kill a server that
:func:`~edgepath.supervisor.hang_verdict` calls hung; the supervisor's restart path does the rest, and the
watch attaches to the new server where it listens.  It also keeps the supervision counts where every edge
worker's ``/metrics`` reads them (``--workers``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path

from edgepath.dpu.links import AgentError, LinkSet, ServerLink
from edgepath.supervisor import Supervisor, hang_verdict
from edgepath.transports.base import Transport

log = logging.getLogger("edgepath.hangwatch")

#: the file in a shared metrics directory that holds the supervision counts (``--workers``)
COUNTS_FILE = "supervision.json"


class HangWatch:
    """Kills ``supervisor``'s slot server (at ``address``) once it has stayed unresponsive past the hang
    timeout; :meth:`check` is one look (what the thread does every probe interval).  Made by
    :func:`edgepath.builder.build_hang_watch`."""

    def __init__(self, supervisor: Supervisor, address: str, links: LinkSet, counts_dir: str | None) -> None:
        """``links``: the watch's own link set (no frames: it reads the server's heartbeat and state words,
        judging by its hang timeout on its clock), whose transport the watch closes; ``counts_dir``: where the
        edge workers read the supervision counts from (None: nobody needs the file)."""
        self.supervisor = supervisor
        self.address = address
        self.links = links
        self.transport: Transport = links.transport
        self._connect_timeout = min(1.0, links.hang_timeout / 2)  # on the watch's own thread: it may wait
        self._counts = Path(counts_dir) / COUNTS_FILE if counts_dir is not None else None
        self._written: tuple[int, int] | None = None
        self._killed: ServerLink | None = None  # the link whose server was killed (never twice for one)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watch", daemon=True)

    def start(self) -> HangWatch:
        self.check()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self.transport.close()

    def _run(self) -> None:
        while not self._stop.wait(self.links.probe_interval):
            try:
                self.check()
            except Exception:  # the watch must outlive any one bad look; say what went wrong
                log.exception("hang watch: checking %s failed", self.address)

    def check(self) -> None:
        """Attach (again) when the server is (back) there, read its heartbeat, kill it when it is hung."""
        links = self.links
        if not links.links:
            with contextlib.suppress(AgentError):  # not listening (yet, or again): the supervisor restarts it
                links.attach(self.address, timeout=self._connect_timeout)
        else:
            links.check()
            links.revive(timeout=self._connect_timeout)
        now = links.clock()
        for link in links:
            why = hang_verdict(link.tracker.health(), now)
            if why is not None and link is not self._killed and self.supervisor.kill(why):
                self._killed = link
        self._write_counts()

    def _write_counts(self) -> None:
        """The supervisor's counts into the shared file, when they changed (written whole, then renamed)."""
        counts = (self.supervisor.restarts, self.supervisor.hangs)
        if self._counts is None or counts == self._written:
            return
        partial = self._counts.with_suffix(".tmp")
        partial.write_text(json.dumps({"restarts": counts[0], "hangs": counts[1]}))
        os.replace(partial, self._counts)
        self._written = counts


def read_counts(directory: str) -> tuple[int, int] | None:
    """(restarts, hangs) of the supervised slot server as the watch last wrote them into ``directory``;
    None before it wrote any."""
    try:
        counts = json.loads((Path(directory) / COUNTS_FILE).read_text())
    except FileNotFoundError:
        return None
    return int(counts["restarts"]), int(counts["hangs"])
