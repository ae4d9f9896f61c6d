"""Connections that cannot pile up (issue 49): a cap in total and per client address on both adapters, a deadline
from accept for a connection's first request, an idle timeout between requests -- over real sockets on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from edgepath.edge.adapters.quic import serve_quic, server_configuration
from edgepath.edge.adapters.tcp import serve_tcp
from edgepath.edge.adapters.tls import generate_self_signed
from edgepath.edge.body import BodyLimits
from edgepath.edge.body_budget import Dropping
from edgepath.edge.client import h3_client
from edgepath.edge.connections import ConnectionLimits
from edgepath.edge.http import HttpError, Request, Response
from edgepath.edge.service import Ticket


class _Intake:
    """The edge as an adapter sees it, answering every request at once with ``{}``."""

    def __init__(self, limits: ConnectionLimits, body_timeout: float = 30.0) -> None:
        self.body = BodyLimits(1 << 20, body_timeout)
        self.connections = limits
        self.handled = 0

    def head(self, request: Request, length: int | None, reply: Any) -> Dropping | None:
        return None  # every body is read

    def handle(self, request: Request, reply: Any) -> Ticket:
        self.handled += 1
        reply.respond(Response(200, [(b"content-type", b"application/json")], b"{}"))
        return Ticket(self, 0)  # type: ignore[arg-type]

    def refuse(self, request: Request, error: HttpError, reply: Any) -> None:
        body = json.dumps({"error": {"type": error.type, "message": error.message}}).encode()
        reply.respond(Response(error.status, [(b"content-type", b"application/json")], body))

    def reset_early(self) -> None:
        pass

    def client_gone(self, rid: int) -> None:
        pass  # every request was answered at once


def test_connections_are_counted_in_total_and_per_address() -> None:
    limits = ConnectionLimits(total=3, per_address=2, idle_timeout=1.0)
    assert limits.admit("a") is None and limits.admit("a") is None
    refused = limits.admit("a")
    assert refused is not None and refused.reason == "per_address" and "a holds 2 connections" in refused.message
    assert limits.admit("b") is None
    over = limits.admit("c")
    assert over is not None and over.reason == "total" and limits.open == 3
    limits.release("a")
    assert limits.admit("c") is None and limits.held("a") == 1
    assert dict(limits.refused) == {"per_address": 1, "total": 1}
    with pytest.raises(ValueError, match="holds none"):
        limits.release("z")
    assert ConnectionLimits(1, 0, 1.0).admit("x") is None  # 0: no cap per address


async def _open(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET /health/live HTTP/1.1\r\nhost: x\r\n\r\n")
    return await asyncio.wait_for(reader.readuntil(b"{}"), 10)


def test_http11_refuses_a_connection_past_the_per_address_cap_and_serves_the_others() -> None:
    async def main() -> None:
        intake = _Intake(ConnectionLimits(total=100, per_address=3, idle_timeout=30.0))
        server = await serve_tcp(intake, "127.0.0.1", 0)  # type: ignore[arg-type]
        port = server.sockets[0].getsockname()[1]
        held = [await _open(port) for _ in range(3)]
        await asyncio.sleep(0.05)
        reader, writer = await _open(port)
        answer = await asyncio.wait_for(reader.read(), 10)  # answered, then closed by the edge
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer and b"too_many_connections" in answer
        writer.close()
        other = await _open(port, source="127.0.0.2")  # another client address is still served
        assert b" 200 " in await _get(*other)
        assert b" 200 " in await _get(*held[0])  # and so are the connections already open
        assert intake.connections.held("127.0.0.1") == 3 and dict(intake.connections.refused) == {"per_address": 1}
        for _, w in [*held, other]:
            w.close()
        await asyncio.sleep(0.1)
        assert intake.connections.open == 0  # each closed connection was released
        server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_http11_a_silent_connection_is_closed_from_its_accept_and_an_idle_one_after_the_idle_timeout() -> None:
    async def main() -> None:
        intake = _Intake(ConnectionLimits(total=100, per_address=100, idle_timeout=0.3), body_timeout=0.3)
        server = await serve_tcp(intake, "127.0.0.1", 0)  # type: ignore[arg-type]
        port = server.sockets[0].getsockname()[1]
        silent_reader, silent = await _open(port)  # never sends a byte: its only timer used to start at one
        answer = await asyncio.wait_for(silent_reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 408 ") and silent_reader.at_eof()
        reader, writer = await _open(port)
        assert b" 200 " in await _get(reader, writer)  # keep-alive: the connection stays open after its answer
        assert await asyncio.wait_for(reader.read(), 10) == b""  # ... until it was idle for --idle-timeout
        for w in (silent, writer):
            w.close()
        await asyncio.sleep(0.1)
        assert intake.connections.open == 0
        server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_http3_refuses_a_connection_past_the_cap_and_closes_an_idle_one(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    generate_self_signed(cert, key)

    async def main() -> None:
        intake = _Intake(ConnectionLimits(total=100, per_address=1, idle_timeout=1.0))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = server_configuration(str(cert), str(key), idle_timeout=1.0)
        server = await serve_quic(intake, "127.0.0.1", port, config)  # type: ignore[arg-type]
        async with h3_client("127.0.0.1", port, insecure=True) as first:
            assert (await first.request("GET", "/health/live")).status == 200
            with pytest.raises((ConnectionError, asyncio.TimeoutError)):
                async with h3_client("127.0.0.1", port, insecure=True) as second:
                    await second.request("GET", "/health/live", timeout=5)
            assert intake.connections.held("127.0.0.1") == 1 and intake.connections.refused["per_address"] == 1
            await asyncio.sleep(2.5)  # silent past the idle timeout: the engine closes it, the edge releases it
            assert intake.connections.open == 0
        server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_http11_a_head_past_16_kib_is_431_in_one_read_or_many() -> None:
    """h11 bounds only what it buffers of an incomplete head: one that arrives whole in one read is bounded here."""

    async def main() -> None:
        intake = _Intake(ConnectionLimits(total=100, per_address=100, idle_timeout=30.0))
        server = await serve_tcp(intake, "127.0.0.1", 0)  # type: ignore[arg-type]
        port = server.sockets[0].getsockname()[1]
        reader, writer = await _open(port)
        writer.write(b"GET /health/live HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 431 ") and b"headers_too_large" in answer and intake.handled == 0
        writer.close()
        server.close()

    asyncio.run(asyncio.wait_for(main(), 60))
