"""SIGTERM is a graceful stop: a slot server says it drains (its agents claim nothing more there), finishes what
it holds -- or, past its grace period, leaves it to move to another slot server -- and exits 0; a rolling restart
of both slot servers under load fails no request.

Everything is a real process: two ``edgepath slot-server --handler paced-echo`` (so requests are in flight when
the signal comes) and one ``edgepath serve --transport tcp --slot-server A --slot-server B``, under a bounded
load that records every request's one answer."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.failover import claims, generated, listing
from helpers.supervised import Load, scrape, series
from helpers.tokenizers import byte_tokenizer
from helpers.waiting import wait_for

from edgepath.children import Child, free_port

pytestmark = pytest.mark.slow

SLOTS = 4
PATIENCE = 60.0  # seconds each step may take on a loaded 2-core machine


def _edge(tmp_path: Path, edgepath_process: Callable[..., Child], *addresses: str) -> int:
    tokenizer = str(byte_tokenizer(tmp_path / "tokenizer.json"))
    port = free_port(socket.SOCK_STREAM)
    servers = [word for address in addresses for word in ("--slot-server", address)]
    edgepath_process(
        "serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--tokenizer", tokenizer,
        "--frames", "64", *servers,
    )  # fmt: skip
    return port


def _check(load: Load, port: int) -> str:
    """Every request 200 and answered once, as the edge counts it; the edge's /metrics."""
    text = scrape(port)
    statuses = sorted({x.status for x in load.answers})
    assert statuses == [200], [x for x in load.answers if x.status != 200][:5]
    assert generated(text) == len(load.answers)
    assert series(text, "edgepath_port_duplicates_total") == 0
    assert series(text, "edgepath_port_unknown_total") == 0
    return text


def test_a_rolling_restart_of_both_slot_servers_under_load_fails_no_request(
    tmp_path: Path, edgepath_process: Callable[..., Child], new_address: Callable[[str], str]
) -> None:
    def slot_server(address: str) -> Child:
        return edgepath_process(
            "slot-server", "--listen", address, "--slots", str(SLOTS), "--handler", "paced-echo",
            "--handler-option", "token_delay=0.002",
        )  # fmt: skip

    a, b = new_address("slots-a"), new_address("slots-b")
    running = {a: slot_server(a), b: slot_server(b)}
    port = _edge(tmp_path, edgepath_process, a, b)
    took = {}
    with Load(port, threads=3, max_requests=4000, max_seconds=8 * PATIENCE) as load:
        for address in (a, b):
            wait_for(lambda at=address: claims(port, at) >= 20, PATIENCE, "requests on the slot server")
            signalled = time.monotonic()
            running[address].send_signal(signal.SIGTERM)
            assert running[address].wait(timeout=PATIENCE) == 0  # drained, then exited 0
            took[address] = round(time.monotonic() - signalled, 2)
            before = claims(port, address)
            running[address] = slot_server(address)  # the replacement, on the same address
            wait_for(lambda at=address: listing(port)[at]["state"] == "up", PATIENCE, "the replacement attached")
            wait_for(lambda at=address, n=before: claims(port, at) >= n + 20, PATIENCE, "the replacement in use")
    print(f"rolling restart: {len(load.answers)} requests; SIGTERM to exit 0 took {took} s")
    _check(load, port)


def test_a_slot_server_whose_requests_outlast_its_grace_period_hands_them_over(
    tmp_path: Path, edgepath_process: Callable[..., Child], new_address: Callable[[str], str]
) -> None:
    def slot_server(address: str) -> Child:
        # ~20 prompt tokens echoed one every 50 ms: each request runs about a second, longer than the grace period
        return edgepath_process(
            "slot-server", "--listen", address, "--slots", str(SLOTS), "--handler", "paced-echo",
            "--handler-option", "token_delay=0.05", "--grace-period", "0.3",
        )  # fmt: skip

    a, b = new_address("slots-a"), new_address("slots-b")
    first, _ = slot_server(a), slot_server(b)
    port = _edge(tmp_path, edgepath_process, a, b)
    with Load(port, threads=3, max_requests=400, max_seconds=4 * PATIENCE) as load:
        wait_for(lambda: claims(port, a) >= 3 and claims(port, b) >= 3, PATIENCE, "requests on both slot servers")
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=PATIENCE) == 0
        after = len(load.answers)
        wait_for(lambda: len(load.answers) >= after + 6, PATIENCE, "requests answered by the other slot server")
    text = _check(load, port)
    moved = series(text, "edgepath_port_migrated_total")
    print(f"grace period over: {len(load.answers)} requests, {moved:g} moved to the other slot server")
    assert moved >= 1  # what ran there at the end of the grace period went on elsewhere


def test_an_edge_on_sigterm_takes_no_new_request_finishes_those_under_way_and_exits_0(
    tmp_path: Path, edgepath_process: Callable[..., Child], new_address: Callable[[str], str]
) -> None:
    a = new_address("slots-a")
    # ~20 prompt tokens echoed one every 50 ms: each request is under way for about a second
    edgepath_process(
        "slot-server", "--listen", a, "--slots", str(SLOTS), "--handler", "paced-echo",
        "--handler-option", "token_delay=0.05",
    )  # fmt: skip
    tokenizer = str(byte_tokenizer(tmp_path / "tokenizer.json"))
    port = free_port(socket.SOCK_STREAM)
    edge = edgepath_process(
        "serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--tokenizer", tokenizer,
        "--slot-server", a, "--grace-period", "30",
    )  # fmt: skip
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # opened before the signal: it stays
    kept.request("GET", "/health/ready")
    first = kept.getresponse()
    assert first.status == 200 and first.read()
    answers: list[tuple[int, str]] = []

    def one(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/generate", body=json.dumps({"prompt": f"under way, request {i}"}))
        response = conn.getresponse()
        answers.append((response.status, json.loads(response.read()).get("text", "")))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: claims(port, a) >= 3, PATIENCE, "three requests under way")
    # each runs about a second: an inference gateway sees them running on 3 of the 4 slots, none waiting
    text = scrape(port)
    assert series(text, "vllm:num_requests_running") == 3 and series(text, "vllm:num_requests_waiting") == 0
    assert series(text, "vllm:kv_cache_usage_perc") == 3 / SLOTS
    edge.send_signal(signal.SIGTERM)

    def ready_status() -> int:
        kept.request("GET", "/health/ready")
        response = kept.getresponse()
        body = json.loads(response.read())
        return response.status if body.get("status") in ("ok", "draining") else -1

    wait_for(lambda: ready_status() == 503, PATIENCE, "/health/ready to say the edge drains")
    kept.request("POST", "/v1/generate", body=json.dumps({"prompt": "too late"}))
    late = kept.getresponse()
    assert late.status == 503 and json.loads(late.read())["error"]["type"] == "draining"
    with pytest.raises(ConnectionRefusedError):  # over TCP: no new connection either
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    for thread in threads:
        thread.join(timeout=PATIENCE)
    assert sorted(answers) == [(200, f"under way, request {i}") for i in range(3)]
    assert edge.wait(timeout=PATIENCE) == 0
