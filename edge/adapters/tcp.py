"""HTTP/1.1 adapter (``--transport tcp``) for clients without HTTP/3, built on h11.

Same service, same responses as the QUIC adapter: h11 does the framing, this module only moves
bytes and events.  One request at a time per connection (h11 pauses a pipelining client until the
response is out); keep-alive is supported.  A streamed answer goes out with chunked transfer
coding, one chunk per event batch.

No connection can sit on the edge unbounded: a new one past the edge's connection limits
(:mod:`edgepath.edge.connections`) gets a 503 with ``Retry-After`` and is closed; a connection's first request must
be complete within ``--body-timeout`` of its accept (a silent connection too: its only timer used to start at a
request's first byte), a later one within ``--body-timeout`` of its first byte -- 408 and the connection closed
otherwise (it held no frame meanwhile); and between requests a keep-alive connection may stay silent for
``--idle-timeout``, then it is closed.

A request may be refused from its head alone (:meth:`~edgepath.edge.service.Intake.head`: its key, its tenant's
state, no slot to be had): answered at once, its body is then read and dropped as it arrives -- never kept, never
parsed -- and the connection goes on to its next request (keep-alive), or closes once the body is through when the
client asked to close (closing with unread data would reset the connection, and the client could lose the answer).
A client that waits for ``100 Continue`` is answered and the connection closed: it has sent no body.  The dropped bytes
are paid for by the tenant's bucket of refused bytes as they are read (:class:`~edgepath.edge.body_budget.Dropping`);
while it owes, the connection stops reading (``pause_reading``) until the bucket refills, so the kernel's flow control
holds the client back and the edge reads a refused tenant's bytes no faster than its budget.  The body deadline still
bounds the whole: a dropped body not through within ``--body-timeout`` of the request's first byte closes the connection
(its answer went out first).  A paused connection still counts against the connection limits: opening more connections
gets a flooding client no more bytes read (the budget is its tenant's), only its per-address cap sooner.  While a
request's head is awaited a read takes at most :data:`HEAD_READ` bytes, so the body of a request refused from its head
mostly stays in the kernel (a 256 KiB first read of each flooding connection was the loop's largest item once the rest
was paced).
"""

from __future__ import annotations

import asyncio
import threading
from functools import partial
from http import HTTPStatus

import h11

from edgepath.edge.body import HEAD_MAX, IncomingBody, declared_length
from edgepath.edge.body_budget import Dropping
from edgepath.edge.http import SERVER, Headers, HttpError, Request, Response, error_response
from edgepath.edge.service import Intake, Ticket
from edgepath.native.abi import lib

#: the most bytes one read takes while a request's head is awaited (its head and a little more), and otherwise
#: (asyncio's own read size)
HEAD_READ, READ_MAX = HEAD_MAX, 256 * 1024
_reads = threading.local()  # each thread's read buffer: a read is handed over before the loop does anything else


