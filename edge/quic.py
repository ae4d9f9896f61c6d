"""HTTP/3 adapter: QUIC engine events in (aioquic or qh3, edge/quic_engine.py), complete :class:`Request`
objects out, responses back.

Only framing lives here: collecting a stream's headers and body, enforcing the body limit while it
arrives (413 without waiting for the rest), noticing streams the client resets, and sending the
response.  Everything else is :class:`~edgepath.edge.service.EdgeService`.  Responses produced while
a datagram is being processed leave with that datagram's transmit; others are coalesced into one
transmit per loop iteration.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import cache, partial
from typing import TYPE_CHECKING, Any, ClassVar

from edgepath.edge.http import Headers, Request, Response, error_response
from edgepath.edge.quic_engine import DEFAULT_ENGINE, QuicEngine, load_engine
from edgepath.edge.service import EdgeService, Ticket
from edgepath.native.abi import lib

if TYPE_CHECKING:  # the reference engine's types; qh3 keeps the same API
    from aioquic.asyncio import QuicConnectionProtocol as _ProtocolBase
    from aioquic.asyncio.server import QuicServer
    from aioquic.h3.connection import H3Connection
    from aioquic.h3.events import H3Event
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.events import QuicEvent
else:
    _ProtocolBase = object  # the engine's QuicConnectionProtocol is mixed in by protocol_class()

SERVER = b"edgepath"
H3_REQUEST_CANCELLED = 0x10C


@dataclass(eq=False, slots=True)
class _Stream:
    method: str = ""
    target: str = ""
    headers: Headers = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    answered: bool = False  # an early answer (413) went out; ignore the rest
    ticket: Ticket | None = None


def response_headers(response: Response) -> Headers:
    headers = [(b":status", str(response.status).encode()), (b"server", SERVER), *response.headers]
    if response.events is None:
        headers.append((b"content-length", str(len(response.body)).encode()))
    return headers


class EdgeProtocol(_ProtocolBase):
    """One QUIC connection carrying HTTP/3 requests to the edge service (engine-neutral: see protocol_class)."""

    engine: ClassVar[QuicEngine]

    def __init__(self, *args: Any, service: EdgeService, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._service = service
        self._h3: H3Connection | None = None
        self._streams: dict[int, _Stream] = {}
        self._receiving = False
        self._flush_scheduled = False
        self._terminated = False
        self._arrival_ns: int | None = None

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._arrival_ns = None  # stamped when aioquic hands over this datagram's first event
        self._receiving = True
        try:
            super().datagram_received(data, addr)
        finally:
            self._receiving = False

    def quic_event_received(self, event: QuicEvent) -> None:
        if self._arrival_ns is None:
            # Every request completed by this datagram is available to the edge from now on; the ones
            # handled after others in the same datagram show that wait in their queue time.
            self._arrival_ns = lib.ep_now_ns()
        if isinstance(event, self.engine.ProtocolNegotiated) and event.alpn_protocol in self.engine.H3_ALPN:
            self._h3 = self.engine.H3Connection(self._quic)
        if isinstance(event, self.engine.StreamReset):
            self._reset(event.stream_id)
        elif isinstance(event, self.engine.ConnectionTerminated):
            self._terminated = True
            for stream_id in list(self._streams):
                self._reset(stream_id)
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, self.engine.HeadersReceived):
            stream = self._streams.get(event.stream_id)
            if stream is None:
                stream = self._streams[event.stream_id] = _Stream()
                for name, value in event.headers:
                    if name == b":method":
                        stream.method = value.decode("ascii", "replace")
                    elif name == b":path":
                        stream.target = value.decode("ascii", "replace")
                    elif not name.startswith(b":"):
                        stream.headers.append((name, value))
                length = _content_length(stream.headers)
                if length is not None and length > self._service.core.limits.max_body:
                    self._refuse_too_large(event.stream_id, stream, length)
        elif isinstance(event, self.engine.DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is None or stream.answered:
                return
            stream.body += event.data
            if len(stream.body) > self._service.core.limits.max_body:
                self._refuse_too_large(event.stream_id, stream, len(stream.body))
                return
        else:
            return
        if event.stream_ended and not stream.answered:
            request = Request(
                stream.method, stream.target, stream.headers, bytes(stream.body), lib.ep_now_ns(), self._arrival_ns
            )
            stream.body = bytearray()
            stream.ticket = self._service.handle(request, partial(self._send, event.stream_id))

    def _refuse_too_large(self, stream_id: int, stream: _Stream, size: int) -> None:
        """413 as soon as the body is known to be too large; stop the client from sending the rest."""
        stream.answered = True
        stream.body = bytearray()
        request = Request(stream.method, stream.target, stream.headers, b"", lib.ep_now_ns())
        self._service.refuse(
            request, error_response(self._service.core.too_large(size)), partial(self._send, stream_id)
        )
        self._quic.stop_stream(stream_id, H3_REQUEST_CANCELLED)

    def _reset(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            self._service.metrics.resets.inc()
            if stream.ticket is not None:
                stream.ticket.cancel()

    def _send(self, stream_id: int, response: Response) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None or self._h3 is None or self._terminated:
            return  # reset by the client, or the connection is gone
        h3 = self._h3
        if response.events is None:
            h3.send_headers(stream_id, response_headers(response))
            h3.send_data(stream_id, response.body, end_stream=True)
        else:
            h3.send_headers(stream_id, response_headers(response))
            for chunk in response.events:
                h3.send_data(stream_id, chunk, end_stream=False)
            h3.send_data(stream_id, b"", end_stream=True)
        if not self._receiving and not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.transmit()


def _content_length(headers: Headers) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


@cache
def protocol_class(engine: QuicEngine) -> type[EdgeProtocol]:
    """:class:`EdgeProtocol` on ``engine``'s ``QuicConnectionProtocol`` (one class per engine)."""
    return type(f"EdgeProtocol_{engine.name}", (EdgeProtocol, engine.QuicConnectionProtocol), {"engine": engine})


def server_configuration(certificate: str, private_key: str, engine: str = DEFAULT_ENGINE) -> QuicConfiguration:
    config = load_engine(engine).configuration(is_client=False)
    config.load_cert_chain(certificate, private_key)
    return config


async def serve_quic(
    service: EdgeService,
    host: str,
    port: int,
    configuration: QuicConfiguration,
    reuse_port: bool = False,
    engine: str = DEFAULT_ENGINE,
) -> QuicServer:
    """The QUIC engine's ``serve()``, with SO_REUSEPORT when ``reuse_port`` (edge workers sharing one UDP port;
    the kernel keeps each client address on one worker). ``configuration`` must come from the same engine
    (server_configuration)."""
    quic = load_engine(engine)
    protocol = partial(protocol_class(quic), service=service)
    loop = asyncio.get_running_loop()
    _, server = await loop.create_datagram_endpoint(
        lambda: quic.QuicServer(configuration=configuration, create_protocol=protocol),
        local_addr=(host, port),
        reuse_port=reuse_port,
    )
    return server
