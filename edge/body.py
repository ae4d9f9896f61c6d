"""Request-body limits, one component for both HTTP adapters: 413 past ``--max-body``, 408 past
``--body-timeout``.

An adapter collects a request as it arrives.  It checks the declared ``Content-Length`` with
:meth:`BodyLimits.declared`, and when the request is not complete at once it opens an
:class:`IncomingBody` (HTTP/3: at the request's headers; HTTP/1.1: at its first byte, so slow headers
count too), feeds it the data and answers early with the error it returns; a request complete in time
closes it.  An incomplete request holds no frame and no slot, only its bytes, until a limit ends it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from edgepath.edge.http import HttpError, body_too_large

#: the most bytes a request's target and header fields may take together (nginx's large_client_header_buffers: 4 x 8k)
HEAD_MAX = 16 * 1024


class BodyLimits:
    """``--max-body`` (bytes) and ``--body-timeout`` (seconds) of one edge, and :data:`HEAD_MAX`."""

    __slots__ = ("max_body", "timeout")

    def __init__(self, max_body: int, timeout: float) -> None:
        if max_body < 1:
            raise ValueError(f"the body limit must be at least 1 byte, got {max_body}")
        if not timeout > 0:
            raise ValueError(f"body timeout must be positive, got {timeout} s")
        self.max_body = max_body
        self.timeout = timeout

    @staticmethod
    def head(target: bytes | str, headers: Iterable[tuple[bytes, bytes]]) -> HttpError | None:
        """431 when the target and the header fields take more than :data:`HEAD_MAX` bytes (a head that arrived whole
        in one read is not bounded by the framing layer's own limit on what it buffers)."""
        size = len(target) + sum(len(name) + len(value) for name, value in headers)
        if size > HEAD_MAX:
            return HttpError(
                431,
                "headers_too_large",
                f"the request's target and header fields take {size} bytes; the limit is {HEAD_MAX}",
            )
        return None

    def declared(self, headers: Iterable[tuple[bytes, bytes]]) -> HttpError | None:
        """413 at once when the request's ``Content-Length`` is past the limit (nothing more is read)."""
        length = declared_length(headers)
        return body_too_large(length, self.max_body) if length is not None and length > self.max_body else None

    def late(self) -> HttpError:
        """408: the request did not arrive complete within the timeout."""
        return HttpError(408, "body_timeout", f"the request did not complete within {self.timeout:g} s")

    def start(self, loop: asyncio.AbstractEventLoop, on_late: Callable[[], object]) -> IncomingBody:
        """A request's body from now on; ``on_late`` runs at its deadline unless it is closed first."""
        return IncomingBody(self.max_body, loop.call_later(self.timeout, on_late))


def declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The request's ``Content-Length`` (None: none, or one the framing layer judges malformed)."""
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class IncomingBody:
    """One request's body while it arrives, and its deadline."""

    __slots__ = ("_data", "_dropped", "_max_body", "_timer")

    def __init__(self, max_body: int, timer: asyncio.TimerHandle) -> None:
        self._max_body = max_body
        self._timer = timer
        self._data = bytearray()
        self._dropped = 0

    def add(self, chunk: bytes) -> HttpError | None:
        """Append ``chunk``; 413 once the body is past the limit (answer it at once, read no more)."""
        self._data += chunk
        if len(self._data) > self._max_body:
            return body_too_large(len(self._data), self._max_body)
        return None

    def drop(self, chunk: bytes) -> bool:
        """Count ``chunk`` of a body that is read only to be thrown away (its request was answered from its head);
        False once more than the limit was dropped (close the connection)."""
        self._dropped += len(chunk)
        return self._dropped <= self._max_body

    def close(self) -> bytes:
        """Stop the deadline and hand over what arrived (the request is complete, answered early or gone)."""
        self._timer.cancel()
        data = bytes(self._data)
        self._data = bytearray()
        return data
