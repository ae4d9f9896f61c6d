"""The tenants file on a real ``edgepath serve``: a bad file is one error line and exit 2 before anything starts;
SIGHUP reloads it without dropping a stream in flight; a file made bad meanwhile keeps the tenants in use."""

from __future__ import annotations

import hashlib
import http.client
import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.supervised import scrape, start_serve_tcp
from test_cli_errors import edgepath_fails

from edgepath.children import Child

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child


def tenants(*entries: tuple[str, str]) -> str:
    """A tenants file of (name, key) entries."""
    return "".join(
        f'[tenants.{name}]\nkeys = ["sha256:{hashlib.sha256(key.encode()).hexdigest()}"]\n' for name, key in entries
    )


def generate(port: int, key: str, max_tokens: int = 4, stream: bool = False) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        ids = list(range(1, max_tokens + 1))  # echoed: max_tokens tokens come back
        body = json.dumps({"tokens": ids, "max_tokens": max_tokens, "stream": stream})
        conn.request("POST", "/v1/generate", body, {"x-api-key": key, "content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture(autouse=True)
def no_flat_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("EDGEPATH_API_KEYS", raising=False)


def test_a_bad_tenants_file_is_one_line_naming_the_file_and_the_entry_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(tenants(("acme", "k")) + "slot_cap = -2\n")
    line = edgepath_fails(["serve", "--handler", "echo", "--tenants-file", str(path)], tmp_path)
    for needle in (f"tenants file {path}", "tenant 'acme'", "'slot_cap'", "0.."):
        assert needle in line, (needle, line)


def test_sighup_reloads_the_tenants_without_dropping_a_stream_and_a_bad_file_keeps_them(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(tenants(("acme", "key-a")))
    serve, port = start_serve_tcp(
        edgepath_process,
        "--handler",
        "paced-echo",
        "--handler-option",
        "token_delay=0.05",
        "--tenants-file",
        str(path),
    )
    assert generate(port, "key-a")[0] == 200
    assert generate(port, "key-b")[0] == 401
    # A stream of 40 tokens (about 2 s) is in flight while the file changes and SIGHUP arrives.
    streamed: list[tuple[int, bytes]] = []
    worker = threading.Thread(target=lambda: streamed.append(generate(port, "key-a", 40, stream=True)))
    worker.start()
    deadline = time.monotonic() + 20
    while _free_slots(port) == _free_slots(port, total=True):  # wait until the stream holds its slot
        assert time.monotonic() < deadline and worker.is_alive(), "the stream never took a slot"
        time.sleep(0.05)
    path.write_text(tenants(("beta", "key-b")))
    serve.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while generate(port, "key-b")[0] != 200:
        assert time.monotonic() < deadline, "key-b was not admitted after SIGHUP"
        time.sleep(0.1)
    assert generate(port, "key-a")[0] == 401  # its tenant left the file
    worker.join(timeout=30)
    status, body = streamed[0]
    assert status == 200 and body.count(b'data: {"token"') == 40 and b"event: done" in body  # not dropped
    # A file made bad: one error line, and the tenants in use are kept.
    path.write_text("[tenants.beta]\nkeys = 3\n")
    serve.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "SIGHUP: tenants file" not in serve.stderr_tail():
        assert time.monotonic() < deadline, serve.stderr_tail()
        time.sleep(0.1)
    assert "keeping the tenants in use" in serve.stderr_tail()
    assert generate(port, "key-b")[0] == 200


def _free_slots(port: int, total: bool = False, key: str = "key-a") -> int:
    """``/health``'s free (or total) slots (with keys configured, ``/health`` needs one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health", headers={"x-api-key": key})
        health = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    return int(health["total_slots" if total else "free_slots"])


def complete(port: int, key: str, prompt: str, max_tokens: int) -> tuple[int, dict, dict[str, str]]:
    """One OpenAI completion: status, document, headers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
        conn.request("POST", "/v1/completions", body, {"authorization": f"Bearer {key}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


MODEL = "echo"


def test_usage_log_lines_sum_to_the_answers_usage_and_quota_headers_come_with_every_answer(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    path, log = tmp_path / "tenants.toml", tmp_path / "usage.jsonl"
    path.write_text(tenants(("acme", "key-a"), ("beta", "key-b")) + "tokens_per_minute = 200\n")
    _, port = start_serve_tcp(
        edgepath_process,
        "--handler",
        "echo",
        "--served-model-name",
        MODEL,
        "--tenants-file",
        str(path),
        "--usage-log",
        str(log),
    )
    answered: dict[str, list[dict]] = {"acme": [], "beta": []}
    for i in range(6):
        key, tenant = ("key-a", "acme") if i % 2 else ("key-b", "beta")
        status, doc, headers = complete(port, key, f"request number {i} of the usage test", 8)
        if tenant == "beta":
            assert headers["x-ratelimit-limit-tokens"] == "200"
            assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) < 200
            assert headers["x-ratelimit-reset-tokens"].endswith("s")
        else:
            assert "x-ratelimit-limit-tokens" not in headers  # no quota
        if status == 200:
            answered[tenant].append(doc["usage"])
    status, doc, headers = complete(port, "key-b", "a long one", 190)  # its reservation cannot fit what is left
    assert status == 429 and doc["error"]["code"] == "quota_exceeded" and int(headers["retry-after-ms"]) > 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == sum(len(v) for v in answered.values())  # one line per request that ran, refused ones none
    for tenant, usages in answered.items():
        mine = [line for line in lines if line["tenant"] == tenant]
        for field, usage_field in (("prompt_tokens", "prompt_tokens"), ("completion_tokens", "completion_tokens")):
            assert sum(line[field] for line in mine) == sum(u[usage_field] for u in usages) > 0
    assert {line["finish"] for line in lines} <= {"stop", "length"}
    assert {line["model"] for line in lines} == {MODEL}  # what each answer's "model" says


def test_usage_log_after_a_sigkill_mid_load_has_one_line_per_answered_request_and_none_twice(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    """Eight clients loop on completions; the serve process is killed (SIGKILL, no clean-up) mid-load.  Every
    request that got its answer has exactly one line, with the answer's usage; no line is written twice; lines of
    requests the kill cut off (ended, line written, answer not yet sent) are at most the requests in flight.  A line
    names the answer's ``id`` (``answer_id``)."""
    log = tmp_path / "usage.jsonl"
    serve, port = start_serve_tcp(
        edgepath_process,
        "--handler",
        "paced-echo",
        "--handler-option",
        "token_delay=0.01",
        "--served-model-name",
        MODEL,
        "--usage-log",
        str(log),
    )
    answered: dict[str, dict] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                status, doc, _ = complete(port, "", f"client {n} request {i}", 6)
            except (OSError, http.client.HTTPException, json.JSONDecodeError):
                return  # the server is gone
            if status == 200:
                with lock:
                    answered[doc["id"]] = doc["usage"]

    clients = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for thread in clients:
        thread.start()
    deadline = time.monotonic() + 30
    while len(answered) < 40:  # well into the load
        assert time.monotonic() < deadline and any(t.is_alive() for t in clients), "no load got through"
        time.sleep(0.05)
    serve.kill()
    serve.wait(timeout=20)
    stop.set()
    for thread in clients:
        thread.join(timeout=30)
    lines = [json.loads(line) for line in log.read_text().splitlines()]  # every line whole JSON
    ids = [line["request_id"] for line in lines]
    assert len(ids) == len(set(ids))  # none twice
    by_answer = {line["answer_id"]: line for line in lines}
    for answer_id, usage in answered.items():  # none lost: every answer has its line, with its usage
        assert by_answer[answer_id]["prompt_tokens"] == usage["prompt_tokens"]
        assert by_answer[answer_id]["completion_tokens"] == usage["completion_tokens"]
    assert len(lines) - len(answered) <= len(clients)  # cut off between its line and its answer


def test_sighup_reopens_the_usage_log_for_rotation(edgepath_process: Callable[..., Child], tmp_path: Path) -> None:
    """Rotation by rename: lines written before the SIGHUP go to the renamed file, later ones to a new file at the
    path; none is lost (``--usage-fsync interval`` syncs them too)."""
    log, rotated = tmp_path / "usage.jsonl", tmp_path / "usage.jsonl.1"
    serve, port = start_serve_tcp(
        edgepath_process, "--handler", "echo", "--usage-log", str(log), "--usage-fsync", "interval"
    )
    assert generate(port, "")[0] == 200
    log.rename(rotated)
    assert generate(port, "")[0] == 200  # before the SIGHUP: into the renamed file
    serve.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "usage log" not in serve.stderr_tail() or "reopened" not in serve.stderr_tail():
        assert time.monotonic() < deadline, serve.stderr_tail()
        time.sleep(0.05)
    assert generate(port, "")[0] == 200
    assert len(rotated.read_text().splitlines()) == 2 and len(log.read_text().splitlines()) == 1
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v1/models")
    served = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    lines = [json.loads(line) for f in (rotated, log) for line in f.read_text().splitlines()]
    assert {line["model"] for line in lines} == {served}  # /v1/generate's answer names none: the served model


def test_a_non_streamed_answer_cut_mid_way_is_billed_what_was_computed_the_same_in_log_quota_and_metrics(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    """Issue 50: a non-streamed request sends the edge no progress, so a client that hung up used to be billed 0
    completion tokens however much was computed.  Now the slot server's count comes with the abandoned frame's final
    result: the usage line, the tenant's quota and ``/metrics`` all charge it."""
    path, log = tmp_path / "tenants.toml", tmp_path / "usage.jsonl"
    path.write_text(tenants(("acme", "key-a")) + "tokens_per_day = 2000\n")
    _, port = start_serve_tcp(
        edgepath_process,
        "--handler",
        "paced-echo",
        "--handler-option",
        "token_delay=0.02",
        "--tenants-file",
        str(path),
        "--usage-log",
        str(log),
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    ids = list(range(1, 201))  # echoed at 20 ms a token: 4 s for the whole answer
    body = json.dumps({"tokens": ids, "max_tokens": 200})
    conn.request("POST", "/v1/generate", body, {"x-api-key": "key-a", "content-type": "application/json"})
    time.sleep(1.5)  # well into the answer
    conn.close()  # the client hangs up: the edge cancels the slot
    deadline = time.monotonic() + 20
    while not (log.exists() and log.read_text()):
        assert time.monotonic() < deadline, "no usage line for the cancelled request"
        time.sleep(0.05)
    (line,) = [json.loads(text) for text in log.read_text().splitlines()]
    assert line["finish"] == "cancelled" and line["prompt_tokens"] == 200
    assert 0 < line["completion_tokens"] < 200  # what was computed before the cancel landed: not 0, not all
    metrics = scrape(port, "key-a")
    assert f'edgepath_tenant_tokens_total{{kind="completion",tenant="acme"}} {line["completion_tokens"]}.0' in metrics
    status, _ = generate(port, "key-a", max_tokens=1)  # the quota was charged the same: prompt + completion
    assert status == 200
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/generate", json.dumps({"tokens": [1], "max_tokens": 1}), {"x-api-key": "key-a"})
    response = conn.getresponse()
    response.read()
    remaining = int(response.getheader("x-ratelimit-remaining-tokens"))
    spent = 200 + line["completion_tokens"] + 2 + 2  # the cut request, a 1-token request, this one's reservation
    assert abs(remaining - (2000 - spent)) <= 2  # refills at 2,000 a day: well under a token in this test
    conn.close()
