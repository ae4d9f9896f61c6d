"""Who may read an edge's operator pages, on a real ``edgepath serve`` (docs/API.md, "The ops listener"): with keys,
``/metrics`` (tenants and their usage) and ``/health`` (slot servers, their addresses and load) need one on the
clients' listener; with ``--ops-listen`` they are served only there, without a key, and nothing else is; the probes
answer a kubelet everywhere; flat keys are labelled by their place in the list, never by a digest; and ``serve`` on
an address other than loopback with no key at all refuses to start unless ``--allow-anonymous``."""

from __future__ import annotations

import hashlib
import http.client
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.supervised import start_serve_tcp
from test_cli_errors import edgepath_fails

from edgepath.children import Child, free_port

pytestmark = pytest.mark.slow  # multi-process: serve with its slot-server child

KEYS = ("alpha-key-1", "beta-key-2")


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("EDGEPATH_API_KEYS", raising=False)


def get(port: int, path: str, key: str | None = None, method: str = "GET", body: str | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path, body, {"x-api-key": key} if key else {})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_the_ops_listener_serves_the_operator_pages_and_the_clients_listener_only_the_probes(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    ops = free_port(socket.SOCK_STREAM)
    _, port = start_serve_tcp(
        edgepath_process, "--handler", "echo", "--api-keys-file", str(keys), "--ops-listen", f"127.0.0.1:{ops}"
    )
    body = '{"tokens": [1, 2, 3], "max_tokens": 3}'
    assert get(port, "/v1/generate", KEYS[1], "POST", body)[0] == 200  # a request of the second key, counted
    for path in ("/health", "/metrics"):
        status, text = get(port, path, KEYS[0])  # even with a key: not on the clients' listener
        assert status == 404 and f"127.0.0.1:{ops}" in text
        assert get(ops, path)[0] == 200  # on the ops listener, without a key
    for path in ("/health/live", "/health/ready"):
        assert get(port, path)[0] == get(ops, path)[0] == 200  # probes: a kubelet sends no key
    assert get(ops, "/v1/generate", KEYS[0], "POST", body)[0] == 404  # nothing else on the ops listener
    assert get(ops, "/v1/models", KEYS[0])[0] == 404
    metrics = get(ops, "/metrics")[1]
    assert 'tenant="key-2"' in metrics  # the second key of the list, by its place
    for key in KEYS:  # no part of a key's unsalted digest: nothing to check a guessed key against offline
        assert hashlib.sha256(key.encode()).hexdigest()[:8] not in metrics


def test_with_keys_and_no_ops_listener_health_and_metrics_need_a_key(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEYS[0] + "\n")
    _, port = start_serve_tcp(edgepath_process, "--handler", "echo", "--api-keys-file", str(keys))
    for path in ("/health", "/metrics"):
        assert get(port, path)[0] == 401
        assert get(port, path, KEYS[0])[0] == 200
    assert get(port, "/health/ready")[0] == 200


def test_serve_without_keys_on_an_address_other_than_loopback_refuses_to_start_unless_told(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    port = free_port(socket.SOCK_STREAM)
    line = edgepath_fails(
        ["serve", "--handler", "echo", "--transport", "tcp", "--host", "0.0.0.0", "--port", str(port)], tmp_path
    )
    assert "--host 0.0.0.0" in line and "no API keys" in line and "--allow-anonymous" in line
    _, port = start_serve_tcp(edgepath_process, "--handler", "echo", "--host", "0.0.0.0", "--allow-anonymous")
    assert get(port, "/health")[0] == 200  # told: served, to anyone (and its pages with it)
