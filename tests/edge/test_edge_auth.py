"""API keys: 401 with a clear body when missing or wrong; /health and /metrics open unless protected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgepath.edge.http import Limits, Request, Response, StateQuery, Work
from edgepath.edge.routes import HttpCore
from edgepath.edge.tenancy.auth import ApiKeys, load_keys

LIMITS = Limits(max_body=1024, input_capacity=16, output_capacity=32, vocab_size=1000)
BODY = b'{"prompt": "hi"}'


def handle(keys: ApiKeys | None, target: str, headers: list[tuple[bytes, bytes]], method: str = "POST") -> object:
    body = BODY if method == "POST" else b""
    return HttpCore(LIMITS, keys).handle(Request(method, target, headers, body, t_receive_ns=1))


def unauthorized(result: object) -> str:
    assert isinstance(result, Response) and result.status == 401, result
    assert dict(result.headers)[b"www-authenticate"] == b"Bearer"
    error = json.loads(result.body)["error"]
    assert error["type"] == "unauthorized"
    return error["message"]


def test_without_keys_nothing_is_checked() -> None:
    assert isinstance(handle(None, "/v1/generate", []), Work)


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        ([], False),
        ([(b"x-api-key", b"wrong")], False),
        ([(b"x-api-key", b"")], False),
        ([(b"authorization", b"Basic s3cret")], False),
        ([(b"x-api-key", b"s3cret")], True),
        ([(b"X-Api-Key", b" s3cret ")], True),
        ([(b"authorization", b"Bearer other-key")], True),
    ],
)
def test_keys_are_required_on_the_api(headers: list[tuple[bytes, bytes]], ok: bool) -> None:
    result = handle(ApiKeys(["s3cret", "other-key"]), "/v1/generate", headers)
    if ok:
        assert isinstance(result, Work)
    else:
        assert "x-api-key" in unauthorized(result)


def test_messages_say_missing_or_invalid() -> None:
    keys = ApiKeys(["k"])
    assert "missing" in unauthorized(handle(keys, "/v1/tokenize", []))
    assert "not valid" in unauthorized(handle(keys, "/v1/tokenize", [(b"x-api-key", b"x")]))


def test_unknown_paths_do_not_leak_past_the_key_check() -> None:
    unauthorized(handle(ApiKeys(["k"]), "/admin", []))


def test_ops_routes_are_open_unless_protected() -> None:
    assert handle(ApiKeys(["k"]), "/health", [], "GET") == StateQuery("/health", {})
    unauthorized(handle(ApiKeys(["k"], protect_ops=True), "/metrics", [], "GET"))
    assert handle(ApiKeys(["k"], protect_ops=True), "/metrics", [(b"x-api-key", b"k")], "GET") == StateQuery(
        "/metrics", {}
    )


def test_loading_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha\n\n  beta  \n")
    keys = load_keys(str(path), environ={"EDGEPATH_API_KEYS": "gamma, delta"})
    assert keys is not None
    assert all(keys.allows(k.encode()) for k in ("alpha", "beta", "gamma", "delta"))
    assert not keys.allows(b"# team keys")
    assert load_keys(None, environ={}) is None
    with pytest.raises(ValueError, match="none was given"):
        load_keys(None, environ={"EDGEPATH_API_KEYS": " , "})
    with pytest.raises(ValueError, match="cannot read API keys"):
        load_keys(str(tmp_path / "missing"), environ={})
    with pytest.raises(ValueError, match="--protect-ops needs API keys"):
        load_keys(None, protect_ops=True, environ={})
