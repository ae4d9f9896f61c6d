"""The body limits both HTTP adapters apply while a request arrives (413 past --max-body, 408 past
--body-timeout), and the HTTP/1.1 adapter using them through the narrow interface it has of the edge."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from edgepath.edge.adapters.tcp import EdgeHttp11Protocol
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.body import BodyLimits
from edgepath.edge.body_budget import BodyBudget, Dropping
from edgepath.edge.connections import ConnectionLimits
from edgepath.edge.http import Headers, HttpError, Limits, Request, Response
from edgepath.edge.routes import HttpCore
from edgepath.edge.service import Ticket
from edgepath.native.abi import lib


class _Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Loop:
    """Records the deadline a body asks for instead of running it."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, Any, _Handle]] = []

    def call_later(self, delay: float, callback: Any) -> _Handle:
        handle = _Handle()
        self.timers.append((delay, callback, handle))
        return handle


def test_a_declared_length_past_the_limit_is_413_at_once() -> None:
    limits = BodyLimits(100, 5.0)
    error = limits.declared([(b"host", b"x"), (b"content-length", b"101")])
    assert error is not None and (error.status, error.type) == (413, "body_too_large")
    assert "101 bytes" in error.message and "limit is 100" in error.message
    assert limits.declared([(b"content-length", b"100")]) is None
    assert limits.declared([(b"content-length", b"ten")]) is None  # the framing layer judges it
    assert limits.declared([]) is None


def test_a_body_is_413_as_soon_as_it_grows_past_the_limit_and_its_deadline_is_one_timer() -> None:
    loop = _Loop()
    body = BodyLimits(10, 2.5).start(loop, lambda: None)  # type: ignore[arg-type]
    ((delay, _, handle),) = loop.timers
    assert delay == 2.5 and not handle.cancelled
    assert body.add(b"12345") is None and body.add(b"67890") is None
    error = body.add(b"!")
    assert error is not None and (error.status, error.type) == (413, "body_too_large") and "11 bytes" in error.message
    assert body.close() == b"1234567890!" and handle.cancelled
    assert body.close() == b""


def test_late_is_408_naming_the_timeout_and_bad_limits_are_refused() -> None:
    late = BodyLimits(1, 0.5).late()
    assert (late.status, late.type) == (408, "body_timeout") and "0.5 s" in late.message
    with pytest.raises(ValueError, match="body timeout must be positive"):
        BodyLimits(1, 0.0)
    with pytest.raises(ValueError, match="at least 1 byte"):
        BodyLimits(0, 1.0)


def test_the_deadline_runs_on_the_loop() -> None:
    async def main() -> None:
        fired = asyncio.Event()
        BodyLimits(1, 0.001).start(asyncio.get_running_loop(), fired.set)
        await asyncio.wait_for(fired.wait(), 10)

    asyncio.run(main())


class _Intake:
    """The edge as the adapter sees it: body limits, and where requests, refusals and resets go."""

    def __init__(self, max_body: int) -> None:
        self.core = HttpCore(
            Limits(max_body, 16, 16, 100), None, OpenAIRoutes("echo", 16, 100, ChatSupport(False, ""), 0)
        )
        self.body = BodyLimits(max_body, 30.0)
        self.connections = ConnectionLimits(10, 10, 30.0)
        self.handled: list[Request] = []
        self.refused: list[tuple[Request, HttpError]] = []
        self.refuse_heads: HttpError | None = None  # the answer every head gets (None: every body is read)
        self.heads: list[tuple[Request, int | None]] = []
        self.budget = BodyBudget(0, 1)  # who pays for dropped bodies (0: no budget, never paced)

    def head(self, request: Request, length: int | None, reply: Any) -> Dropping | None:
        self.heads.append((request, length))
        if self.refuse_heads is None:
            return None
        reply.respond(self.core.refusal(request.target, self.refuse_heads))
        return Dropping(self.budget, "t")

    def handle(self, request: Request, reply: Any) -> Ticket:
        self.handled.append(request)
        reply.respond(Response(200, [(b"content-type", b"application/json")], b"{}"))
        return Ticket(self, 0)  # type: ignore[arg-type]

    def refuse(self, request: Request, error: HttpError, reply: Any) -> None:
        self.refused.append((request, error))
        reply.respond(self.core.refusal(request.target, error))  # what the service sends, in the route's shape

    def reset_early(self) -> None:
        raise AssertionError("HTTP/1.1 has no stream resets")


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True


