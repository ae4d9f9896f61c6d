"""Property-based fuzzing of the HTTP request core: whatever arrives, the core answers -- a Work item,
a health/metrics route, or an error response with a JSON ``{type, message}`` -- and never raises."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.edge.http import Limits, Request, Response, StateQuery, Work
from edgepath.edge.routes import HttpCore

LIMITS = Limits(max_body=512, input_capacity=16, output_capacity=32, vocab_size=1000)
CORE = HttpCore(LIMITS)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
documents = st.dictionaries(
    st.sampled_from(["prompt", "tokens", "max_tokens", "stream", "extra"]), json_values, max_size=4
).map(lambda d: json.dumps(d).encode())
bodies = st.one_of(documents, st.binary(max_size=600), json_values.map(lambda v: json.dumps(v).encode()))
targets = st.one_of(
    st.sampled_from(["/v1/generate", "/v1/tokenize", "/health", "/health?latency=99", "/metrics"]),
    st.text(max_size=30).map(lambda t: "/" + t),
)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "get", ""])


@settings(max_examples=600, deadline=None)
@given(method=methods, target=targets, body=bodies)
def test_the_core_always_answers_and_never_raises(method: str, target: str, body: bytes) -> None:
    result = CORE.handle(Request(method, target, [], body, t_receive_ns=1))
    if isinstance(result, Work):
        assert result.kind in ("generate", "tokenize")
        assert (result.prompt is None) != (result.tokens is None)
        if result.tokens is not None:
            assert all(0 <= t < LIMITS.vocab_size for t in result.tokens)
        if result.kind == "generate":
            assert 1 <= result.max_tokens <= LIMITS.output_capacity
        return
    if isinstance(result, StateQuery):
        assert result.route in ("/health", "/metrics") and isinstance(result.query, dict)
        return
    assert isinstance(result, Response)
    assert result.status in (400, 404, 405, 413)
    error = json.loads(result.body)["error"]
    assert set(error) == {"type", "message"} and error["message"]
