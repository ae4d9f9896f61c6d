"""Quotas across edges on real ``edgepath serve`` processes: the workers of ``serve --workers 2`` count in one
ledger (a tenant gets its quota once, not once per worker), and two serve processes on one slot server -- one
keeping the ledger (``--quota-listen``), the other counting in it (``--quota-home``) -- hold a greedy tenant to its
quota over two minutes of real time while a modest tenant under its quota is never refused for it."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.supervised import start_serve_tcp
from test_cli_errors import edgepath_fails
from test_serve_tenants import no_flat_keys  # noqa: F401  (autouse: no flat key list from the environment)

from edgepath.children import Child, free_port
from edgepath.contract import wire
from edgepath.edge.tenancy.quota import MINUTE_NS

pytestmark = pytest.mark.slow  # multi-process: serve processes, their workers and slot server


def tenants_file(path: Path, *entries: tuple[str, str, str]) -> str:
    """A tenants file of (name, key, limits) entries."""
    path.write_text(
        "".join(
            f'[tenants.{name}]\nkeys = ["sha256:{hashlib.sha256(key.encode()).hexdigest()}"]\n{limits}\n'
            for name, key, limits in entries
        )
    )
    return str(path)


def generate(port: int, key: str) -> tuple[int, dict, dict[str, str]]:
    """One request reserving 10 tokens (5 prompt ids, 5 to echo), on a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"tokens": [1, 2, 3, 4, 5], "max_tokens": 5})
        conn.request("POST", "/v1/generate", body, {"x-api-key": key, "content-type": "application/json"})
        response = conn.getresponse()
        doc = json.loads(response.read())
        return response.status, doc, {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def test_the_workers_of_one_serve_count_one_quota(edgepath_process: Callable[..., Child], tmp_path: Path) -> None:
    """A tenant of 300 tokens a minute, 60 requests of 10 on new connections (spread over both workers by the
    kernel): 30 or a few more are served (what refills meanwhile), never the 60 two quotas would give."""
    path = tenants_file(tmp_path / "tenants.toml", ("acme", "key-a", "tokens_per_minute = 300"))
    _, port = start_serve_tcp(edgepath_process, "--handler", "echo", "--workers", "2", "--tenants-file", path)
    start = time.time_ns()
    answers, times = [], []
    for _ in range(60):
        answers.append(generate(port, "key-a"))
        times.append(time.time_ns())
    end = times[-1]
    served = [doc for status, doc, _ in answers if status == 200]
    assert {status for status, _, _ in answers} == {200, 429}
    assert all(doc["error"]["type"] == "quota_exceeded" for status, doc, _ in answers if status == 429)
    tokens = sum(doc["input_count"] + doc["output_count"] for doc in served)
    refilled = wire.bucket_clock(end, 300, MINUTE_NS) - wire.bucket_clock(start, 300, MINUTE_NS)
    assert 300 <= tokens <= 300 + refilled
    ids = Counter(doc["id"] for doc in served)  # each worker numbers its own requests from 1
    assert ids.most_common(1)[0][1] == 2, "only one worker answered: the test did not reach both"
    # One bucket, whichever worker answered: after each served request the bucket holds 300 less all tokens served
    # so far, plus at most what refilled since the start (a slow machine sees a token or more refill between
    # requests); a bucket per worker would show a second 290 once both had answered.
    spent = 0
    for (status, doc, headers), at in zip(answers, times, strict=True):
        if status != 200:
            continue
        spent += doc["input_count"] + doc["output_count"]
        refilled_by_then = wire.bucket_clock(at, 300, MINUTE_NS) - wire.bucket_clock(start, 300, MINUTE_NS)
        assert 300 - spent <= int(headers["x-ratelimit-remaining-tokens"]) <= 300 - spent + refilled_by_then


def test_two_serve_processes_hold_a_tenant_to_its_quota_over_two_minutes(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    """Serve A starts the slot server and keeps the ledger; serve B uses A's slot server and counts in A's ledger.
    For 120 s a greedy tenant (1,200 tokens a minute) loops on both edges from four clients (each pausing 20 ms
    after a refusal), a modest one (the same quota) sends one request of 10 tokens every 2 s, alternating edges
    (300 a minute: a quarter of its quota).  The greedy tenant is served at most its quota -- 1,200 plus what
    refilled in the run -- and nearly all of it, through both edges; the modest one is never refused."""
    path = tenants_file(
        tmp_path / "tenants.toml",
        ("greedy", "key-g", "tokens_per_minute = 1200"),
        ("modest", "key-m", "tokens_per_minute = 1200"),
    )
    slots, ledger = str(tmp_path / "slots.sock"), str(tmp_path / "ledger.sock")
    port_a, port_b = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_STREAM)
    common = ("serve", "--transport", "tcp", "--handler", "echo", "--tenants-file", path)
    edgepath_process(
        *common, "--port", str(port_a), "--slots", "8", "--slot-server-listen", slots, "--quota-listen", ledger
    )
    edgepath_process(*common, "--port", str(port_b), "--slot-server", slots, "--quota-home", ledger)
    stop = threading.Event()
    lock = threading.Lock()
    served: Counter[tuple[str, int]] = Counter()  # (tenant, port) -> tokens served
    refusals: Counter[tuple[str, str]] = Counter()  # (tenant, error type)

    def client(key: str, tenant: str, ports: tuple[int, ...], pause: float, after_refusal: float) -> None:
        i = 0
        while not stop.is_set():
            port = ports[i % len(ports)]
            i += 1
            status, doc, _ = generate(port, key)
            with lock:
                if status == 200:
                    served[tenant, port] += doc["input_count"] + doc["output_count"]
                else:
                    refusals[tenant, doc["error"]["type"]] += 1
            stop.wait(after_refusal if status != 200 else pause)

    greedy_ports = (port_a, port_b, port_a, port_b)
    threads = [threading.Thread(target=client, args=("key-g", "greedy", (p,), 0.0, 0.02)) for p in greedy_ports]
    threads.append(threading.Thread(target=client, args=("key-m", "modest", (port_a, port_b), 2.0, 2.0)))
    start = time.time_ns()
    for thread in threads:
        thread.start()
    stop.wait(120)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    end = time.time_ns()
    refilled = wire.bucket_clock(end, 1200, MINUTE_NS) - wire.bucket_clock(start, 1200, MINUTE_NS)
    greedy = served["greedy", port_a] + served["greedy", port_b]
    print(
        f"greedy served {greedy} of an allowance of {1200 + refilled} (A {served['greedy', port_a]}, "
        f"B {served['greedy', port_b]}); refusals {dict(refusals)}; modest served "
        f"{served['modest', port_a] + served['modest', port_b]}"
    )
    assert greedy <= 1200 + refilled  # overshoot 0
    assert greedy >= 0.95 * (1200 + refilled)  # and it got its quota
    assert served["greedy", port_a] > 0 and served["greedy", port_b] > 0  # through both edges
    assert refusals["greedy", "quota_exceeded"] > 0
    assert not [reason for tenant, reason in refusals if tenant == "modest"]  # never refused
    assert served["modest", port_a] > 0 and served["modest", port_b] > 0


def test_a_quota_home_where_no_ledger_answers_is_one_line_at_start(tmp_path: Path) -> None:
    line = edgepath_fails(
        ["serve", "--handler", "echo", "--transport", "tcp", "--port", str(free_port(socket.SOCK_STREAM)),
         "--quota-home", str(tmp_path / "nobody.sock")],
        tmp_path,
    )  # fmt: skip
    assert "--quota-home" in line and "nobody.sock" in line and "--quota-listen" in line
    line = edgepath_fails(["serve", "--handler", "echo", "--quota-home", "10.0.0.1:7480"], tmp_path)
    assert "--quota-home 10.0.0.1:7480" in line and "--data-path verbs" in line
