"""End to end over real QUIC (aioquic client -> edge -> agent -> slot-server child -> back), on loopback."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.edge import RunningEdge, echo_edge_on, free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.quic_engine import ENGINES
from edgepath.edge.adapters.tls import default_certificate
from edgepath.edge.client import H3Client, H3Response, h3_client

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child

INPUT_CAPACITY = 64


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


@pytest.fixture(scope="module", params=ENGINES)
def edge(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    """The edge on each QUIC engine (aioquic, the reference, and qh3)."""
    sizing = Sizing(slots=8, input_capacity=INPUT_CAPACITY, output_capacity=64)
    with echo_edge_on(request.param, tmp_path_factory.mktemp("edge"), sizing, frames=64) as running:
        yield running


def run(coro_fn: Any, port: int, *args: Any) -> Any:
    async def main() -> Any:
        async with h3_client("127.0.0.1", port, cafile=str(default_certificate()), server_name="localhost") as c:
            return await coro_fn(c, *args)

    return asyncio.run(asyncio.wait_for(main(), 120))


def assert_error(response: H3Response, status: int, type_: str) -> str:
    assert response.status == status, response.body
    doc = response.json()
    assert doc["error"]["type"] == type_
    assert response.headers["content-type"] == "application/json"
    return str(doc["error"]["message"])


async def tokens_of(client: H3Client, prompt: str) -> list[int]:
    response = await client.request("POST", "/v1/tokenize", {"prompt": prompt})
    assert response.status == 200
    doc = response.json()
    assert doc["count"] == len(doc["tokens"])
    return list(doc["tokens"])


def test_generate_echoes_the_tokenized_prompt_with_timings(edge: RunningEdge) -> None:
    async def go(c: H3Client) -> tuple[list[int], H3Response]:
        return await tokens_of(c, "Hello edge, this is a prompt"), await c.generate("Hello edge, this is a prompt")

    ids, response = run(go, edge.port)
    assert response.status == 200
    doc = response.json()
    assert doc["tokens"] == ids and doc["input_count"] == len(ids) == doc["output_count"]
    assert doc["text"] == "Hello edge, this is a prompt"
    timings = response.timings()
    assert {"queue", "parse", "tokenize", "write", "claim", "doorbell", "edge", "total"} <= set(timings)
    assert all(v >= 0 for v in timings.values())
    assert response.headers["x-queue-time"].endswith("us")
    # the measured wait for the first token (docs/ADMISSION.md): the echo handler publishes no cost model, so
    # all of its time to first token is wait
    assert timings["wait"] == pytest.approx(timings["first_token"], abs=0.001)
    assert float(response.headers["x-queue-time"][:-2]) == pytest.approx(timings["wait"] * 1000, abs=1.0)


def test_tokens_input_and_max_tokens(edge: RunningEdge) -> None:
    async def go(c: H3Client) -> H3Response:
        return await c.request("POST", "/v1/generate", {"tokens": [5, 6, 7, 8], "max_tokens": 2})

    response = run(go, edge.port)
    assert response.status == 200
    assert response.json()["tokens"] == [5, 6]


def test_stream_returns_server_sent_events(edge: RunningEdge) -> None:
    async def go(c: H3Client) -> tuple[list[int], H3Response]:
        return await tokens_of(c, "stream me"), await c.generate("stream me", stream=True)

    ids, response = run(go, edge.port)
    assert response.status == 200 and response.headers["content-type"] == "text/event-stream"
    events = [e for e in response.body.decode().split("\n\n") if e]
    assert [json.loads(e.removeprefix("data: "))["token"] for e in events[:-1]] == ids
    name, data = events[-1].split("\n")
    assert name == "event: done" and json.loads(data.removeprefix("data: "))["text"] == "stream me"


def test_bad_input_over_quic_and_server_keeps_serving(edge: RunningEdge) -> None:
    long_prompt = "word " * 200

    async def go(c: H3Client) -> dict[str, H3Response]:
        out = {
            "404": await c.request("GET", "/nope"),
            "405": await c.request("GET", "/v1/generate"),
            "json": await c.request("POST", "/v1/generate", body=b"{oops"),
            "field": await c.request("POST", "/v1/generate", {"prompt": ["a"]}),
            "max": await c.request("POST", "/v1/generate", {"prompt": "a", "max_tokens": -3}),
            "utf8": await c.request("POST", "/v1/generate", body=b'{"prompt": "\xc3\x28"}'),
            "413": await c.request("POST", "/v1/generate", body=b" " * (2 << 20)),
            "long": await c.request("POST", "/v1/generate", {"prompt": long_prompt}),
            "ok": await c.generate("still serving"),
        }
        out["count"] = await c.request("POST", "/v1/tokenize", {"prompt": long_prompt})
        return out

    r = run(go, edge.port)
    assert_error(r["404"], 404, "not_found")
    assert_error(r["405"], 405, "method_not_allowed")
    assert r["405"].headers["allow"] == "POST"
    assert_error(r["json"], 400, "invalid_json")
    assert_error(r["field"], 400, "invalid_request")
    assert_error(r["max"], 400, "invalid_max_tokens")
    assert_error(r["utf8"], 400, "invalid_utf8")
    assert_error(r["413"], 413, "body_too_large")
    count = r["count"].json()["count"]
    assert count > INPUT_CAPACITY
    message = assert_error(r["long"], 400, "prompt_too_long")
    assert f"{count} tokens" in message and f"at most {INPUT_CAPACITY}" in message
    assert r["ok"].status == 200


def test_client_resetting_streams_mid_request(edge: RunningEdge) -> None:
    async def go(c: H3Client) -> tuple[H3Response, H3Response, str]:
        proto = c.protocol
        # 1: headers and half a body, then RESET_STREAM before the request is complete.
        partial_id, _ = proto.send_partial("POST", c.authority, "/v1/generate", b'{"prompt": "half')
        proto.reset(partial_id)
        # 2: a complete request, reset right away (its generation may already be in flight).
        sid, _ = proto.start("POST", c.authority, "/v1/generate", b'{"prompt": "abandoned"}')
        proto.reset(sid)
        after = await c.generate("after the resets")
        health = await c.request("GET", "/health")
        for _ in range(1000):  # bounded: until the abandoned generation's slot is FREE again
            if health.json()["free_slots"] == health.json()["total_slots"]:
                break
            health = await c.request("GET", "/health")
        metrics = await c.request("GET", "/metrics")
        return after, health, metrics.body.decode()

    after, health, metrics = run(go, edge.port)
    assert after.status == 200 and after.json()["text"] == "after the resets"
    assert health.json()["free_slots"] == health.json()["total_slots"] == 8
    resets = [line for line in metrics.splitlines() if line.startswith("edgepath_streams_reset_total")]
    assert resets and float(resets[0].split()[-1]) >= 1


def test_concurrent_requests_each_answered_once(edge: RunningEdge) -> None:
    """Exactly once at the HTTP level: every request gets one answer, its own (the echo of its own
    prompt, a request id no other answer has), and the port saw no duplicate or unknown completion."""
    n, in_flight = 96, 32

    async def go(c: H3Client) -> tuple[list[H3Response], H3Response, list[list[int]], str]:
        prompts = [f"request number {i} says hello" for i in range(n)]
        gate = asyncio.Semaphore(in_flight)

        async def one(p: str) -> H3Response:
            async with gate:
                return await c.generate(p)

        results = await asyncio.gather(*(one(p) for p in prompts))
        expected = [await tokens_of(c, p) for p in prompts]
        metrics = (await c.request("GET", "/metrics")).body.decode()
        return list(results), await c.request("GET", "/health"), expected, metrics

    results, health, expected, metrics = run(go, edge.port)
    assert len(results) == n
    statuses = [r.status for r in results]
    assert set(statuses) <= {200, 429}
    ids = []
    for i, (r, tokens) in enumerate(zip(results, expected, strict=True)):
        if r.status == 200:
            doc = r.json()
            assert doc["tokens"] == tokens and doc["text"] == f"request number {i} says hello"
            ids.append(doc["id"])
        else:
            assert_error(r, 429, "no_slot")
            assert r.headers["retry-after"] == "1"
    assert statuses.count(200) >= 1
    assert len(set(ids)) == len(ids), "two requests got the same answer"
    counters = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("edgepath_port_"))
    assert float(counters["edgepath_port_duplicates_total"]) == 0
    assert float(counters["edgepath_port_unknown_total"]) == 0
    assert float(counters["edgepath_port_delivered_total"]) >= statuses.count(200)
    assert health.json()["free_slots"] == health.json()["total_slots"]


def test_health_latency_percentile_and_metrics(edge: RunningEdge) -> None:
    async def go(c: H3Client) -> tuple[H3Response, H3Response, H3Response]:
        for i in range(5):
            assert (await c.generate(f"warm {i}")).status == 200
        return (
            await c.request("GET", "/health?latency=99"),
            await c.request("GET", "/health?latency=50"),
            await c.request("GET", "/metrics"),
        )

    p99, p50, metrics = run(go, edge.port)
    d99, d50 = p99.json(), p50.json()
    assert d99["status"] == "ok" and d99["total_slots"] == 8
    assert d99["latency"]["samples"] >= 5 and d99["latency"]["percentile"] == 99
    assert 0 < d50["latency"]["edge_us"] <= d99["latency"]["edge_us"]
    text = metrics.body.decode()
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'edgepath_requests_total{route="/v1/generate",status="200"}' in text
    assert "edgepath_edge_latency_seconds_bucket" in text
    assert "edgepath_free_slots 8.0" in text


def test_large_prompt_is_tokenized_off_the_event_loop(edge: RunningEdge) -> None:
    big = "The quick brown fox jumps over the lazy dog. " * 20_000  # 900k characters

    async def go(c: H3Client) -> list[str]:
        order: list[str] = []

        async def tag(name: str, coro: Any) -> H3Response:
            r = await coro
            order.append(name)
            return r

        big_task = asyncio.ensure_future(
            tag("big", c.request("POST", "/v1/tokenize", body=json.dumps({"prompt": big}).encode(), timeout=60))
        )
        await asyncio.sleep(0)  # the big request goes out first
        small = await tag("small", c.generate("small one"))
        big_response = await big_task
        assert small.status == 200 and big_response.status == 200
        count = big_response.json()["count"]
        assert count > 100_000
        # The same prompt to /v1/generate is also tokenized off the loop (into a frame), then refused.
        refused = await c.request("POST", "/v1/generate", body=json.dumps({"prompt": big}).encode(), timeout=60)
        message = assert_error(refused, 400, "prompt_too_long")
        assert f"{count} tokens" in message
        return order

    assert run(go, edge.port) == ["small", "big"]


@pytest.fixture(scope="module")
def slow_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    """Two slots held 0.2 s each by the handler: a burst of requests outnumbers them."""
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port()),
        sizing=Sizing(slots=2),
        agent=AgentSettings(frames=32),
        handler=HandlerSettings("echo", (("delay", "0.2"),)),
    )
    with running_edge(options, tmp_path_factory.mktemp("slow")) as running:
        yield running


def test_more_requests_than_slots_get_429_at_once(slow_edge: RunningEdge) -> None:
    n = 12

    async def go(c: H3Client) -> tuple[list[H3Response], H3Response, list[list[int]]]:
        prompts = [f"burst {i}" for i in range(n)]
        results = await asyncio.gather(*(c.generate(p) for p in prompts))
        expected = [await tokens_of(c, p) for p in prompts]
        health = await c.request("GET", "/health")
        for _ in range(100):
            if health.json()["free_slots"] == 2:
                break
            await asyncio.sleep(0.05)
            health = await c.request("GET", "/health")
        return list(results), health, expected

    results, health, expected = run(go, slow_edge.port)
    assert len(results) == n
    ok = [i for i, r in enumerate(results) if r.status == 200]
    refused = [i for i, r in enumerate(results) if r.status == 429]
    assert len(ok) + len(refused) == n
    assert 1 <= len(ok) < n and refused
    for i in ok:
        assert results[i].json()["tokens"] == expected[i]
    for i in refused:
        assert_error(results[i], 429, "no_slot")
        assert results[i].headers["retry-after"] == "1"
        assert "server-timing" in results[i].headers
    assert health.json()["free_slots"] == health.json()["total_slots"] == 2


def test_existing_slot_server_and_its_loss(
    edgepath_process: Any, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """``serve --slot-server ADDR`` attaches to a running slot server; when it dies, requests get 503;
    when it is back, the edge re-attaches and serves again without a restart."""
    address = str(tmp_path / "slots.sock")
    slots = edgepath_process("slot-server", "--listen", address, "--slots", "3")
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port()),
        slot_servers=(address,),
        agent=AgentSettings(frames=16),
        handler=HandlerSettings("echo"),
    )
    with running_edge(options, tmp_path_factory.mktemp("attached")) as edge:

        async def before(c: H3Client) -> tuple[H3Response, H3Response]:
            return await c.generate("attached"), await c.request("GET", "/health")

        ok, health = run(before, edge.port)
        assert ok.status == 200 and ok.json()["text"] == "attached"
        assert health.json()["total_slots"] == 3

        slots.kill()
        slots.wait(timeout=10)

        async def after(c: H3Client) -> tuple[H3Response, H3Response]:
            health = await c.request("GET", "/health")
            for _ in range(100):  # the agent notices the lost connection on its next link check
                if health.status == 503:
                    break
                await asyncio.sleep(0.05)
                health = await c.request("GET", "/health")
            return health, await c.generate("nobody home")

        health, refused = run(after, edge.port)
        assert health.status == 503 and health.json()["status"] == "unavailable"
        assert_error(refused, 503, "unavailable")

        edgepath_process("slot-server", "--listen", address, "--slots", "3")  # it comes back

        async def back(c: H3Client) -> tuple[H3Response, H3Response]:
            health = await c.request("GET", "/health")
            for _ in range(100):  # re-attached on a later link check
                if health.status == 200:
                    break
                await asyncio.sleep(0.05)
                health = await c.request("GET", "/health")
            return health, await c.generate("welcome back")

        health, ok = run(back, edge.port)
        assert health.status == 200 and health.json()["free_slots"] == 3
        assert ok.status == 200 and ok.json()["text"] == "welcome back"
