"""Usage a billing system can consume: one JSON line per request that ran on a slot (``--usage-log PATH``).

A :class:`Usage` is made by the lifecycle when a request it submitted ends, whatever the end; its tokens are what
the request was charged against its tenant's quota (docs/TENANTS.md), and for an answer with OpenAI's ``usage``
exactly its ``prompt_tokens``, ``prompt_tokens_details.cached_tokens`` and ``completion_tokens``.

Durability: :class:`UsageLog` writes each line with one ``write`` on a file opened ``O_APPEND`` as the request
ends, never buffered in the process, so a line is in the kernel once its answer is decided: a killed edge
(SIGKILL, a crash) loses no line of a request it answered, and requests in flight at the kill have none (they got
no answer).  It does not ``fsync``: a crash of the machine itself (power, kernel) can lose the lines of the last
seconds the kernel had not yet written back.  Several ``--workers`` processes append to the one file, each line
one write (whole lines, never interleaved, on a local file system).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import orjson


@dataclass(frozen=True, slots=True)
class Usage:
    """One request's usage (the log adds the time it ended)."""

    tenant: str
    request_id: int
    route: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish: str  # stop, length, cancelled (client gone), failed, timeout
    ttft_ms: float | None  # receive -> first output token at the edge (None: no output)
    wait_ms: float | None  # of it, the wait: ttft minus its own uncached prompt on an idle server
    answer_id: str | None = None  # the answer's "id" where it is not request_id (OpenAI's cmpl-…, chatcmpl-…)

    def line(self, time: float) -> bytes:
        """The JSON line, ``time`` (Unix seconds) first."""
        return orjson.dumps({"time": round(time, 6), **asdict(self)}) + b"\n"


class UsageLog:
    """The append-only JSON-lines file (a thin adapter: one ``os.write`` per line)."""

    def __init__(self, path: str) -> None:
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise ValueError(f"--usage-log {path}: cannot open it for appending: {exc.strerror}") from None
        self.path = path

    def __call__(self, usage: Usage) -> None:
        os.write(self._fd, usage.line(time.time()))

    def close(self) -> None:
        os.close(self._fd)
