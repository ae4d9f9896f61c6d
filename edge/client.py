"""An HTTP/3 client on aioquic: ``edgepath request``, and the load generator of tests and benchmarks.

:class:`H3Client` keeps one QUIC connection and runs any number of requests on it concurrently (one
stream each).  Callers bound how many are in flight: a single connection flooded with thousands of
streams collapses (stream limits, loss recovery), see DESIGN.md.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent


@dataclass
class H3Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def timings(self) -> dict[str, float]:
        """``Server-Timing`` as {stage: milliseconds}."""
        out: dict[str, float] = {}
        for part in self.headers.get("server-timing", "").split(","):
            name, _, dur = part.strip().partition(";dur=")
            if name and dur:
                out[name] = float(dur)
        return out


#: called with the status and each piece of the body as it arrives (a streamed answer printed as it comes)
OnData = Callable[[int, bytes], None]


@dataclass
class _Pending:
    future: asyncio.Future[H3Response]
    on_data: OnData | None = None
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 0
    body: bytearray = field(default_factory=bytearray)


class H3ClientProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self._pending: dict[int, _Pending] = {}

    async def wait_connected(self) -> None:
        """aioquic's wait for the handshake, but one given up on (a timeout) does not leave its inner future's
        ConnectionError to be logged as "never retrieved" when the connection is closed afterwards."""
        try:
            await super().wait_connected()
        except asyncio.CancelledError:
            waiter = self._connected_waiter
            if waiter is not None:
                waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            for pending in self._pending.values():
                if not pending.future.done():
                    pending.future.set_exception(ConnectionError(f"connection closed: {event.reason_phrase}"))
            self._pending.clear()
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        stream_id = getattr(event, "stream_id", -1)
        pending = self._pending.get(stream_id)
        if pending is None:
            return
        if isinstance(event, HeadersReceived):
            for name, value in event.headers:
                if name == b":status":
                    pending.status = int(value)
                else:
                    pending.headers[name.decode()] = value.decode()
        elif isinstance(event, DataReceived):
            pending.body += event.data
            if pending.on_data is not None and event.data:
                pending.on_data(pending.status, event.data)
        if getattr(event, "stream_ended", False):
            del self._pending[stream_id]
            if not pending.future.done():
                pending.future.set_result(H3Response(pending.status, pending.headers, bytes(pending.body)))

    def start(
        self,
        method: str,
        authority: str,
        path: str,
        body: bytes = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
        on_data: OnData | None = None,
    ) -> tuple[int, asyncio.Future[H3Response]]:
        """Send a request; (stream id, future of its response); ``on_data`` sees the body as it arrives."""
        stream_id = self._quic.get_next_available_stream_id()
        future: asyncio.Future[H3Response] = self._loop.create_future()
        self._pending[stream_id] = _Pending(future, on_data)
        h = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
            *(headers or []),
        ]
        if body:
            h.append((b"content-type", b"application/json"))
            self.h3.send_headers(stream_id, h)
            self.h3.send_data(stream_id, body, end_stream=True)
        else:
            self.h3.send_headers(stream_id, h, end_stream=True)
        self.transmit()
        return stream_id, future

    @property
    def in_flight(self) -> int:
        """Requests sent on this connection and not yet answered."""
        return len(self._pending)

    def reset(self, stream_id: int, error_code: int = 0x10C) -> None:
        """Abandon a request, as a client that gives up would: RESET_STREAM for what it was sending
        and STOP_SENDING for the answer (the one a server sees once the request was complete)."""
        self._pending.pop(stream_id, None)
        self._quic.reset_stream(stream_id, error_code)
        self._quic.stop_stream(stream_id, error_code)
        self.transmit()

    def send_partial(
        self, method: str, authority: str, path: str, body: bytes
    ) -> tuple[int, asyncio.Future[H3Response]]:
        """Send headers and part of a body without ending the stream, as a slow or hostile client
        would; (stream id, future of whatever the server answers)."""
        stream_id = self._quic.get_next_available_stream_id()
        future: asyncio.Future[H3Response] = self._loop.create_future()
        self._pending[stream_id] = _Pending(future)
        self.h3.send_headers(
            stream_id,
            [
                (b":method", method.encode()),
                (b":scheme", b"https"),
                (b":authority", authority.encode()),
                (b":path", path.encode()),
            ],
        )
        self.h3.send_data(stream_id, body, end_stream=False)
        self.transmit()
        return stream_id, future


class H3Client:
    """One HTTP/3 connection to an edgepath server."""

    def __init__(self, protocol: H3ClientProtocol, authority: str, api_key: str | None = None) -> None:
        self.protocol = protocol
        self.authority = authority
        self.headers = [(b"x-api-key", api_key.encode())] if api_key else []

    async def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        body: bytes | None = None,
        timeout: float = 30.0,
        on_data: OnData | None = None,
    ) -> H3Response:
        """One request; ``on_data`` (status, bytes) is called with each piece of the body as it arrives."""
        data = body if body is not None else (json.dumps(payload).encode() if payload is not None else b"")
        _, future = self.protocol.start(method, self.authority, path, data, self.headers, on_data)
        return await asyncio.wait_for(future, timeout)

    async def generate(self, prompt: str, max_tokens: int | None = None, stream: bool = False) -> H3Response:
        payload: dict[str, Any] = {"prompt": prompt, "stream": stream}
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        return await self.request("POST", "/v1/generate", payload)


class EventReader:
    """Server-sent events out of a body that arrives in pieces: :meth:`feed` returns the ``data`` of each
    event completed so far.  Events end with a blank line (``\\n\\n``, as edgepath frames them); a piece may
    end anywhere, even inside a UTF-8 character."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for event in events:
            lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode())
        return out


def client_configuration(
    cafile: str | None = None, insecure: bool = False, server_name: str | None = None
) -> QuicConfiguration:
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=server_name)
    if insecure:
        config.verify_mode = ssl.CERT_NONE
    elif cafile is not None:
        config.load_verify_locations(cafile)
    return config


@asynccontextmanager
async def h3_client(
    host: str,
    port: int,
    cafile: str | None = None,
    insecure: bool = False,
    server_name: str | None = None,
    api_key: str | None = None,
) -> AsyncIterator[H3Client]:
    """An open :class:`H3Client` (sending ``api_key`` as ``x-api-key``); the connection is closed on exit."""
    config = client_configuration(cafile, insecure, server_name or host)
    async with connect(host, port, configuration=config, create_protocol=H3ClientProtocol) as protocol:
        yield H3Client(cast(H3ClientProtocol, protocol), f"{server_name or host}:{port}", api_key)
