"""HTTP/1.1 adapter (``--transport tcp``) for clients without HTTP/3, built on h11.

Same service, same responses as the QUIC adapter: h11 does the framing, this module only moves
bytes and events.  One request at a time per connection (h11 pauses a pipelining client until the
response is out); keep-alive is supported.
"""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial
from http import HTTPStatus

import h11

from edgepath.edge.http import HttpError, Request, Response, error_response
from edgepath.edge.service import EdgeService, Ticket
from edgepath.native.abi import lib

SERVER = b"edgepath"


class EdgeHttp11Protocol(asyncio.Protocol):
    """One TCP connection speaking HTTP/1.1 to the edge service."""

    def __init__(self, service: EdgeService) -> None:
        self._service = service
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
        self._transport: asyncio.Transport | None = None
        self._request: h11.Request | None = None
        self._body = bytearray()
        self._ticket: Ticket | None = None
        self._busy = False  # a request is being answered; h11 holds later ones back
        self._arrival_ns: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ticket is not None:
            self._service.metrics.resets.inc()
            self._ticket.cancel()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._arrival_ns = lib.ep_now_ns()
        self._conn.receive_data(data)
        self._process()

    def eof_received(self) -> bool | None:
        self._conn.receive_data(b"")
        self._process()
        return None

    def _process(self) -> None:
        while not self._busy and self._transport is not None:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._protocol_error(exc)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.ConnectionClosed):
                self._transport.close()
                return
            if isinstance(event, h11.Request):
                self._request = event
                self._body = bytearray()
                length = _content_length(event)
                if length is not None and length > self._service.core.limits.max_body:
                    self._too_large(length)
                    return
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > self._service.core.limits.max_body:
                    self._too_large(len(self._body))
                    return
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()

    def _dispatch(self) -> None:
        assert self._request is not None
        req = self._request
        request = Request(
            req.method.decode("ascii", "replace"),
            req.target.decode("ascii", "replace"),
            list(req.headers),
            bytes(self._body),
            lib.ep_now_ns(),
            self._arrival_ns,  # the latest read; a pipelined request held back by h11 arrived earlier
        )
        self._body = bytearray()
        self._busy = True
        self._ticket = self._service.handle(request, self._send)

    def _too_large(self, size: int) -> None:
        """413 before the rest of the body arrives; the connection closes after it (the body is not read)."""
        assert self._request is not None
        request = Request(
            self._request.method.decode("ascii", "replace"), self._request.target.decode(), [], b"", lib.ep_now_ns()
        )
        self._busy = True
        response = error_response(self._service.core.too_large(size))
        response.headers.append((b"connection", b"close"))
        self._service.refuse(request, response, self._send)

    def _protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        """Framing h11 rejects: answer with its status if a response can still be sent, then close."""
        assert self._transport is not None
        if self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = error_response(_framing_error(exc)).body
            with contextlib.suppress(h11.LocalProtocolError):
                self._transport.write(
                    self._conn.send(
                        h11.Response(
                            status_code=exc.error_status_hint,
                            reason=HTTPStatus(exc.error_status_hint).phrase.encode(),
                            headers=[
                                (b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"),
                            ],
                        )
                    )
                    + self._conn.send(h11.Data(data=body))
                    + self._conn.send(h11.EndOfMessage())
                )
        self._transport.close()

    def _send(self, response: Response) -> None:
        self._ticket = None
        transport = self._transport
        if transport is None:
            return
        headers = [(b"server", SERVER), *response.headers]
        if response.events is None:
            headers.append((b"content-length", str(len(response.body)).encode()))
        reason = HTTPStatus(response.status).phrase.encode()
        out = [self._conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason))]
        if response.events is None:
            out.append(self._conn.send(h11.Data(data=response.body)))
        else:
            out.extend(self._conn.send(h11.Data(data=chunk)) for chunk in response.events)
        out.append(self._conn.send(h11.EndOfMessage()))
        transport.write(b"".join(out))
        self._busy = False
        if self._conn.our_state is h11.MUST_CLOSE or self._conn.their_state is not h11.DONE:
            transport.close()
            self._transport = None
            return
        self._conn.start_next_cycle()
        self._process()


def _framing_error(exc: h11.RemoteProtocolError) -> HttpError:
    return HttpError(exc.error_status_hint, "bad_http", f"malformed HTTP/1.1 request: {exc}")


def _content_length(request: h11.Request) -> int | None:
    for name, value in request.headers:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


async def serve_tcp(service: EdgeService, host: str, port: int, reuse_port: bool = False) -> asyncio.Server:
    """``reuse_port``: SO_REUSEPORT, so that several edge workers share the port (the kernel spreads connections)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(partial(EdgeHttp11Protocol, service), host, port, reuse_port=reuse_port)
