"""Slow and hostile clients hold nothing: bodies that never complete get 408 within ``--body-timeout``
while other clients are served, many quiet streams hold no frame or slot, and a client that leaves
mid-stream stops its slot.  Over HTTP/3 and HTTP/1.1, with a real edge, agent and slot server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.edge import RunningEdge, free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.tls import default_certificate
from edgepath.edge.client import H3Response, h3_client

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child

BODY_TIMEOUT = 0.5


@pytest.fixture(scope="module", autouse=True)
def tls_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = old


@pytest.fixture(scope="module")
def quic_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port(), body_timeout=BODY_TIMEOUT),
        sizing=Sizing(slots=4),
        agent=AgentSettings(frames=8),
        handler=HandlerSettings("echo"),
    )
    with running_edge(options, tmp_path_factory.mktemp("quic")) as edge:
        yield edge


@pytest.fixture(scope="module")
def tcp_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(socket.SOCK_STREAM), body_timeout=BODY_TIMEOUT),
        sizing=Sizing(slots=4, input_capacity=512, output_capacity=512),
        agent=AgentSettings(frames=8),
        handler=HandlerSettings("paced-echo"),  # one token every 5 ms: a stream lasts long enough to walk away from
    )
    with running_edge(options, tmp_path_factory.mktemp("tcp")) as edge:
        yield edge


def test_quic_slow_and_many_quiet_streams_get_408_while_others_are_served(quic_edge: RunningEdge) -> None:
    async def go() -> tuple[H3Response, list[H3Response], list[H3Response], H3Response]:
        async with (
            h3_client("127.0.0.1", quic_edge.port, str(default_certificate()), server_name="localhost") as hostile,
            h3_client("127.0.0.1", quic_edge.port, str(default_certificate()), server_name="localhost") as good,
        ):
            proto = hostile.protocol
            # many streams, each with headers and half a body, then silence (more than the slots and frames)
            quiet = [
                proto.send_partial("POST", hostile.authority, "/v1/generate", b'{"prompt": "never')[1]
                for _ in range(40)
            ]
            served = [await good.generate(f"still served {i}") for i in range(10)]
            assert not any(f.done() for f in quiet), "the quiet streams are answered at their body deadline, not before"
            refused = await asyncio.wait_for(asyncio.gather(*quiet), 30)
            after = await good.generate("after the quiet ones")
            health = await good.request("GET", "/health")
            assert health.json()["free_slots"] == health.json()["total_slots"] == 4
            return after, served, refused, health

    after, served, refused, _ = asyncio.run(asyncio.wait_for(go(), 60))
    assert all(r.status == 200 for r in served) and after.status == 200
    assert [r.status for r in refused] == [408] * 40
    assert refused[0].json()["error"]["type"] == "body_timeout"


def http11(port: int, raw: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(raw)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = bytearray()
    while chunk := sock.recv(65536):
        out += chunk
    return bytes(out)


def get(port: int, path: str) -> tuple[int, bytes]:
    with http11(port, f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()) as sock:
        raw = read_all(sock)
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_tcp_slow_body_gets_408_and_is_closed_while_others_are_served(tcp_edge: RunningEdge) -> None:
    port = tcp_edge.port
    slow = http11(port, b'POST /v1/generate HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"prompt": ')
    headers_only = http11(port, b"POST /v1/generate HTTP/1.1\r\nhost: x\r\n")  # headers never complete
    status, body = get(port, "/health")
    assert status == 200 and json.loads(body)["free_slots"] == 4  # served while the slow ones wait
    answer = read_all(slow)
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in answer  # then the server closed it
    assert read_all(headers_only).startswith(b"HTTP/1.1 408 ")
    slow.close()
    headers_only.close()


def test_tcp_client_leaving_mid_stream_abandons_and_frees_its_slot(tcp_edge: RunningEdge) -> None:
    port = tcp_edge.port
    prompt = " ".join(f"word{i}" for i in range(120))  # a few hundred tokens: over a second at 5 ms each
    body = json.dumps({"prompt": prompt, "stream": True}).encode()
    sock = http11(port, b"POST /v1/generate HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    seen = bytearray()
    while b'data: {"token"' not in seen:
        chunk = sock.recv(4096)
        assert chunk, "the stream ended before its first event"
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in seen.lower()
    sock.close()  # walk away mid-stream

    async def wait_free() -> str:
        for _ in range(3000):  # bounded: until every slot is FREE again
            status, health = get(port, "/health")
            if status == 200 and json.loads(health)["free_slots"] == 4:
                break
            await asyncio.sleep(0.01)
        return get(port, "/metrics")[1].decode()

    metrics = asyncio.run(wait_free())
    assert json.loads(get(port, "/health")[1])["free_slots"] == 4
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("edgepath_"))
    assert float(lines["edgepath_port_abandoned_total"]) == 1
    assert float(lines["edgepath_streams_reset_total"]) == 1
    assert float(lines["edgepath_port_duplicates_total"]) == 0


def test_quic_retry_validates_the_client_address_before_serving(tmp_path: Path) -> None:
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port(), quic_retry=True),
        sizing=Sizing(slots=2),
        agent=AgentSettings(frames=4),
        handler=HandlerSettings("echo"),
    )
    with running_edge(options, tmp_path) as edge:

        async def go() -> tuple[int, int]:
            async with h3_client("127.0.0.1", edge.port, str(default_certificate()), server_name="localhost") as c:
                response = await c.generate("validated")
                return response.status, c.protocol._quic._retry_count

        status, retries = asyncio.run(asyncio.wait_for(go(), 60))
    assert status == 200
    assert retries == 1  # the server answered the first Initial with a Retry, and the client came back


def _walk_away(proto: Any, stream_id: int, how: str) -> None:
    """How a QUIC client gives up on an answer that is streaming."""
    if how == "reset":  # RESET_STREAM and STOP_SENDING, as edgepath's own client does
        proto.reset(stream_id)
        return
    proto._pending.pop(stream_id, None)
    if how == "stop_sending":  # STOP_SENDING alone: it stops reading, its request was already complete
        proto._quic.stop_stream(stream_id, 0x10C)  # H3_REQUEST_CANCELLED
    else:  # the whole connection closed mid-stream
        proto._quic.close(error_code=0x100, reason_phrase="client going away")  # H3_NO_ERROR
    proto.transmit()


@pytest.mark.parametrize("how", ["reset", "stop_sending", "close"])
def test_quic_client_walking_away_mid_stream_abandons_and_frees_its_slot(tmp_path: Path, how: str) -> None:
    """Every way a QUIC client walks away from a streaming answer cancels it: RESET_STREAM with STOP_SENDING,
    STOP_SENDING alone, and a connection closed mid-stream."""
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port()),
        sizing=Sizing(slots=2, input_capacity=512, output_capacity=512),
        agent=AgentSettings(frames=4),
        handler=HandlerSettings("paced-echo"),
    )
    prompt = " ".join(f"word{i}" for i in range(120))  # a few hundred tokens, one every 5 ms

    with running_edge(options, tmp_path) as edge:

        async def go() -> tuple[dict, str]:
            cert = str(default_certificate())
            async with (
                h3_client("127.0.0.1", edge.port, cert, server_name="localhost") as c,
                h3_client("127.0.0.1", edge.port, cert, server_name="localhost") as watcher,
            ):
                proto = c.protocol
                body = json.dumps({"prompt": prompt, "stream": True}).encode()
                sid, answer = proto.start("POST", c.authority, "/v1/generate", body)
                pending = proto._pending[sid]
                for _ in range(3000):  # bounded: until the first event has arrived
                    if b'data: {"token"' in pending.body:
                        break
                    await asyncio.sleep(0.005)
                assert b'data: {"token"' in pending.body and not answer.done()
                _walk_away(proto, sid, how)
                for _ in range(3000):  # bounded: until every slot is FREE again
                    health = (await watcher.request("GET", "/health")).json()
                    if health["free_slots"] == health["total_slots"]:
                        break
                    await asyncio.sleep(0.005)
                return health, (await watcher.request("GET", "/metrics")).body.decode()

        health, metrics = asyncio.run(asyncio.wait_for(go(), 60))
    assert health["free_slots"] == health["total_slots"] == 2
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("edgepath_"))
    assert float(lines["edgepath_port_abandoned_total"]) == 1  # cancelled: not run to its end
    assert float(lines["edgepath_streams_reset_total"]) == 1
    assert 'edgepath_requests_total{route="/v1/generate",status="499"}' in metrics
