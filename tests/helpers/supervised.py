"""A supervised ``edgepath serve`` seen from outside: starting one over HTTP/1.1, its slot-server child, its
/health and /metrics, bounded waits, and a load whose every request is recorded with its one answer
(tests/system/test_supervision.py, test_hang.py, test_failover.py, tests/model/test_model_serve.py)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgepath.children import Child, free_port


def slot_server_of(serve: Child) -> int | None:
    """The pid of the live ``edgepath slot-server`` child of ``serve`` (from /proc), if there is one."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == serve.pid and state != "Z" and b"slot-server" in cmdline:
            return int(entry.name)
    return None


@dataclass
class Answer:
    sent: float
    answered: float
    status: int  # 0: no answer at all (connection refused, reset or timed out); -1: a 200 with the wrong text
    detail: str

    @property
    def seconds(self) -> float:
        return self.answered - self.sent


@dataclass
class Load:
    """Sequential requests from a few threads, each recorded with its one answer."""

    port: int
    threads: int = 2
    max_requests: int = 3000  # per thread: bounded in count ...
    max_seconds: float = 90.0  # ... and in time
    #: seconds a thread waits after an answer that is not a 200, as a refused client does: refusals come back in
    #: well under a millisecond, and without it a few seconds of them spent the whole count (seen in test_hang: 6,000
    #: 503s while the slot server was replaced, none left to see it come back)
    backoff: float = 0.005
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _one(self, prompt: str) -> Answer:
        sent = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            conn.request("POST", "/v1/generate", body=json.dumps({"prompt": prompt}))
            response = conn.getresponse()
            body = response.read()
            ok = response.status != 200 or json.loads(body)["text"] == prompt
            return Answer(sent, time.monotonic(), response.status if ok else -1, body[:200].decode(errors="replace"))
        except (OSError, http.client.HTTPException) as exc:
            return Answer(sent, time.monotonic(), 0, repr(exc))
        finally:
            conn.close()

    def _run(self, worker: int) -> None:
        deadline = time.monotonic() + self.max_seconds
        for i in range(self.max_requests):
            if self.stop.is_set() or time.monotonic() > deadline:
                return
            answer = self._one(f"worker {worker} request {i}")
            with self.lock:
                self.answers.append(answer)
            if answer.status != 200:
                self.stop.wait(self.backoff)

    def sent_after(self, t: float) -> list[Answer]:
        with self.lock:
            return [a for a in self.answers if a.sent > t]

    def oks_after(self, t: float) -> list[Answer]:
        return [a for a in self.sent_after(t) if a.status == 200]

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.answers)

    def __enter__(self) -> Load:
        self._workers = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(self.threads)]
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for w in self._workers:
            w.join(timeout=30)


def start_serve_tcp(start: Callable[..., Child], *args: str, timeout: float = 30.0) -> tuple[Child, int]:
    """``edgepath serve --transport tcp`` on a free port with 4 slots and ``args``, started with ``start`` (the
    ``edgepath_process`` fixture); the process and its port."""
    port = free_port(socket.SOCK_STREAM)
    serve = start("serve", "--transport", "tcp", "--port", str(port), "--slots", "4", *args, timeout=timeout)
    return serve, port


def complete(port: int, key: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` to the edge's ``/v1/completions`` at ``port`` with API key ``key``, over a new connection (so that
    either of ``serve --workers`` takes it): the status and the JSON document."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {key}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def no_flat_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A serve started now reads no flat key list (``$EDGEPATH_API_KEYS``) and keeps its state under ``tmp_path``:
    the tenants file a test writes is the only source of keys."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("EDGEPATH_API_KEYS", raising=False)


def start_tenants_serve(start: Callable[..., Child], tenants: Path, *args: str) -> tuple[Child, int]:
    """``serve`` over HTTP/1.1 with 4 slots of paced-echo (a token every 50 ms, served as model "echo") and the
    tenants file ``tenants`` (:func:`start_serve_tcp`)."""
    return start_serve_tcp(
        start,
        "--handler",
        "paced-echo",
        "--handler-option",
        "token_delay=0.05",
        "--served-model-name",
        "echo",
        "--tenants-file",
        str(tenants),
        *args,
        timeout=60,
    )


def get(port: int, path: str, key: str | None = None) -> tuple[int, dict]:
    """GET ``path`` of the edge at ``port``: the status and the JSON document (``key``: with API keys configured,
    the ops pages -- ``/health`` -- need one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", path, headers={"x-api-key": key} if key else {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def scrape(port: int, key: str | None = None) -> str:
    """The edge's ``/metrics`` exposition (``key``: with API keys configured, ``/metrics`` needs one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", "/metrics", headers={"x-api-key": key} if key else {})
        response = conn.getresponse()
        assert response.status == 200, response.status
        return response.read().decode()
    finally:
        conn.close()


def series(text: str, name: str, **labels: str) -> float | None:
    """The value of series ``name{labels}`` in a Prometheus exposition (None when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        name_labels, _, value = line.rpartition(" ")
        base, _, rest = name_labels.partition("{")
        if base == name and ",".join(sorted(rest.rstrip("}").split(","))) == want:
            return float(value)
    return None


def metric(port: int, name: str) -> float:
    """One sample of the edge's /metrics, ``name`` with its labels as exposed (0 when not counted yet)."""
    for line in scrape(port).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
