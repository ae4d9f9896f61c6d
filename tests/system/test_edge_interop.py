"""Interop with non-Python HTTP/3 stacks: libcurl's (through curl_cffi) and ngtcp2's gtlsclient."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.edge import RunningEdge, echo_edge_on, free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.quic_engine import ENGINES
from edgepath.edge.adapters.tls import default_certificate

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child


@pytest.fixture(scope="module", params=ENGINES)
def edge(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    """The edge on each QUIC engine (aioquic, the reference, and qh3)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
        with echo_edge_on(request.param, tmp_path_factory.mktemp("edge"), Sizing(slots=4), frames=16) as e:
            yield e


def test_curl_http3(edge: RunningEdge) -> None:
    from curl_cffi import CurlHttpVersion, requests

    base = f"https://localhost:{edge.port}"
    opts = {"http_version": CurlHttpVersion.V3ONLY, "verify": str(default_certificate()), "timeout": 30}
    tokens = requests.post(f"{base}/v1/tokenize", json={"prompt": "hello from libcurl"}, **opts)
    generate = requests.post(f"{base}/v1/generate", json={"prompt": "hello from libcurl"}, **opts)
    missing = requests.get(f"{base}/nope", **opts)
    bad = requests.post(f"{base}/v1/generate", data=b"{broken", **opts)
    health = requests.get(f"{base}/health?latency=99", **opts)

    assert generate.http_version == 30  # libcurl's CURL_HTTP_VERSION_3: the exchange really was HTTP/3
    assert generate.status_code == 200
    assert generate.json()["tokens"] == tokens.json()["tokens"]
    assert generate.json()["text"] == "hello from libcurl"
    assert "doorbell;dur=" in generate.headers["server-timing"]
    assert generate.headers["x-queue-time"].endswith("us")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_json"
    assert health.status_code == 200 and health.json()["latency"]["samples"] >= 1


@pytest.mark.skipif(
    shutil.which("gtlsclient") is None,
    reason="gtlsclient not installed: apt-get install ngtcp2-client (scripts/setup-system installs it)",
)
def test_ngtcp2_gtlsclient(edge: RunningEdge, tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"prompt": "hello from ngtcp2"}))
    out = tmp_path / "out"
    out.mkdir()
    url = f"https://localhost:{edge.port}/v1/generate"
    cmd = ["gtlsclient", "--exit-on-all-streams-close", "-m", "POST", f"--data={body}", f"--download={out}"]
    proc = subprocess.run(
        [*cmd, "127.0.0.1", str(edge.port), url], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = proc.stdout + proc.stderr
    assert "[:status: 200]" in log
    assert "[server-timing: queue;dur=" in log
    doc = json.loads((out / "generate").read_text())
    assert doc["text"] == "hello from ngtcp2" and doc["output_count"] == doc["input_count"] == len(doc["tokens"])


@pytest.fixture(scope="module")
def paced_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    """A paced echo (one token every 5 ms) and a small body limit."""
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port(), max_body=4096),
        sizing=Sizing(slots=4),
        agent=AgentSettings(frames=16),
        handler=HandlerSettings("paced-echo"),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
        with running_edge(options, tmp_path_factory.mktemp("paced")) as e:
            yield e


def test_curl_http3_reads_the_413_sent_before_the_body_is_complete(paced_edge: RunningEdge) -> None:
    """RFC 9114 §4.1: the complete 413, then STOP_SENDING with H3_NO_ERROR -- libcurl reports the
    response, not "stream reset by server (REQUEST_CANCELLED)"."""
    from curl_cffi import CurlHttpVersion, requests

    opts = {"http_version": CurlHttpVersion.V3ONLY, "verify": str(default_certificate()), "timeout": 30}
    base = f"https://localhost:{paced_edge.port}"
    big = json.dumps({"prompt": "x" * 200_000}).encode()  # far past --max-body 4096, more than one flow window
    refused = requests.post(f"{base}/v1/generate", data=big, **opts)
    assert refused.http_version == 30
    assert refused.status_code == 413 and refused.json()["error"]["type"] == "body_too_large"
    after = requests.post(f"{base}/v1/generate", json={"prompt": "after"}, **opts)
    assert after.status_code == 200 and after.json()["text"] == "after"