class EdgeHttp11Protocol(asyncio.BufferedProtocol):
    """One TCP connection speaking HTTP/1.1 to the edge service."""

    def __init__(self, service: Intake) -> None:
        self._service = service
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
        self._transport: asyncio.Transport | None = None
        self._request: h11.Request | None = None
        self._body: IncomingBody | None = None  # from a request's first byte until it is complete
        self._ticket: Ticket | None = None
        self._busy = False  # a request is being answered; h11 holds later ones back
        self._closing = False  # the answer being sent is the connection's last (an early refusal)
        self._dropping = False  # the request was answered from its head: its body is read and thrown away
        self._dropped: Dropping | None = None  # who pays for the bytes thrown away, while they are
        self._paused: asyncio.TimerHandle | None = None  # reading stopped until the tenant's budget refills
        self._arrival_ns: int | None = None
        self._address: str | None = None  # the client's address, while the connection is counted
        self._idle: asyncio.TimerHandle | None = None  # between requests: --idle-timeout

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        refused = self._service.connections.admit(address)
        if refused is not None:
            retry = [(b"retry-after", b"1")]
            self._raw_error(HttpError(503, "too_many_connections", f"{refused.message}; try again later", retry))
            return
        self._address = address
        # the first request's deadline runs from the accept: a connection that never speaks is closed too
        self._body = self._service.body.start(asyncio.get_running_loop(), self._body_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop_body()
        self._stop_idle()
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        if self._ticket is not None:
            self._ticket.cancel()
            self._ticket = None
        self._transport = None
        if self._address is not None:
            self._service.connections.release(self._address)
            self._address = None

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next read goes.  While a head is awaited, at most :data:`HEAD_READ` bytes: a request refused from
        its head leaves the rest of its body in the kernel, read only as its tenant's budget allows (or never) --
        reading 256 KiB of a flooding client's body before its head was judged cost the loop more than the rest."""
        buffer: memoryview | None = getattr(_reads, "buffer", None)
        if buffer is None:
            buffer = _reads.buffer = memoryview(bytearray(READ_MAX))
        return buffer[:HEAD_READ] if self._conn.their_state is h11.IDLE else buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(_reads.buffer[:nbytes]))  # the buffer is free for the next read

    def data_received(self, data: bytes) -> None:
        self._arrival_ns = lib.ep_now_ns()
        self._stop_idle()
        if not self._busy and self._body is None:
            self._body = self._service.body.start(asyncio.get_running_loop(), self._body_late)
        self._conn.receive_data(data)
        self._process()

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_late(self) -> None:
        """Silent for ``--idle-timeout`` between requests: the connection is closed (no request is under way)."""
        self._idle = None
        if self._transport is not None and not self._busy and self._body is None:
            self._transport.close()
            self._transport = None

    def _drop_body(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None

    def _body_late(self) -> None:
        """The request did not complete within ``--body-timeout`` of its first byte: 408, then close."""
        if self._dropping and self._transport is not None:  # answered already: the rest of its body never came
            self._transport.close()
            self._transport = None
            return
        if self._busy or self._transport is None:
            return
        error = self._service.body.late()
        if self._request is not None and self._conn.our_state is h11.SEND_RESPONSE:
            self._refuse_early(error)
        else:
            self._raw_error(error)

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
                if self._body is None:  # a pipelined request h11 held back: it starts now
                    self._body = self._service.body.start(asyncio.get_running_loop(), self._body_late)
                error = self._service.body.head(event.target, event.headers) or self._service.body.declared(
                    event.headers
                )
                if error is None and self._refused_at_head(event):
                    continue
            elif isinstance(event, h11.Data):
                assert self._body is not None  # opened with the request
                if self._dropping:
                    if not self._body.drop(event.data):
                        self._transport.close()
                        self._transport = None
                    elif self._dropped is not None:
                        self._pace(self._dropped, self._dropped.drop(len(event.data), lib.ep_now_ns()))
                    continue
                error = self._body.add(event.data)
            elif isinstance(event, h11.EndOfMessage):
                if self._dropping:
                    self._dropping, self._dropped = False, None
                    self._drop_body()
                    self._next_cycle()
                    continue
                self._dispatch()
                continue
            else:
                continue
            if error is not None:
                self._refuse_early(error)
                return

    def _refused_at_head(self, req: h11.Request) -> bool:
        """Ask the edge whether the request is refused from its head (answered now, through :meth:`respond`); then
        its body is dropped as it arrives."""
        head = Request(
            req.method.decode("ascii", "replace"),
            req.target.decode("ascii", "replace"),
            list(req.headers),
            b"",
            lib.ep_now_ns(),
            self._arrival_ns,
        )
        # set before asking: the answer is written (and _finish runs) inside the call
        self._dropping = True
        self._closing = self._conn.they_are_waiting_for_100_continue  # no body comes: answer and close
        self._dropped = self._service.head(head, declared_length(req.headers), self)
        if self._dropped is not None:
            return True
        self._dropping = self._closing = False
        return False

    def _pace(self, dropped: Dropping, wait: float) -> None:
        """Stop reading for ``wait`` seconds (0: read on): the tenant whose dropped body this is owes its budget."""
        if wait > 0 and self._paused is None and self._transport is not None:
            self._transport.pause_reading()
            self._paused = asyncio.get_running_loop().call_later(wait, self._resume, dropped)

    def _resume(self, dropped: Dropping) -> None:
        """Read on once the tenant owes nothing -- or wait again: its other connections may have spent meanwhile."""
        self._paused = None
        if self._transport is None:
            return
        wait = dropped.owes(lib.ep_now_ns())
        if wait > 0:
            self._paused = asyncio.get_running_loop().call_later(wait, self._resume, dropped)
        else:
            self._transport.resume_reading()

    def _dispatch(self) -> None:
        assert self._request is not None and self._body is not None
        req = self._request
        request = Request(
            req.method.decode("ascii", "replace"),
            req.target.decode("ascii", "replace"),
            list(req.headers),
            self._body.close(),
            lib.ep_now_ns(),
            self._arrival_ns,  # the latest read; a pipelined request held back by h11 arrived earlier
        )
        self._body = None
        self._busy = True
        self._ticket = self._service.handle(request, self)

    def _refuse_early(self, error: HttpError) -> None:
        """413 before the rest of the body arrives, 408 when it comes too slowly; the connection closes after
        the answer (the rest of the body is not read)."""
        assert self._request is not None
        self._drop_body()
        request = Request(
            self._request.method.decode("ascii", "replace"),
            self._request.target.decode("ascii", "replace"),
            [],
            b"",
            lib.ep_now_ns(),
        )
        self._busy = self._closing = True
        self._service.refuse(request, error, self)

    def _protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        """Framing h11 rejects: answer with its status if a response can still be sent, then close."""
        self._raw_error(_framing_error(exc))

    def _raw_error(self, error: HttpError) -> None:
        """An error answer outside a request h11 parsed (bad framing, headers never completed), then close."""
        assert self._transport is not None
        self._drop_body()
        body = error_response(error).body
        extra = "".join(f"{name.decode()}: {value.decode()}\r\n" for name, value in error.headers)
        head = (
            f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\nserver: {SERVER.decode()}\r\n{extra}\r\n"
        )
        if self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._transport.write(head.encode() + body)
        self._transport.close()
        self._transport = None

    # -- the service's Reply ------------------------------------------------------------------------
    def respond(self, response: Response) -> None:
        headers = [*response.headers, (b"content-length", str(len(response.body)).encode())]
        if self._closing:
            headers.append((b"connection", b"close"))
        head = self._head(response.status, headers)
        if head is not None:  # the whole answer in one write: one send, one segment on the wire
            self._finish([head, self._conn.send(h11.Data(data=response.body))])

    def start(self, status: int, headers: Headers) -> None:
        """The head of a streamed answer (no content-length: h11 chunks the body)."""
        head = self._head(status, headers)
        if head is not None and self._transport is not None:
            self._transport.write(head)

    def send(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(self._conn.send(h11.Data(data=data)))

    def end(self, data: bytes) -> None:
        if self._transport is not None:
            self._finish([self._conn.send(h11.Data(data=data))] if data else [])

    def _head(self, status: int, headers: Headers) -> bytes | None:
        """The status line and headers, encoded; None (and no answer owed) if the client is gone."""
        if self._transport is None:
            self._ticket = None
            return None
        reason = HTTPStatus(status).phrase.encode()
        return self._conn.send(h11.Response(status_code=status, headers=[(b"server", SERVER), *headers], reason=reason))

    def _finish(self, out: list[bytes]) -> None:
        """The answer is complete: end the message, then read the next request or close."""
        self._ticket = None
        transport = self._transport
        if transport is None:
            return
        out.append(self._conn.send(h11.EndOfMessage()))
        transport.write(b"".join(out))
        self._busy = False
        if self._dropping and not self._closing and self._conn.their_state is h11.SEND_BODY:
            return  # answered from its head: the rest of its body is read and dropped, then the next cycle
        self._next_cycle()

    def _next_cycle(self) -> None:
        """This request and its answer are through: read the next request, or close."""
        transport = self._transport
        assert transport is not None
        if self._conn.our_state is h11.MUST_CLOSE or self._conn.their_state is not h11.DONE:
            transport.close()
            self._transport = None
            return
        self._conn.start_next_cycle()
        self._process()
        if not self._busy and self._body is None and self._transport is not None:
            loop = asyncio.get_running_loop()
            if self._conn.trailing_data[0]:  # part of the next request came while this one was answered
                self._body = self._service.body.start(loop, self._body_late)
            else:
                self._idle = loop.call_later(self._service.connections.idle_timeout, self._idle_late)


def _framing_error(exc: h11.RemoteProtocolError) -> HttpError:
    return HttpError(exc.error_status_hint, "bad_http", f"malformed HTTP/1.1 request: {exc}")


async def serve_tcp(service: Intake, host: str, port: int, reuse_port: bool = False) -> asyncio.Server:
    """``reuse_port``: SO_REUSEPORT, so that several edge workers share the port (the kernel spreads connections)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(partial(EdgeHttp11Protocol, service), host, port, reuse_port=reuse_port)
