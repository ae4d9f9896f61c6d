"""Sans-I/O tests of the HTTP core: routing, validation, every bad input -> status + JSON {type, message}."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgepath.dpu.link_state import Readiness
from edgepath.edge.apis.generate import GenerateFormatter
from edgepath.edge.http import (
    Handled,
    HttpError,
    Limits,
    Outcome,
    Request,
    Response,
    StateQuery,
    Work,
    error_response,
    server_timing,
    timing_headers,
)
from edgepath.edge.ops import health_response
from edgepath.edge.routes import HttpCore

LIMITS = Limits(max_body=1024, input_capacity=16, output_capacity=32, vocab_size=1000)


def call(method: str, target: str, body: bytes | str = b"") -> Handled:
    raw = body.encode() if isinstance(body, str) else body
    return HttpCore(LIMITS).handle(Request(method, target, [], raw, t_receive_ns=1))


def error_of(result: object) -> tuple[int, str, str]:
    assert isinstance(result, Response), result
    doc = json.loads(result.body)
    assert dict(result.headers)[b"content-type"] == b"application/json"
    assert set(doc["error"]) == {"type", "message"}
    assert doc["error"]["message"]
    return result.status, doc["error"]["type"], doc["error"]["message"]


def test_generate_prompt_becomes_work() -> None:
    work = call("POST", "/v1/generate", '{"prompt": "hi", "max_tokens": 5, "stream": true}')
    assert work == Work("generate", "hi", None, 5, True)


def test_generate_tokens_and_default_max_tokens() -> None:
    work = call("POST", "/v1/generate", '{"tokens": [1, 2, 999]}')
    assert work == Work("generate", None, [1, 2, 999], LIMITS.output_capacity, False)


def test_tokenize_becomes_work() -> None:
    assert call("POST", "/v1/tokenize", '{"prompt": "x"}') == Work(
        "tokenize", "x", None, 0, False, route="/v1/tokenize"
    )


def test_health_and_metrics_are_routed_with_query() -> None:
    assert call("GET", "/health?latency=99") == StateQuery("/health", {"latency": ["99"]})
    assert call("GET", "/metrics") == StateQuery("/metrics", {})


@pytest.mark.parametrize(
    ("method", "target", "body", "status", "type_"),
    [
        ("POST", "/v1/generate", "{not json", 400, "invalid_json"),
        ("POST", "/v1/generate", "", 400, "invalid_json"),
        ("POST", "/v1/generate", "[1, 2]", 400, "invalid_request"),
        ("POST", "/v1/generate", "{}", 400, "invalid_request"),
        ("POST", "/v1/generate", '{"prompt": "a", "tokens": [1]}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"prompt": 5}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"prompt": ""}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"prompt": "\\ud800"}', 400, "invalid_utf8"),
        ("POST", "/v1/generate", '{"tokens": []}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"tokens": [1, "2"]}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"tokens": [1, true]}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"tokens": [1000]}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"tokens": [-1]}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"prompt": "a", "max_tokens": 0}', 400, "invalid_max_tokens"),
        ("POST", "/v1/generate", '{"prompt": "a", "max_tokens": 33}', 400, "invalid_max_tokens"),
        ("POST", "/v1/generate", '{"prompt": "a", "max_tokens": 1.5}', 400, "invalid_max_tokens"),
        ("POST", "/v1/generate", '{"prompt": "a", "max_tokens": "4"}', 400, "invalid_max_tokens"),
        ("POST", "/v1/generate", '{"prompt": "a", "max_tokens": true}', 400, "invalid_max_tokens"),
        ("POST", "/v1/generate", '{"prompt": "a", "stream": "yes"}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"prompt": "a", "frequency_penalty": 3}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"prompt": "a", "typical_p": 0.9}', 400, "invalid_request"),
        ("POST", "/v1/generate", '{"prompt": "a", "temperature": 3}', 400, "invalid_request"),
        ("POST", "/v1/tokenize", '{"prompt": "a", "max_tokens": 3}', 400, "invalid_request"),
        ("POST", "/v1/generate", b'{"prompt": "\xff\xfe"}', 400, "invalid_utf8"),
        ("POST", "/v1/generate", "x" * 1025, 413, "body_too_large"),
        ("POST", "/nope", "{}", 404, "not_found"),
        ("GET", "/", "", 404, "not_found"),
        ("GET", "//[", "", 400, "invalid_target"),  # urlsplit cannot read it (an unclosed IPv6 host)
        ("GET", "/v1/generate", "", 405, "method_not_allowed"),
        ("DELETE", "/health", "", 405, "method_not_allowed"),
        ("GET", "/health?latency=abc", "", 400, "invalid_request"),
    ],
)
def test_bad_input(method: str, target: str, body: str | bytes, status: int, type_: str) -> None:
    result = call(method, target, body)
    if isinstance(result, StateQuery):  # /health validates its query with live state at hand
        result = health_response(1, 2, Readiness(True, "ok"), result.query, lambda pct: (0.0, 0, 0.0))
    got_status, got_type, _ = error_of(result)
    assert (got_status, got_type) == (status, type_)


def test_405_names_the_allowed_methods() -> None:
    result = call("GET", "/v1/tokenize")
    assert isinstance(result, Response)
    assert dict(result.headers)[b"allow"] == b"POST"


def test_prompt_too_long_reports_exact_count_and_limit() -> None:
    core = HttpCore(LIMITS)
    core.limits.check_length(16)
    with pytest.raises(HttpError) as info:
        core.limits.check_length(17)
    assert (info.value.status, info.value.type) == (400, "prompt_too_long")
    assert "17 tokens" in info.value.message and "at most 16" in info.value.message


def test_no_slot_is_429_with_retry_after() -> None:
    response = error_response(HttpCore(LIMITS).refusals.no_slot())
    status, type_, _ = error_of(response)
    assert (status, type_) == (429, "no_slot")
    assert dict(response.headers)[b"retry-after"] == b"1"


def test_generate_formatter_json_and_sse() -> None:
    formatter = GenerateFormatter(lambda ids: "".join(chr(96 + int(i)) for i in ids))
    outcome = Outcome(7, 3, np.array([1, 2, 3], np.int32), "OK", 2_500_000, cached_tokens=2)
    plain = formatter.complete(outcome)
    assert plain.status == 200 and json.loads(plain.body) == {
        "id": 7,
        "input_count": 3,
        "output_count": 3,
        "cached_tokens": 2,
        "tokens": [1, 2, 3],
        "text": "abc",
    }
    status, headers = formatter.start()
    assert status == 200 and dict(headers)[b"content-type"] == b"text/event-stream"
    assert formatter.tokens(np.array([5, 6], np.int32)) == b'data: {"token": 5}\n\ndata: {"token": 6}\n\n'
    end = formatter.end(outcome)
    assert end.startswith(b"event: done\ndata: ")
    assert json.loads(end.split(b"data: ", 1)[1]) == {
        "id": 7,
        "input_count": 3,
        "output_count": 3,
        "cached_tokens": 2,
        "text": "abc",
        "first_token_ms": 2.5,
    }
    error = formatter.error(HttpError(504, "timeout", "too slow"))
    assert error == b'event: error\ndata: {"error": {"type": "timeout", "message": "too slow"}}\n\n'


def test_health_reports_slots_and_percentile() -> None:
    asked: list[float] = []

    def window(pct: float) -> tuple[float, int, float]:
        asked.append(pct)
        return 123.0, 10, 12.5

    response = health_response(3, 8, Readiness(True, "ok"), {"latency": ["99.9"]}, window)
    doc = json.loads(response.body)
    assert response.status == 200 and asked == [99.9]
    assert doc == {
        "status": "ok",
        "free_slots": 3,
        "total_slots": 8,
        "slot_servers": [],
        "latency": {"percentile": 99.9, "edge_us": 123.0, "samples": 10, "window_s": 12.5},
    }
    down = health_response(0, 8, Readiness(False, "unavailable", "no slot server is attached"), {}, window)
    assert down.status == 503
    assert json.loads(down.body) == {
        "status": "unavailable",
        "free_slots": 0,
        "total_slots": 8,
        "reason": "no slot server is attached",
        "slot_servers": [],
    }


def test_timing_headers_carry_measured_values() -> None:
    timings = {"queue": 2_500, "parse": 10_000, "total": 1_000_000}
    headers = dict(timing_headers(timings))
    assert headers[b"x-queue-time"] == b"2.5us"
    assert server_timing(timings) == b"queue;dur=0.003, parse;dur=0.010, total;dur=1.000"
