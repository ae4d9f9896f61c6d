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


@pytest.fixture
def smollm2_gguf() -> str:
    """The default model's GGUF (its vocabulary and chat template for the edge), or the test is skipped."""
    pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
    from edgepath.model.gguf import ModelFileError, default_model_path

    try:
        return str(default_model_path())
    except ModelFileError as exc:
        pytest.skip(str(exc))


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
    status, text, counts = done.stdout.splitlines()[:3]
    assert (status, text) == ("HTTP/3 200", "Hello from the command line")  # the text, not the ids
    assert counts.startswith("tokens: ") and counts.endswith(" out")
    assert "server timing (ms): queue" in done.stdout and "doorbell" in done.stdout

    tokens = edgepath("request", "--port", port, "--tokenize", "Hello")
    assert tokens.returncode == 0
    count, ids = tokens.stdout.splitlines()[1].split(" tokens: ")
    assert int(count) == 2 == len(ids.split())

    with_ids = edgepath("request", "--port", port, "--ids", "Hello")
    assert with_ids.returncode == 0, with_ids.stderr
    assert with_ids.stdout.splitlines()[2] == f"tokens: 2 in (0 of them cached), 2 out: {ids}"  # echo: the same ids

    streamed = edgepath("request", "--port", port, "--stream", "Hello")
    assert streamed.returncode == 0 and streamed.stdout.startswith("HTTP/3 200\n")
    assert [json.loads(line[6:])["token"] for line in streamed.stdout.splitlines() if line.startswith('data: {"token')]
    assert "event: done" in streamed.stdout

    too_long = edgepath("request", "--port", port, "--max-tokens", "999999", "Hello")
    assert too_long.returncode == 1 and too_long.stdout.startswith("HTTP/3 400\n'max_tokens' must be an integer in 1..")

    assert server.stop(timeout=30) == 0  # SIGTERM: a clean stop


def test_chat_streams_through_the_chat_template(
    edgepath_process: Callable[..., Child], private_state: Path, smollm2_gguf: str
) -> None:
    """``edgepath chat`` sends one user message to the OpenAI chat route over HTTP/3 and prints the answer's text
    as it streams: with the echo handler the answer is the prompt the chat template made of it (the model's own
    template, read from the GGUF), so the user's words and the system message come back as text."""
    port = str(free_port())
    edgepath_process(
        "serve", "--port", port, "--slots", "2", "--handler", "echo", "--tokenizer", smollm2_gguf, timeout=60
    )
    done = edgepath("chat", "--port", port, "--system", "Be brief.", "--usage", "Hello from the chat command")
    assert done.returncode == 0, done.stderr
    assert "Hello from the chat command" in done.stdout and "Be brief." in done.stdout
    assert "user" in done.stdout and "system" in done.stdout  # the template's turns, rendered at the edge
    assert "tokens: " in done.stderr and "server timing (ms)" in done.stderr

    cut = edgepath("chat", "--port", port, "--max-tokens", "3", "Hello from the chat command")
    assert cut.returncode == 0 and "cut at --max-tokens 3" in cut.stderr

    wrong = edgepath("chat", "--port", port, "--model", "no-such-model", "Hello")
    assert wrong.returncode == 1
    assert "HTTP/3 404" in wrong.stderr and "no-such-model" in wrong.stderr


def test_chat_asks_again_after_a_429_as_the_openai_sdk_does(
    edgepath_process: Callable[..., Child], private_state: Path, smollm2_gguf: str
) -> None:
    """With the one slot held by a streaming chat, a chat with ``--retries 0`` gets the 429 (edgepath has no
    queue) and exits 1; one with retries waits the server's retry advice, asks again and is answered once the
    slot is free."""
    port = str(free_port())
    edgepath_process(
        "serve", "--port", port, "--slots", "1", "--handler", "paced-echo",
        "--handler-option", "token_delay=0.3", "--tokenizer", smollm2_gguf, timeout=60,
    )  # fmt: skip
    holder = subprocess.Popen(
        [sys.executable, "-m", "edgepath", "chat", "--port", port, "--max-tokens", "30", "Hold the one slot."],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.read(1)  # its answer streams: the slot is held
        refused = edgepath("chat", "--port", port, "--retries", "0", "Anyone free?")
        assert refused.returncode == 1 and "HTTP/3 429" in refused.stderr, refused.stderr
        assert "asking again" not in refused.stderr
        answered = edgepath("chat", "--port", port, "--retries", "20", "--timeout", "55", "Anyone free?")
        assert answered.returncode == 0, answered.stderr
        assert "Anyone free?" in answered.stdout  # echo: the prompt the template made of it
        assert "HTTP/3 429" in answered.stderr and "asking again in" in answered.stderr  # it was refused first
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
        holder.wait()


def test_request_to_nothing_is_a_clear_error() -> None:
    done = edgepath("request", "--port", str(free_port()), "--timeout", "3", "anyone there?")
    assert done.returncode == 2
    assert "cannot reach" in done.stderr
    chat = edgepath("chat", "--port", str(free_port()), "--timeout", "3", "anyone there?")
    assert chat.returncode == 2 and chat.stderr.startswith("edgepath chat: cannot reach")


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