def _connection(max_body: int) -> tuple[EdgeHttp11Protocol, _Intake, _Transport]:
    intake = _Intake(max_body)
    protocol = EdgeHttp11Protocol(intake)  # type: ignore[arg-type]
    transport = _Transport()
    protocol.connection_made(transport)
    return protocol, intake, transport


def _split(raw: bytes) -> tuple[bytes, Headers, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = [(k.lower(), v.strip()) for k, _, v in (line.partition(b":") for line in lines)]
    return status, headers, body


def test_http11_refuses_a_declared_oversize_body_at_once_in_the_routes_shape_and_closes() -> None:
    async def main() -> None:
        protocol, intake, transport = _connection(max_body=64)
        protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{")
        ((request, error),) = intake.refused
        assert (request.method, request.target, error.status) == ("POST", "/v1/completions", 413)
        status, headers, body = _split(bytes(transport.out))
        assert status.startswith(b"HTTP/1.1 413 ") and (b"connection", b"close") in headers
        assert json.loads(body)["error"]["code"] == "body_too_large"  # OpenAI's shape on an OpenAI route
        assert transport.closed and not intake.handled

    asyncio.run(main())


def test_http11_refuses_a_body_that_grows_past_the_limit_and_serves_a_complete_one() -> None:
    async def main() -> None:
        protocol, intake, transport = _connection(max_body=8)
        protocol.data_received(b"POST /v1/generate HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nabcd")
        (served,) = intake.handled
        assert served.body == b"abcd" and not intake.refused and transport.out.startswith(b"HTTP/1.1 200 ")
        transport.out.clear()
        protocol.data_received(b"POST /v1/generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        protocol.data_received(b"5\r\n12345\r\n")
        assert not intake.refused  # 5 bytes: within the limit
        protocol.data_received(b"5\r\n67890\r\n")
        ((_, error),) = intake.refused
        assert (error.status, error.message) == (413, "request body is 10 bytes; the limit is 8")
        status, headers, body = _split(bytes(transport.out))
        assert status.startswith(b"HTTP/1.1 413 ") and json.loads(body)["error"]["type"] == "body_too_large"
        assert (b"connection", b"close") in headers and transport.closed

    asyncio.run(main())


NO_SLOT = HttpError(429, "no_slot", "every slot is busy", [(b"retry-after", b"1")])


def _post(body: bytes, *headers: bytes) -> bytes:
    head = b"".join(h + b"\r\n" for h in headers)
    return b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n" % (len(body), head) + body


def test_http11_answers_a_request_refused_from_its_head_drops_its_body_and_keeps_the_connection() -> None:
    """The answer goes out as soon as the head is read; the body that follows, in any number of reads, is dropped
    (never handed over, never parsed); then the next request on the connection is read as usual."""

    async def main() -> None:
        protocol, intake, transport = _connection(max_body=1 << 20)
        intake.refuse_heads = NO_SLOT
        request = _post(b"x" * 100_000)
        protocol.data_received(request[:200])
        ((head, length),) = intake.heads
        assert (head.method, head.target, head.body, length) == ("POST", "/v1/completions", b"", 100_000)
        status, headers, body = _split(bytes(transport.out))
        assert status.startswith(b"HTTP/1.1 429 ") and json.loads(body)["error"]["code"] == "no_slot"
        assert (b"connection", b"close") not in headers and not transport.closed
        for at in range(200, len(request), 30_000):
            protocol.data_received(request[at : at + 30_000])
        assert not intake.handled and not transport.closed
        transport.out.clear()
        intake.refuse_heads = None
        protocol.data_received(_post(b'{"prompt": "hi"}'))
        (served,) = intake.handled
        assert served.body == b'{"prompt": "hi"}' and transport.out.startswith(b"HTTP/1.1 200 ")

    asyncio.run(main())


def test_http11_a_refused_client_that_asked_to_close_is_closed_once_its_body_is_through() -> None:
    """Closing with unread data would reset the connection (and could lose the answer): the body is read first."""

    async def main() -> None:
        protocol, intake, transport = _connection(max_body=1 << 20)
        intake.refuse_heads = NO_SLOT
        request = _post(b"y" * 50_000, b"connection: close")
        protocol.data_received(request[:100])
        assert transport.out.startswith(b"HTTP/1.1 429 ") and not transport.closed
        protocol.data_received(request[100:])
        assert transport.closed and not intake.handled

    asyncio.run(main())


def test_http11_a_refused_client_waiting_for_100_continue_is_answered_and_closed_at_once() -> None:
    async def main() -> None:
        protocol, intake, transport = _connection(max_body=1 << 20)
        intake.refuse_heads = NO_SLOT
        protocol.data_received(_post(b"", b"expect: 100-continue").replace(b"length: 0", b"length: 5000"))
        status, headers, _ = _split(bytes(transport.out))
        assert status.startswith(b"HTTP/1.1 429 ") and (b"connection", b"close") in headers and transport.closed

    asyncio.run(main())


def test_http11_a_dropped_body_past_the_limit_or_its_deadline_closes_the_connection() -> None:
    async def main() -> None:
        protocol, intake, transport = _connection(max_body=64)
        intake.refuse_heads = NO_SLOT
        protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        assert transport.out.startswith(b"HTTP/1.1 429 ")
        protocol.data_received(b"40\r\n" + b"z" * 64 + b"\r\n")
        assert not transport.closed  # 64 bytes dropped: within the limit
        protocol.data_received(b"1\r\nz\r\n")
        assert transport.closed and not intake.handled
        protocol, intake, transport = _connection(max_body=64)
        intake.refuse_heads = NO_SLOT
        protocol.data_received(_post(b"z" * 60)[:-10])
        protocol._body_late()  # its deadline: the rest never came
        assert transport.closed and transport.out.count(b"HTTP/1.1") == 1  # no second answer

    asyncio.run(main())


#: the most bytes one read of an asyncio socket transport takes (``_SelectorSocketTransport.max_size``)
ONE_READ = 256 * 1024


class _Counting(EdgeHttp11Protocol):
    """The adapter, counting the bytes it read off the socket."""

    read = 0

    def data_received(self, data: bytes) -> None:
        _Counting.read += len(data)
        super().data_received(data)


def test_http11_a_refused_tenant_that_owes_its_budget_is_read_no_faster_than_it_and_closed_at_the_deadline() -> None:
    """Issue 49's flood: a request refused from its head while its tenant's body budget is spent.  The answer goes
    out first; then the connection stops reading while the tenant owes, so the edge reads the body no faster than the
    budget (plus one read) however fast the client sends -- the kernel holds the rest back -- and the body deadline
    closes the connection when the body cannot be through in time."""
    rate, timeout, size = 32 * 1024, 1.0, 1 << 20

    async def main() -> tuple[int, float, int, float]:
        loop = asyncio.get_running_loop()
        intake = _Intake(max_body=size)
        intake.body = BodyLimits(size, timeout)
        intake.connections = ConnectionLimits(10, 10, 2.0)  # unpaced, it would go on to idle out instead
        intake.refuse_heads = HttpError(429, "body_rate", "this tenant's body budget is spent")
        intake.budget = BodyBudget(rate, size)
        intake.budget.take("t", size, lib.ep_now_ns())  # spent: the bucket holds nothing
        _Counting.read = 0
        server = await loop.create_server(lambda: _Counting(intake), "127.0.0.1", 0)  # type: ignore[arg-type]
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        start = loop.time()
        head = _post(b"")[:-4].replace(b"length: 0", b"length: %d" % size) + b"\r\n\r\n"
        writer.write(head + b"b" * size)  # as fast as the kernel takes it: the edge decides what it reads
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        # the rest of the answer, then the edge's close: a reset, with the unread body in its buffer (read first)
        with contextlib.suppress(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 30)
        closed = loop.time() - start
        writer.close()
        server.close()
        await server.wait_closed()
        return _Counting.read - len(head), closed, answer.count(b"HTTP/1.1 429 "), loop.time() - start

    body_read, closed, answered, elapsed = asyncio.run(main())
    assert answered == 1  # the 429 went out before the connection closed
    assert closed >= timeout  # it was closed by the body deadline, not sooner
    assert body_read <= rate * elapsed + ONE_READ  # paced: the budget's bytes and one read, however fast it sent
    assert body_read < size  # so the body never got through: the deadline ended it
