"""Usage a billing system can consume: one JSON line per request that ran on a slot (``--usage-log PATH``).

A :class:`Usage` is made by the lifecycle when a request it submitted ends, whatever the end; its tokens are what
the request was charged against its tenant's quota (docs/TENANTS.md), and for an answer with OpenAI's ``usage``
exactly its ``prompt_tokens``, ``prompt_tokens_details.cached_tokens`` and ``completion_tokens``; its ``model`` is the
answer's ``model`` (on ``/v1/generate``, whose answer names none, the served model's name), so a bill can price by
model.

Durability: :class:`UsageLog` writes each line with one ``write`` on a file opened ``O_APPEND`` as the request
ends, never buffered in the process, so a line is in the kernel once its answer is decided: a killed edge
(SIGKILL, a crash) loses no line of a request it answered, and requests in flight at the kill have none (they got
no answer).  What survives a crash of the machine itself (power, kernel) is the fsync policy's: ``none`` (the
kernel writes lines back when it will: seconds of them can be lost), ``line`` (``fdatasync`` after each line,
before its answer is sent: none of an answered request is lost, at the cost of one disk flush per request on the
edge's event loop) or ``interval`` (a thread calls ``fdatasync`` every interval when lines were written: at most the
last interval's lines are lost, and requests never wait for the disk).  Several ``--workers`` processes append to
the one file, each line one write (whole lines, never interleaved, on a local file system).  :meth:`UsageLog.reopen`
(SIGHUP) opens the path again: rotate the log by renaming it, then SIGHUP; lines written meanwhile are in the
renamed file.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass

import orjson


@dataclass(frozen=True, slots=True)
class Usage:
    """One request's usage (the log adds the time it ended)."""

    tenant: str
    request_id: int
    route: str
    model: str | None  # the served model's name: what an OpenAI answer's "model" says (None: not known here)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish: str  # stop, length, cancelled (client gone), reclaimed (cut for a floor), failed, timeout
    ttft_ms: float | None  # receive -> first output token at the edge (None: no output)
    wait_ms: float | None  # of it, the wait: ttft minus its own uncached prompt on an idle server
    answer_id: str | None = None  # the answer's "id" where it is not request_id (OpenAI's cmpl-…, chatcmpl-…)

    def line(self, time: float) -> bytes:
        """The JSON line, ``time`` (Unix seconds) first."""
        return orjson.dumps({"time": round(time, 6), **asdict(self)}) + b"\n"


FSYNC = ("none", "line", "interval")


class UsageLog:
    """The append-only JSON-lines file (a thin adapter: one ``os.write`` per line, and the fsync policy)."""

    def __init__(self, path: str, fsync: str = "none", interval: float = 1.0) -> None:
        if fsync not in FSYNC:
            raise ValueError(f"--usage-fsync must be one of {', '.join(FSYNC)}, got {fsync!r}")
        self.path, self.fsync, self.interval = path, fsync, interval
        self._fd = self._open()
        self._lock = threading.Lock()  # the interval thread's fdatasync against reopen's swap
        self._dirty = False
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        if fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_every_interval, name="usage-fsync", daemon=True)
            self._syncer.start()

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise ValueError(f"--usage-log {self.path}: cannot open it for appending: {exc.strerror}") from None

    def __call__(self, usage: Usage) -> None:
        os.write(self._fd, usage.line(time.time()))
        if self.fsync == "line":
            os.fdatasync(self._fd)
        else:
            self._dirty = True

    def reopen(self) -> None:
        """Open the path again (after a rotation renamed it): later lines go to the new file; what was written is
        synced first under a policy that syncs.  A path that cannot be opened is a ValueError, and the file in
        use is kept."""
        fd = self._open()
        with self._lock:
            old, self._fd = self._fd, fd
            if self.fsync != "none":
                os.fdatasync(old)
            os.close(old)

    def _sync_every_interval(self) -> None:
        while not self._stop.wait(self.interval):
            self._sync()

    def _sync(self) -> None:
        with self._lock:
            if self._dirty:
                self._dirty = False
                os.fdatasync(self._fd)

    def close(self) -> None:
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join(timeout=self.interval + 5)
        with self._lock:
            if self.fsync != "none":
                os.fdatasync(self._fd)
            os.close(self._fd)
