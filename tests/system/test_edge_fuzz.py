"""The fuzz lane (issue 49): requests generated against a real ``edgepath serve`` over each transport, each bounded in
count and time -- every answer a documented status with a JSON error body, never a dropped connection, a traceback
in the server's log, or a 500.

* HTTP/1.1: schemathesis (PyPI) generates requests from the server's own ``/openapi.json`` and checks each answer
  against it (``not_a_server_error``, ``status_code_conformance``, ``content_type_conformance``,
  ``response_schema_conformance``);
* HTTP/3: hypothesis generates requests over the same routes -- valid fields, wrong types, deep nesting, long
  strings, bytes that are no JSON -- and sends them with aioquic (edgepath's H3 client) over one connection, checking
  each answer against the same document.

``EDGEPATH_FUZZ_REQUESTS`` sets how many requests each transport gets at least (default 5,000, the CI's figure).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.edge import free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgepath.edge.client import H3Client, h3_client
from edgepath.edge.http import CHAT, COMPLETIONS, GENERATE, HEALTH, LIVE, METRICS, MODELS, OPENAPI, READY, TOKENIZE

pytestmark = pytest.mark.slow  # a serve process each, thousands of requests

REQUESTS = int(os.environ.get("EDGEPATH_FUZZ_REQUESTS", "5000"))
EDGEPATH = str(Path(sys.executable).with_name("edgepath"))
SERVED_MODEL = "m"


class Served:
    """A running ``edgepath serve`` (echo handler, the default model's tokenizer: chats are templated) and its log."""

    def __init__(self, transport: str, tmp: Path) -> None:
        from edgepath.model.gguf import default_model_path

        kind = socket.SOCK_STREAM if transport == "tcp" else socket.SOCK_DGRAM
        self.port = free_port(kind=kind)
        self.log = tmp / "serve.log"
        env = dict(os.environ, XDG_STATE_HOME=str(tmp / "state"))
        argv = [EDGEPATH, "serve", "--transport", transport, "--port", str(self.port), "--handler", "echo"]
        argv += ["--tokenizer", str(default_model_path()), "--served-model-name", SERVED_MODEL, "--slots", "8"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), f"serve did not start: {line!r}\n{self.log.read_text()}"

    def stop(self) -> str:
        """Stop it; its whole log."""
        self.proc.terminate()
        self.proc.wait(60)
        return self.log.read_text()


def clean(log: str) -> None:
    """No traceback, no error logged, no status 500 logged."""
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]


@pytest.fixture
def tcp_served(tmp_path: Path) -> Iterator[Served]:
    served = Served("tcp", tmp_path)
    try:
        yield served
    finally:
        served.stop()


def test_schemathesis_over_http11(tcp_served: Served) -> None:
    """schemathesis' fuzzing phase (its coverage phase failed inside schemathesis 4.32.5 on the chat route's schema
    while generating, before any request), run again with the next seed until it made REQUESTS requests (how many
    one run makes is not in proportion to ``--max-examples``); the four POST routes carry the count."""
    url = f"http://127.0.0.1:{tcp_served.port}"
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    made, runs = 0, []
    for seed in range(49, 59):
        run = subprocess.run(
            [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}{OPENAPI}", "--checks", checks,
             "--max-examples", str(max(1, REQUESTS // 3)), "--workers", "2", "--phases", "fuzzing", "--seed",
             str(seed), "--generation-database", "none"],
            capture_output=True, text=True, timeout=1500, cwd=tcp_served.log.parent,  # its cache stays out of the tree
        )  # fmt: skip
        generated = re.search(r"(\d+) generated", run.stdout)
        assert run.returncode == 0 and generated is not None, run.stdout[-3000:]
        made += int(generated.group(1))
        runs.append(int(generated.group(1)))
        if made >= REQUESTS:
            break
    assert made >= REQUESTS, runs
    clean(tcp_served.stop())


# -- HTTP/3: hypothesis over aioquic ----------------------------------------------------------------------

text = st.one_of(st.text(max_size=30), st.sampled_from(["", "x" * 600, "\ud800", "hi"]), st.just("y" * 5000))
leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), text)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]), "content": text}),
    max_size=6,
) | st.just([{"role": "user", "content": ""}] * 3000)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([SERVED_MODEL, "other", 3]),
    "prompt": st.one_of(text, st.lists(st.integers(-5, 200_000), max_size=8)),
    "tokens": st.lists(st.integers(-5, 200_000), max_size=8),
    "messages": messages,
    "max_tokens": st.one_of(st.integers(-2, 3000), values),
    "stream": st.one_of(st.booleans(), values),
    "stop": st.one_of(text, st.lists(text, max_size=6), values),
    "n": st.one_of(st.integers(-1, 20), values),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 30)),
    "top_logprobs": st.integers(-1, 30),
    "response_format": st.one_of(
        st.just(
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "maxLength": 10**8}}}
        ),
        values,
    ),
    "tools": st.one_of(values, st.just([{"type": "function", "function": {"name": "f"}}] * 200)),
    "temperature": st.one_of(st.floats(-1, 3), values),
    "top_p": st.floats(-1, 2),
    "top_k": st.integers(-1, 2**40),
    "seed": st.integers(-(2**70), 2**70),
    "cache_salt": text,
    "logit_bias": st.dictionaries(st.text(max_size=4), st.integers(-200, 200), max_size=5),
}
documents = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.just(None), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({key: FIELDS[key] for key in keys})
)


def deep(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


bodies = st.one_of(
    documents.map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=300),
    st.sampled_from([deep(70), deep(1000), deep(100_000), b"{" * 5000, b"[]", b"null", b"\xff\xfe"]),
)
ROUTES = [GENERATE, TOKENIZE, COMPLETIONS, CHAT, MODELS, HEALTH, LIVE, READY, METRICS, OPENAPI, "/nowhere"]


class H3Session:
    """One aioquic connection to the server, driven from hypothesis' thread through a loop of its own."""

    def __init__(self, port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client: H3Client | None = None
        self._context: Any = None
        self.port = port
        self.call(self._open())

    async def _open(self) -> None:
        self._context = h3_client("127.0.0.1", self.port, insecure=True)
        self.client = await self._context.__aenter__()

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def close(self) -> None:
        self.call(self._context.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_hypothesis_over_http3(tmp_path: Path) -> None:
    served = Served("quic", tmp_path)
    session = H3Session(served.port)
    sent = [0]
    try:
        assert session.client is not None
        doc = json.loads(session.call(session.client.request("GET", OPENAPI)).body)

        @settings(
            max_examples=REQUESTS,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
        @given(path=st.sampled_from(ROUTES), method=st.sampled_from(["POST", "GET", "PUT"]), body=bodies)
        def one(path: str, method: str, body: bytes) -> None:
            assert session.client is not None
            answer = session.call(session.client.request(method, path, body=body if method != "GET" else b""))
            sent[0] += 1
            operations = doc["paths"].get(path)
            if operations is None:
                assert answer.status == 404
            elif method.lower() not in operations:
                assert answer.status == 405
            else:
                assert str(answer.status) in operations[method.lower()]["responses"], (answer.status, answer.body)
            assert answer.status != 500 and answer.status < 502, (path, body[:200], answer.status, answer.body[:300])
            if answer.status >= 400:
                assert "error" in json.loads(answer.body) or path in (HEALTH, READY)

        one()
    finally:
        session.close()
        log = served.stop()
    assert sent[0] >= REQUESTS
    clean(log)
