"""HTTP/3 adapter: QUIC engine events in (aioquic or qh3, edge/adapters/quic_engine.py), complete :class:`Request`
objects out, responses back.

Only framing lives here: collecting a stream's headers and body, enforcing the body limit while it
arrives (413 without waiting for the rest) and the body deadline (408 when a body does not complete
within ``--body-timeout``), noticing streams the client resets, and sending the response -- whole,
or streamed as the service produces it.  Everything else is
:class:`~edgepath.edge.service.EdgeService`.  Responses produced while a datagram is being processed
leave with that datagram's transmit; others are coalesced into one transmit per loop iteration.

A datagram that completed a request and produced no answer yet does not transmit at once: its answer
comes from the slot server a few hundred microseconds later, and the engine would only have built an
empty packet (it delays ACKs by its own ACK delay, 1 ms, so there is nothing due).  That transmit is
deferred until the answer goes out or ``DEFERRED_TRANSMIT_S`` has passed, whichever is first: one
transmit per request instead of two (the empty one cost about 50 µs of CPU on aioquic).

An early refusal follows RFC 9114 §4.1: the complete response is sent, then reading is aborted with
H3_NO_ERROR (STOP_SENDING), so a client such as libcurl reads the 413/408 instead of a reset.

Per-connection limits (aioquic's, not configurable there): at most 128 bidirectional streams open at
once (MAX_STREAMS credit is granted again as streams finish), ``max_stream_data`` and ``max_data``
flow-control windows of 1 MiB.  A stream holds no frame and no slot until its request is complete,
and the body deadline bounds how long an incomplete one is kept.  Connections are counted with the HTTP/1.1
adapter's (:mod:`edgepath.edge.connections`): a new one past ``--max-connections`` or
``--max-connections-per-address`` is closed with CONNECTION_REFUSED as soon as its first packet is read; one
silent for ``--idle-timeout`` is closed by the QUIC engine (its ``max_idle_timeout``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import cache, partial
from typing import TYPE_CHECKING, Any, ClassVar

from edgepath.edge.adapters.quic_engine import DEFAULT_ENGINE, QuicEngine, load_engine
from edgepath.edge.body import IncomingBody, declared_length
from edgepath.edge.connections import DEFAULT_IDLE_TIMEOUT
from edgepath.edge.http import SERVER, Headers, HttpError, Request, Response
from edgepath.edge.service import Intake, Ticket
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

H3_NO_ERROR = 0x100
#: QUIC's transport error for a server that refuses a connection (RFC 9000 §20.1)
CONNECTION_REFUSED = 0x2
#: at most this long after a datagram that completed a request, its transmit happens even with no answer
#: yet (the engines' ACK delay: no ACK is due earlier; flow-control credit waits at most this long)
DEFERRED_TRANSMIT_S = 0.001


@dataclass(eq=False, slots=True)
class _Stream:
    method: str = ""
    target: str = ""
    headers: Headers = field(default_factory=list)
    body: IncomingBody | None = None  # while a request that did not end with its headers arrives
    answered: bool = False  # an early answer (413, 408) went out; ignore the rest
    ticket: Ticket | None = None


def response_headers(status: int, headers: Headers, length: int | None) -> Headers:
    out = [(b":status", str(status).encode()), (b"server", SERVER), *headers]
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    return out


class _StreamReply:
    """One HTTP/3 request stream's way back (the service's :class:`~edgepath.edge.service.Reply`)."""

    __slots__ = ("_protocol", "_stream_id")

    def __init__(self, protocol: EdgeProtocol, stream_id: int) -> None:
        self._protocol = protocol
        self._stream_id = stream_id

    def respond(self, response: Response) -> None:
        h3 = self._protocol.sendable(self._stream_id, last=True)
        if h3 is not None:
            h3.send_headers(self._stream_id, response_headers(response.status, response.headers, len(response.body)))
            h3.send_data(self._stream_id, response.body, end_stream=True)
            self._protocol.schedule_transmit()

    def start(self, status: int, headers: Headers) -> None:
        h3 = self._protocol.sendable(self._stream_id, last=False)
        if h3 is not None:
            h3.send_headers(self._stream_id, response_headers(status, headers, None))
            self._protocol.schedule_transmit()

    def send(self, data: bytes) -> None:
        h3 = self._protocol.sendable(self._stream_id, last=False)
        if h3 is not None:
            h3.send_data(self._stream_id, data, end_stream=False)
            self._protocol.schedule_transmit()

    def end(self, data: bytes) -> None:
        h3 = self._protocol.sendable(self._stream_id, last=True)
        if h3 is not None:
            h3.send_data(self._stream_id, data, end_stream=True)
            self._protocol.schedule_transmit()


class EdgeProtocol(_ProtocolBase):
    """One QUIC connection carrying HTTP/3 requests to the edge service (engine-neutral: see protocol_class)."""

    engine: ClassVar[QuicEngine]

    def __init__(self, *args: Any, service: Intake, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._service = service
        self._h3: H3Connection | None = None
        self._streams: dict[int, _Stream] = {}
        self._receiving = False
        self._flush_scheduled = False
        self._terminated = False
        self._arrival_ns: int | None = None
        self._completed = False  # this datagram completed a request that is not answered yet
        self._answered = False  # a response was produced while this datagram was processed
        self._deferred: asyncio.TimerHandle | None = None
        self._address: str | None = None  # the client's address, while the connection is counted
        self._admitted = False

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._arrival_ns = None  # stamped when aioquic hands over this datagram's first event
        self._receiving = True
        self._completed = self._answered = False
        try:
            super().datagram_received(data, addr)  # the engine's: receive, events, transmit()
        finally:
            self._receiving = False
        if not self._admitted:
            self._admit(str(addr[0]) if isinstance(addr, tuple) and addr else "unknown")

    def _admit(self, address: str) -> None:
        """A new connection's first packet is read: count it, or close it with CONNECTION_REFUSED."""
        self._admitted = True
        refused = self._service.connections.admit(address)
        if refused is None:
            self._address = address
            return
        self._quic.close(error_code=CONNECTION_REFUSED, reason_phrase=f"{refused.message}; try again later")
        self.transmit()

    def _release(self) -> None:
        if self._address is not None:
            self._service.connections.release(self._address)
            self._address = None

    def transmit(self) -> None:
        """The engine's transmit, except right after a datagram whose request will be answered shortly."""
        if self._receiving and self._completed and not self._answered:
            if self._deferred is None:
                self._deferred = self._loop.call_later(DEFERRED_TRANSMIT_S, self._transmit_deferred)
            return
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None
        super().transmit()

    def _transmit_deferred(self) -> None:
        self._deferred = None
        self.transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if self._arrival_ns is None:
            # Every request completed by this datagram is available to the edge from now on; the ones
            # handled after others in the same datagram show that wait in their queue time.
            self._arrival_ns = lib.ep_now_ns()
        if isinstance(event, self.engine.ProtocolNegotiated) and event.alpn_protocol in self.engine.H3_ALPN:
            self._h3 = self.engine.server_h3(self._quic)
        if isinstance(event, self.engine.StreamReset | self.engine.StopSendingReceived):
            # RESET_STREAM: the client stopped sending (a request cut short); STOP_SENDING: it stopped
            # reading -- how a client that sent its whole request walks away from the answer
            self._reset(event.stream_id)
        elif isinstance(event, self.engine.ConnectionTerminated):
            self._terminated = True
            self._release()
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
                limits = self._service.body
                error = limits.head(stream.target, stream.headers) or limits.declared(stream.headers)
                if error is not None:
                    self._refuse_early(event.stream_id, stream, error)
                elif not event.stream_ended:
                    if self._refused_at_head(event.stream_id, stream):
                        return
                    stream.body = limits.start(self._loop, partial(self._body_late, event.stream_id))
        elif isinstance(event, self.engine.DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is None or stream.answered or stream.body is None:
                return
            error = stream.body.add(event.data)
            if error is not None:
                self._refuse_early(event.stream_id, stream, error)
                return
        else:
            return
        if event.stream_ended and not stream.answered:
            body = b""
            if stream.body is not None:
                body, stream.body = stream.body.close(), None
            request = Request(stream.method, stream.target, stream.headers, body, lib.ep_now_ns(), self._arrival_ns)
            self._completed = True
            stream.ticket = self._service.handle(request, _StreamReply(self, event.stream_id))

    def _refused_at_head(self, stream_id: int, stream: _Stream) -> bool:
        """Ask the edge whether the request is refused from its head (answered now); then its body is not read:
        reading is stopped with H3_NO_ERROR (RFC 9114 §4.1) and what still arrives is dropped."""
        head = Request(stream.method, stream.target, stream.headers, b"", lib.ep_now_ns(), self._arrival_ns)
        if self._service.head(head, declared_length(stream.headers), _StreamReply(self, stream_id)) is None:
            return False
        stream.answered = True
        if not self._terminated:
            self._quic.stop_stream(stream_id, H3_NO_ERROR)
        return True

    def _body_late(self, stream_id: int) -> None:
        """The request did not complete within ``--body-timeout``: 408, and stop reading the rest."""
        stream = self._streams.get(stream_id)
        if stream is not None and stream.ticket is None and not stream.answered:
            self._refuse_early(stream_id, stream, self._service.body.late())

    def _refuse_early(self, stream_id: int, stream: _Stream, error: HttpError) -> None:
        """Answer before the body is complete, then abort reading with H3_NO_ERROR (RFC 9114 §4.1)."""
        stream.answered = True
        if stream.body is not None:
            stream.body.close()
            stream.body = None
        request = Request(stream.method, stream.target, stream.headers, b"", lib.ep_now_ns())
        self._service.refuse(request, error, _StreamReply(self, stream_id))
        if not self._terminated:
            self._quic.stop_stream(stream_id, H3_NO_ERROR)

    def _reset(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            if stream.body is not None:
                stream.body.close()
            if stream.ticket is not None:
                stream.ticket.cancel()  # the lifecycle counts the reset and abandons what it holds
            elif not stream.answered:
                self._service.reset_early()  # reset before the request was complete: nothing held

    def sendable(self, stream_id: int, last: bool) -> H3Connection | None:
        """The HTTP/3 connection if ``stream_id`` can still be answered (``last``: this ends it)."""
        stream = self._streams.pop(stream_id, None) if last else self._streams.get(stream_id)
        if stream is None or self._h3 is None or self._terminated:
            return None  # reset by the client, or the connection is gone
        return self._h3

    def schedule_transmit(self) -> None:
        if self._receiving:
            self._answered = True  # leaves with this datagram's transmit
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.transmit()


@cache
def protocol_class(engine: QuicEngine) -> type[EdgeProtocol]:
    """:class:`EdgeProtocol` on ``engine``'s ``QuicConnectionProtocol`` (one class per engine)."""
    return type(f"EdgeProtocol_{engine.name}", (EdgeProtocol, engine.QuicConnectionProtocol), {"engine": engine})


def server_configuration(
    certificate: str, private_key: str, engine: str = DEFAULT_ENGINE, idle_timeout: float = DEFAULT_IDLE_TIMEOUT
) -> QuicConfiguration:
    """The edge's QUIC configuration: its certificate, and ``idle_timeout`` (seconds) as QUIC's ``max_idle_timeout``:
    a connection silent that long is closed by the engine."""
    config = load_engine(engine).configuration(is_client=False)
    config.load_cert_chain(certificate, private_key)
    config.idle_timeout = idle_timeout
    return config


async def serve_quic(
    service: Intake,
    host: str,
    port: int,
    configuration: QuicConfiguration,
    reuse_port: bool = False,
    retry: bool = False,
    engine: str = DEFAULT_ENGINE,
) -> QuicServer:
    """The QUIC engine's ``serve()``, with SO_REUSEPORT when ``reuse_port`` (edge workers sharing one UDP port;
    the kernel keeps each client address on one worker).  ``retry``: validate client addresses with
    a Retry round trip before any state is kept for them (RFC 9000 §8.1), against floods from
    spoofed source addresses; costs one round trip.  ``configuration`` must come from the same engine
    (server_configuration)."""
    quic = load_engine(engine)
    protocol = partial(protocol_class(quic), service=service)
    loop = asyncio.get_running_loop()
    _, server = await loop.create_datagram_endpoint(
        lambda: quic.QuicServer(configuration=configuration, create_protocol=protocol, retry=retry),
        local_addr=(host, port),
        reuse_port=reuse_port,
    )
    return server
