"""Tenants at the edge: each API key of a flat list is a cache namespace of its own, the request's ``cache_salt``
field narrows it, and both become the request header's ``cache_salt`` word; a bad ``cache_salt`` is a 400 naming
the field, on edgepath's route and in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edgepath.contract import wire
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.apis.sampling import CACHE_SALT_MAX
from edgepath.edge.http import COMPLETIONS, GENERATE, Limits, Request, Response, Work
from edgepath.edge.routes import HttpCore
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.tenancy.tenants import ANONYMOUS, PUBLIC_NAMESPACE, Tenant

LIMITS = Limits(max_body=4096, input_capacity=16, output_capacity=32, vocab_size=1000)
MODEL = "m"


def core(keys: ApiKeys | None) -> HttpCore:
    return HttpCore(LIMITS, keys, OpenAIRoutes(MODEL, 8, 100, ChatSupport(False, "no template"), 0))


def call(keys: ApiKeys | None, key: str | None, path: str = GENERATE, **fields: Any) -> Work | Response:
    doc = {"prompt": "hi", **fields} | ({"model": MODEL} if path == COMPLETIONS else {})
    headers = [(b"x-api-key", key.encode())] if key else []
    result = core(keys).handle(Request("POST", path, headers, json.dumps(doc).encode(), t_receive_ns=1))
    assert isinstance(result, (Work, Response))
    return result


def work(keys: ApiKeys | None, key: str | None, path: str = GENERATE, **fields: Any) -> Work:
    result = call(keys, key, path, **fields)
    assert isinstance(result, Work), result
    return result


@pytest.mark.parametrize("path", [GENERATE, COMPLETIONS])
def test_each_key_of_a_flat_list_is_a_cache_namespace_of_its_own(path: str) -> None:
    keys = ApiKeys(["key-a", "key-b"])
    a, b = work(keys, "key-a", path), work(keys, "key-b", path)
    assert a.tenant != b.tenant and a.tenant.name.startswith("key-") and "key-a" not in a.tenant.name
    assert len({a.salt, b.salt, 0}) == 3  # never the anonymous namespace either
    assert work(keys, "key-a", path).salt == a.salt  # the same key, the same namespace: its own cache works


@pytest.mark.parametrize("path", [GENERATE, COMPLETIONS])
def test_without_keys_there_is_one_anonymous_namespace_as_before(path: str) -> None:
    plain = work(None, None, path)
    assert plain.tenant is ANONYMOUS and plain.salt == 0
    salted = work(None, None, path, cache_salt="mine")
    assert salted.salt == wire.cache_salt(b"", "mine") != 0


@pytest.mark.parametrize("path", [GENERATE, COMPLETIONS])
def test_a_cache_salt_narrows_the_tenants_namespace(path: str) -> None:
    keys = ApiKeys(["key-a", "key-b"])
    a, a_salted = work(keys, "key-a", path), work(keys, "key-a", path, cache_salt="s")
    b_salted = work(keys, "key-b", path, cache_salt="s")
    assert len({a.salt, a_salted.salt, b_salted.salt}) == 3  # the same cache_salt does not join two tenants
    assert work(keys, "key-a", path, cache_salt="s").salt == a_salted.salt


@pytest.mark.parametrize(
    "value", [1, "", ["s"], {"s": 1}, True, "x" * (CACHE_SALT_MAX + 1), "\udc80"], ids=lambda v: repr(v)[:12]
)
def test_a_bad_cache_salt_is_a_400_naming_the_field(value: Any) -> None:
    own = call(None, None, GENERATE, cache_salt=value)
    assert isinstance(own, Response) and own.status == 400
    assert "'cache_salt'" in json.loads(own.body)["error"]["message"]
    openai = call(None, None, COMPLETIONS, cache_salt=value)
    assert isinstance(openai, Response) and openai.status == 400
    error = json.loads(openai.body)["error"]
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"


def test_sharing_tenants_meet_in_the_public_namespace_and_nobody_else_does() -> None:
    sharing = [Tenant("a", b"tenant:a", share_prefix=True), Tenant("b", b"tenant:b", share_prefix=True)]
    private = Tenant("c", b"tenant:c")
    assert sharing[0].salt(None) == sharing[1].salt(None) == wire.cache_salt(PUBLIC_NAMESPACE)
    assert private.salt(None) != sharing[0].salt(None)
    assert sharing[0].salt("own") != sharing[1].salt(None)  # a cache_salt leaves the shared namespace
