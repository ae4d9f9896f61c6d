"""``--quic-engine``: the edge's HTTP/3 adapter on qh3, driven by the (aioquic) edge test client, and the
engine selection's errors.  aioquic stays the reference engine (every other edge test runs on it)."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from edge_support import RunningEdge, free_port, running_edge

from edgepath.cli import build_parser
from edgepath.edge import quic_engine
from edgepath.edge.client import H3Client, H3Response, h3_client
from edgepath.edge.quic import protocol_class
from edgepath.edge.quic_engine import QuicEngineError, load_engine
from edgepath.edge.serve import ServeOptions
from edgepath.edge.tls import default_certificate


def _qh3_or_skip() -> None:
    try:
        load_engine("qh3")
    except QuicEngineError as exc:
        pytest.skip(f"qh3 cannot be imported here: {exc}")


@pytest.fixture(scope="module", autouse=True)
def tls_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private state directory, so the test generates (and trusts) its own self-signed certificate."""
    old = os.environ.get("XDG_STATE_HOME")
    path = tmp_path_factory.mktemp("state")
    os.environ["XDG_STATE_HOME"] = str(path)
    yield path
    if old is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = old


@pytest.fixture(scope="module")
def qh3_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    _qh3_or_skip()
    options = ServeOptions(port=free_port(), slots=8, frames=64, quic_engine="qh3", max_body=4096)
    with running_edge(options, tmp_path_factory.mktemp("edge")) as running:
        yield running


def run(coro_fn: Any, port: int) -> Any:
    async def main() -> Any:
        async with h3_client("127.0.0.1", port, cafile=str(default_certificate()), server_name="localhost") as c:
            return await coro_fn(c)

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_qh3_edge_answers_generate_stream_and_errors(qh3_edge: RunningEdge) -> None:
    async def go(c: H3Client) -> dict[str, H3Response]:
        return {
            "tokenize": await c.request("POST", "/v1/tokenize", {"prompt": "over qh3"}),
            "generate": await c.generate("over qh3"),
            "stream": await c.generate("over qh3", stream=True),
            "404": await c.request("GET", "/nope"),
            "413": await c.request("POST", "/v1/generate", body=b" " * 8192),
            "mid": await c.generate("between"),
            "after": await c.generate("still serving"),
        }

    out = run(go, qh3_edge.port)
    ids = out["tokenize"].json()["tokens"]
    assert out["generate"].status == 200
    assert out["generate"].json()["tokens"] == ids and out["generate"].json()["text"] == "over qh3"
    assert out["generate"].headers["server"] == "edgepath"
    events = [e for e in out["stream"].body.decode().split("\n\n") if e]
    assert [json.loads(e.removeprefix("data: "))["token"] for e in events[:-1]] == ids
    assert out["404"].status == 404
    assert out["413"].status == 413 and out["413"].json()["error"]["type"] == "body_too_large"
    assert out["after"].status == 200 and out["after"].json()["text"] == "still serving"


def test_qh3_edge_survives_resets_and_answers_concurrent_requests_once(qh3_edge: RunningEdge) -> None:
    async def go(c: H3Client) -> tuple[list[H3Response], H3Response]:
        sid, _ = c.protocol.start("POST", c.authority, "/v1/generate", b'{"prompt": "abandoned"}')
        c.protocol.reset(sid)
        results = await asyncio.gather(*(c.generate(f"request {i}") for i in range(48)))
        health = await c.request("GET", "/health")
        for _ in range(100):  # the abandoned request's slot comes back with its result
            if health.json()["free_slots"] == health.json()["total_slots"]:
                break
            await asyncio.sleep(0.05)
            health = await c.request("GET", "/health")
        return list(results), health

    results, health = run(go, qh3_edge.port)
    ok = [r for r in results if r.status == 200]
    assert {r.status for r in results} <= {200, 429}
    assert ok, "no request was served"
    assert all(r.json()["text"] == f"request {results.index(r)}" for r in ok)
    assert health.json()["free_slots"] == health.json()["total_slots"] == 8


def test_protocol_class_is_one_per_engine_and_recognises_that_engines_events() -> None:
    _qh3_or_skip()
    aio, qh3 = load_engine("aioquic"), load_engine("qh3")
    assert protocol_class(aio) is protocol_class(aio)
    assert issubclass(protocol_class(qh3), qh3.QuicConnectionProtocol)
    assert not issubclass(protocol_class(qh3), aio.QuicConnectionProtocol)
    assert qh3.HeadersReceived is not aio.HeadersReceived  # why the adapter takes names from its engine


def test_unknown_engine_is_refused_naming_the_choices() -> None:
    with pytest.raises(QuicEngineError, match=r"unknown QUIC engine 'quiche': choose from aioquic, qh3"):
        load_engine("quiche")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quic-engine", "quiche"])
    assert build_parser().parse_args(["serve"]).quic_engine == "aioquic"


def test_missing_engine_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_qh3(name: str, package: str | None = None) -> Any:
        if name.split(".")[0] == "qh3":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, package)

    load_engine.cache_clear()
    monkeypatch.setattr(quic_engine.importlib, "import_module", no_qh3)
    try:
        with pytest.raises(QuicEngineError, match=r"edgepath\[qh3\]"):
            load_engine("qh3")
    finally:
        load_engine.cache_clear()
