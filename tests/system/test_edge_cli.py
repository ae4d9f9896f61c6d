"""``edgepath serve`` as a user runs it (a subprocess), driven by ``edgepath request`` and an HTTP/1.1 client."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from edgepath.children import Child, free_port

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child


@pytest.fixture(autouse=True)
def private_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def edgepath(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgepath", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_serve_quic_and_request_cli(edgepath_process: Callable[..., Child], private_state: Path) -> None:
    port = str(free_port())
    server = edgepath_process(
        "serve", "--transport", "quic", "--port", port, "--slots", "4", "--handler", "echo", timeout=60
    )
    assert (private_state / "edgepath" / "edge-cert.pem").is_file()  # self-signed, generated on first start

    done = edgepath("request", "--port", port, "Hello from the command line")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("HTTP/3 200")
    assert '"text": "Hello from the command line"' in done.stdout
    assert "server timing (ms): queue" in done.stdout and "doorbell" in done.stdout

    tokens = edgepath("request", "--port", port, "--tokenize", "Hello")
    assert tokens.returncode == 0 and '"count": 2' in tokens.stdout

    assert server.stop(timeout=30) == 0  # SIGTERM: a clean stop


def test_request_to_nothing_is_a_clear_error() -> None:
    done = edgepath("request", "--port", str(free_port()), "--timeout", "3", "anyone there?")
    assert done.returncode == 2
    assert "cannot reach" in done.stderr


def test_serve_tcp_http11(edgepath_process: Callable[..., Child]) -> None:
    port = free_port(socket.SOCK_STREAM)
    edgepath_process(
        "serve", "--transport", "tcp", "--port", str(port), "--slots", "4", "--handler", "echo", timeout=60
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/tokenize", body=json.dumps({"prompt": "over TCP"}))
    ids = json.loads(conn.getresponse().read())["tokens"]
    conn.request("POST", "/v1/generate", body=json.dumps({"prompt": "over TCP"}))  # same connection: keep-alive
    response = conn.getresponse()
    doc = json.loads(response.read())
    assert response.status == 200 and response.reason == "OK"
    assert doc["tokens"] == ids and doc["text"] == "over TCP"
    assert "doorbell;dur=" in response.getheader("server-timing", "")
    conn.request("GET", "/v1/generate")
    response = conn.getresponse()
    assert response.status == 405 and json.loads(response.read())["error"]["type"] == "method_not_allowed"
    conn.request("POST", "/v1/generate", body=json.dumps({"prompt": "streamed", "stream": True}))
    response = conn.getresponse()
    events = response.read().decode()
    assert response.status == 200 and events.endswith("\n\n") and "event: done" in events
    conn.close()

    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = raw.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "bad_http"

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["total_slots"] == 4


def test_serve_on_a_busy_port_is_a_clear_error() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", 0))
        done = edgepath("serve", "--port", str(busy.getsockname()[1]), "--slots", "2", "--handler", "echo")
    assert done.returncode == 2
    assert "cannot listen on 127.0.0.1" in done.stderr and "Address already in use" in done.stderr
