"""Interop with non-Python HTTP/3 stacks: libcurl's (through curl_cffi) and ngtcp2's gtlsclient."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from edge_support import RunningEdge, free_port, running_edge

from edgepath.edge.quic_engine import ENGINES, QuicEngineError, load_engine
from edgepath.edge.serve import ServeOptions
from edgepath.edge.tls import default_certificate


@pytest.fixture(scope="module", params=ENGINES)
def edge(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    """The edge on each QUIC engine (aioquic, the reference, and qh3)."""
    try:
        load_engine(request.param)
    except QuicEngineError as exc:
        pytest.skip(str(exc))
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    options = ServeOptions(port=free_port(), slots=4, frames=16, quic_engine=request.param)
    try:
        with running_edge(options, tmp_path_factory.mktemp("edge")) as e:
            yield e
    finally:
        if old is None:
            del os.environ["XDG_STATE_HOME"]
        else:
            os.environ["XDG_STATE_HOME"] = old


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
