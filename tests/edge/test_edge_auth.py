"""API keys: 401 with a clear body when missing or wrong; /health and /metrics the operator's (a key, or the ops
listener), the probes open; flat keys named by their place in the list."""

from __future__ import annotations

import hashlib
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


def ops(
    keys: ApiKeys | None,
    target: str,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    *,
    on_ops: bool = False,
    **core: str,
) -> object:
    request = Request("GET", target, list(headers), b"", t_receive_ns=1, ops=on_ops)
    return HttpCore(LIMITS, keys, **core).handle(request)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_with_keys_health_and_metrics_need_one_and_the_probes_do_not(path: str) -> None:
    """/metrics names tenants and their usage, /health the slot servers and their load: the operator's, not a
    client's; the probes (/health/live, /health/ready) say only up or not, and a kubelet sends no key."""
    keys = ApiKeys(["k"])
    assert "missing" in unauthorized(ops(keys, path))
    assert ops(keys, path, ((b"x-api-key", b"k"),)) == StateQuery(path, {})
    for probe in ("/health/live", "/health/ready"):
        assert ops(keys, probe) == StateQuery(probe, {})
        unauthorized(ops(ApiKeys(["k"], protect_ops=True), probe))  # --protect-ops: the probes too
    assert ops(None, path) == StateQuery(path, {})  # no keys at all (loopback, or --allow-anonymous): open


def test_with_an_ops_listener_the_clients_listener_answers_only_the_probes() -> None:
    for keys in (None, ApiKeys(["k"])):
        for path in ("/health", "/metrics"):
            gone = ops(keys, path, ((b"x-api-key", b"k"),), ops_listener="0.0.0.0:9090")
            assert isinstance(gone, Response) and gone.status == 404, gone
            assert "ops listener (0.0.0.0:9090)" in json.loads(gone.body)["error"]["message"]
        assert ops(keys, "/health/ready", ops_listener="0.0.0.0:9090") == StateQuery("/health/ready", {})


def test_the_ops_listener_serves_the_ops_routes_without_a_key_and_nothing_else() -> None:
    keys = ApiKeys(["k"], protect_ops=True)
    for path in ("/health", "/metrics", "/health/live", "/health/ready"):
        assert ops(keys, path, on_ops=True, ops_listener="0.0.0.0:9090") == StateQuery(path, {})
    for path in ("/v1/generate", "/v1/models", "/admin"):
        gone = ops(keys, path, ((b"x-api-key", b"k"),), on_ops=True, ops_listener="0.0.0.0:9090")
        assert isinstance(gone, Response) and gone.status == 404, gone
        assert "/metrics" in json.loads(gone.body)["error"]["message"]  # it says what it serves


def test_flat_keys_are_named_by_their_place_in_the_list_never_by_their_digest() -> None:
    """A tenant's name is a metrics label and a usage-log field: a digest of the key (or part of one) there would
    let anyone who reads it check guessed keys offline."""
    keys = ApiKeys(["alpha", "beta", "alpha"])  # a key given twice is the first
    assert [t.name for t in keys.tenants] == ["key-1", "key-2"]
    named = keys.identify(b"beta")
    assert named is not None and named.name == "key-2"
    assert hashlib.sha256(b"beta").hexdigest()[:6] not in named.name


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
