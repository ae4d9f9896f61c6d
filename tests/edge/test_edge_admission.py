"""The edge's side of admission within a bound: the request's X-Max-Wait, the 429 that says the predicted
wait and when to come back, the measured wait as X-Queue-Time and the prediction in Server-Timing -- a real
agent and slot server over loopback, with a handler that reports the load a test gives it."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from helpers.loaded import PACE, Loaded
from helpers.tokenizers import CharTokenizer
from test_edge_service import Server, generate, serve_requests, start_server

from edgepath.contract import wire
from edgepath.contract.plan import Load, Prompt, own_ms, predict
from edgepath.edge.http import HttpError, Request, max_wait_of


@pytest.fixture
def loaded(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Server, Loaded]]:
    """A slot server whose handler reports the load the test names (``indirect`` parameter; idle without),
    published from the start: a slot server rewrites the words when its handler's work changes."""
    handler = Loaded(getattr(request, "param", Load(**PACE)))
    for server in start_server(tmp_path, handler):
        yield server, handler


def with_header(request: Request, name: bytes, value: bytes) -> Request:
    request.headers = [*request.headers, (name, value)]
    return request


def header(response, name: bytes) -> str:  # type: ignore[no-untyped-def]
    return next(v for k, v in response.headers if k == name).decode()


def test_x_max_wait_is_passed_on_as_asked_and_nonsense_is_400() -> None:
    """The edge only reads the request's bound; the agent applies it when it is below its own (one owner)."""
    assert max_wait_of([]) == 0
    assert max_wait_of([(b"X-Max-Wait", b"0.5")]) == 500
    assert max_wait_of([(b"x-max-wait", b"60")]) == 60_000
    for bad in (b"0", b"-1", b"soon", b"inf", b"nan"):
        with pytest.raises(HttpError) as raised:
            max_wait_of([(b"x-max-wait", bad)])
        assert raised.value.status == 400 and "X-Max-Wait must be a positive number of seconds" in str(raised.value)


@pytest.mark.parametrize("loaded", [Load(waiting=(Prompt(0, 1500), Prompt(0, 1500)), **PACE)], indirect=True)
def test_over_the_bound_is_429_with_the_predicted_wait_and_when_to_come_back(loaded) -> None:
    server, handler = loaded
    prompt = "x" * 20
    asks_more = with_header(generate(prompt), b"x-max-wait", b"60")  # more than the agent's: the agent's holds
    pool = server.server.pool
    version = int(pool.buf[wire.LOAD_OFFSET : wire.LOAD_OFFSET + 8].view(np.uint64)[0])  # when it was published
    replies, _ = asyncio.run(serve_requests(server, CharTokenizer(), 2, [asks_more]))
    ran_ms = (time.monotonic_ns() - version) / 1e6  # the first step planned from it has run at most this long
    response = replies[0].response
    assert response.status == 429
    error = orjson.loads(response.body)["error"]
    asked = r"the predicted wait for a first token is ([\d.]+) s, over this request's bound of 2.00 s"
    said = re.search(asked, error["message"])
    assert error["type"] == "over_bound" and said is not None
    # the step under way counts for what is left of it (the server's clock in its heartbeat and load version)
    longest = predict(handler.current, Prompt(0, len(prompt)), under_way_ms=0.0).wait_ms  # one token a character
    shortest = predict(handler.current, Prompt(0, len(prompt)), under_way_ms=ran_ms).wait_ms
    wait = float(said[1]) * 1e3
    assert shortest - 5 <= wait <= longest + 5  # said to 10 ms
    assert longest - shortest <= ran_ms + 1e-6 and longest > predict(handler.current, Prompt(0, len(prompt))).wait_ms
    # come back when the wait is predicted to be within the bound again, give or take a quarter (the jitter)
    retry_ms = int(header(response, b"retry-after-ms"))
    assert shortest - 2000 <= retry_ms <= 1.25 * (longest - 2000) + 1
    assert header(response, b"retry-after") == str(-(-retry_ms // 1000))


@pytest.mark.parametrize("loaded", [Load(decoding=8, **PACE)], indirect=True)  # a few ms beside 8 streams
def test_a_request_that_asks_for_less_is_refused_where_the_default_admits_it(loaded) -> None:
    server, _ = loaded
    asks = with_header(generate("hello"), b"x-max-wait", b"0.001")
    replies, _ = asyncio.run(serve_requests(server, CharTokenizer(), 2, [generate("hello"), asks]))
    assert [r.response.status for r in replies] == [200, 429]


def test_the_measured_wait_is_x_queue_time_and_the_prediction_is_in_server_timing(loaded) -> None:
    server, handler = loaded
    replies, _ = asyncio.run(serve_requests(server, CharTokenizer(), 2, [generate("hello there")]))
    response = replies[0].response
    assert response.status == 200
    timing = dict(part.split(";dur=") for part in header(response, b"server-timing").split(", "))
    own = own_ms(handler.current, Prompt(0, len("hello there")))
    assert float(timing["predicted_ttft"]) == pytest.approx(own, abs=0.01)  # an idle server: its own prompt
    assert float(timing["predicted_wait"]) == 0.0
    first, wait = float(timing["first_token"]), float(timing["wait"])
    assert wait == pytest.approx(max(0.0, first - own), abs=0.01)
    queue_time = header(response, b"x-queue-time")
    assert queue_time.endswith("us") and float(queue_time[:-2]) == pytest.approx(wait * 1e3, abs=1.0)  # to the us
