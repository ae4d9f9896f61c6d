"""The body limits both HTTP adapters apply while a request arrives (413 past --max-body, 408 past
--body-timeout), and the HTTP/1.1 adapter using them through the narrow interface it has of the edge."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from edgepath.edge.adapters.tcp import EdgeHttp11Protocol
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.body import BodyLimits
from edgepath.edge.connections import ConnectionLimits
from edgepath.edge.http import Headers, HttpError, Limits, Request, Response
from edgepath.edge.routes import HttpCore
from edgepath.edge.service import Ticket


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
