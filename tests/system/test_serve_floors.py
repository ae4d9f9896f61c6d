"""Slot floors on a real ``edgepath serve`` with two edge workers (``--workers 2``: two agents on one slot server):
a noisy tenant without a floor keeps every slot busy in a closed loop, and a quiet tenant with a floor is still
served every time -- its slot taken back from the noisy tenant, whose cut answers say why."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.supervised import complete, get, no_flat_keys, scrape, start_tenants_serve

from edgepath.children import Child, free_port

pytestmark = pytest.mark.slow  # multi-process: edgepath serve, two edge workers and the slot-server child

MODEL = "echo"
TOKENS = 40  # paced-echo answers the prompt's ids back, one every 50 ms: 2 s a request
BODY = {"model": MODEL, "prompt": list(range(1, TOKENS + 1)), "max_tokens": TOKENS}


def tenants_file(path: Path) -> None:
    def digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    path.write_text(
        f'[tenants.quiet]\nkeys = ["sha256:{digest("quiet-key")}"]\nslot_floor = 1\n'
        f'[tenants.noisy]\nkeys = ["sha256:{digest("noisy-key")}"]\n'
    )


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    no_flat_keys(monkeypatch, tmp_path)


def test_a_quiet_tenant_with_a_floor_is_served_while_a_noisy_one_fills_every_slot(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    tenants_file(path)
    serve, port = start_tenants_serve(
        edgepath_process,
        path,
        "--workers",
        "2",
        "--ops-listen",
        f"127.0.0.1:{(ops := free_port(socket.SOCK_STREAM))}",  # /health and /metrics: the operator's listener
    )
    noisy: list[tuple[int, dict]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def flood() -> None:  # a closed loop that asks again at once after a 429: every slot that frees is taken
        while not stop.is_set():
            status, doc = complete(port, "noisy-key", BODY)
            with lock:
                noisy.append((status, doc))

    clients = [threading.Thread(target=flood) for _ in range(8)]  # 8 clients on 4 slots
    for thread in clients:
        thread.start()
    deadline = time.monotonic() + 30
    while not any(status == 429 for status, _ in list(noisy)):  # the pool is full: the noisy tenant is refused
        assert time.monotonic() < deadline, "the noisy tenant never filled the slots"
        time.sleep(0.05)
    quiet = [complete(port, "quiet-key", BODY) for _ in range(6)]  # one at a time, each while the pool is full
    stop.set()
    for thread in clients:
        thread.join(timeout=60)
    for status, doc in quiet:  # never refused, and each answer whole
        assert status == 200, doc
        assert doc["choices"][0]["finish_reason"] == "length" and doc["usage"]["completion_tokens"] == TOKENS
        assert "finish_details" not in doc["choices"][0]
    cut = [doc for status, doc in noisy if status == 200 and "finish_details" in doc["choices"][0]]
    assert cut, "no noisy answer was cut: the quiet requests found free slots (the test did not test floors)"
    for doc in cut:  # a cut answer: OpenAI's "length", why in finish_details, the tokens so far, counted
        choice = doc["choices"][0]
        assert choice["finish_reason"] == "length" and choice["finish_details"]["type"] == "slot_reclaimed"
        assert "slot floor" in choice["finish_details"]["message"]
        assert doc["usage"]["completion_tokens"] < TOKENS
    assert all(status in (200, 429) for status, _ in noisy)
    metrics = scrape(ops)  # the answering worker's and the others', merged
    assert 'finish="reclaimed"' in metrics and 'tenant="noisy"' in metrics
    deadline = time.monotonic() + 30
    while True:  # every slot back to FREE
        health = get(ops, "/health")[1]
        if health["free_slots"] == health["total_slots"] == 4:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.1)
    assert serve.poll() is None  # serve still runs