def test_curl_http3_streams_events_as_the_tokens_are_produced(paced_edge: RunningEdge) -> None:
    from curl_cffi import CurlHttpVersion, requests

    opts = {"http_version": CurlHttpVersion.V3ONLY, "verify": str(default_certificate()), "timeout": 30}
    prompt = " ".join(f"word{i}" for i in range(40))  # ~80 tokens, 5 ms apart: a stream of several reads
    chunks: list[bytes] = []
    with requests.Session() as session:
        response = session.post(
            f"https://localhost:{paced_edge.port}/v1/generate",
            json={"prompt": prompt, "stream": True},
            stream=True,
            **opts,
        )
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
        # the return path of the first token (model side produced it -> its event handed to QUIC)
        timing = dict(part.split(";dur=") for part in response.headers["server-timing"].split(", "))
        assert 0 < float(timing["return"]) < 1000
        for chunk in response.iter_content():
            chunks.append(chunk)
        response.close()
    data = b"".join(chunks)
    tokens = [json.loads(line[6:])["token"] for line in data.split(b"\n") if line.startswith(b'data: {"token"')]
    done = json.loads(data.split(b"event: done\ndata: ", 1)[1])
    assert done["text"] == prompt and done["output_count"] == len(tokens) > 4
    assert done["first_token_ms"] > 0
    # the tokens came over time (paced), so libcurl read them in several pieces, the first before the end
    assert len(chunks) > 1 and b"event: done" not in chunks[0]


@pytest.fixture(scope="module", params=["quic", "tcp"])
def budgeted_edge(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    """An echo edge whose tenant may have 4,096 bytes of bodies read (its --max-body), refilling at 100 a second."""
    options = ServeOptions(
        edge=EdgeSettings(
            transport=request.param,
            port_asked=free_port(kind=socket.SOCK_STREAM if request.param == "tcp" else socket.SOCK_DGRAM),
            max_body=4096,
            body_rate=100,
        ),
        sizing=Sizing(slots=4),
        agent=AgentSettings(frames=16),
        handler=HandlerSettings("echo"),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
        with running_edge(options, tmp_path_factory.mktemp("budgeted")) as e:
            yield e


def test_curl_reads_a_refusal_sent_from_the_head_and_goes_on_on_the_same_connection(budgeted_edge: RunningEdge) -> None:
    """A body past its tenant's budget is refused from its head -- never parsed: a broken body gets 429 body_rate,
    not the 400 reading it would give -- and libcurl reads the answer (HTTP/3: STOP_SENDING with H3_NO_ERROR after
    it; HTTP/1.1: the body dropped as it arrives), then sends its next request on the same connection."""
    from curl_cffi import CurlHttpVersion, requests

    quic = budgeted_edge.options.edge.transport == "quic"
    version = CurlHttpVersion.V3ONLY if quic else CurlHttpVersion.V1_1
    base = f"{'https' if quic else 'http'}://localhost:{budgeted_edge.port}"
    opts = {"http_version": version, "verify": str(default_certificate()), "timeout": 30}
    broken = b"{" + b"x" * 2999
    with requests.Session() as session:
        read = session.post(f"{base}/v1/generate", data=broken, **opts)
        assert read.status_code == 400 and read.json()["error"]["type"] == "invalid_json"  # read: 3,000 bytes spent
        refused = session.post(f"{base}/v1/generate", data=broken, **opts)
        assert refused.http_version == (30 if quic else 2)  # libcurl's CURL_HTTP_VERSION_3 or _1_1
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "body_rate"
        assert int(refused.headers["retry-after-ms"]) > 1000
        after = session.post(f"{base}/v1/generate", json={"prompt": "after"}, **opts)  # fits what is left
        assert after.status_code == 200 and after.json()["text"] == "after"
    # HTTP/1.1 kept its one connection (keep-alive) through the refusal; HTTP/3 its one QUIC connection
    assert read.headers.get("connection") != "close" and refused.headers.get("connection") != "close"
