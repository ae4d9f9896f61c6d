"""``/openapi.json``: the document of the routes, written from the route table and the limits, with every status a
route answers documented (the fuzz lane, tests/system/test_edge_fuzz.py, holds the server to it)."""

from __future__ import annotations

import json
from typing import Any

from helpers.tokenizers import CharVocabulary
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.edge.apis.limits import MESSAGES_MAX, STOPS_MAX
from edgepath.edge.apis.llama_utils import LlamaUtilRoutes
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.http import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    LLAMA_DETOKENIZE,
    LLAMA_TOKENIZE,
    OPENAPI,
    TOKENIZE,
    Limits,
    Request,
    Response,
)
from edgepath.edge.routes import ROUTES, HttpCore
from edgepath.edge.tenancy.auth import ApiKeys

LIMITS = Limits(max_body=4096, input_capacity=16, output_capacity=32, vocab_size=1000)
CORE = HttpCore(
    LIMITS, ApiKeys(["k"]), OpenAIRoutes("m", 32, 1000, ChatSupport(True), 0),
    shapes={"llama": LlamaUtilRoutes(CharVocabulary())},
)  # fmt: skip


def document(core: HttpCore = CORE) -> dict[str, Any]:
    answer = core.handle(Request("GET", OPENAPI, [], b"", 0))
    assert isinstance(answer, Response) and answer.status == 200  # open without a key, as the ops pages are
    return json.loads(answer.body)


def test_every_route_is_documented_with_its_methods_and_limits() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1") and set(doc["paths"]) == set(ROUTES)
    for path, route in ROUTES.items():
        assert set(doc["paths"][path]) == {m.lower() for m in route.methods}
    schemas = doc["components"]["schemas"]
    assert schemas["ChatRequest"]["properties"]["messages"]["maxItems"] == MESSAGES_MAX
    assert schemas["CompletionRequest"]["properties"]["stop"]["anyOf"][1]["maxItems"] == STOPS_MAX
    assert schemas["GenerateRequest"]["properties"]["max_tokens"]["maximum"] == LIMITS.output_capacity
    without_openai = document(HttpCore(LIMITS))
    assert CHAT not in without_openai["paths"] and GENERATE in without_openai["paths"]
    assert LLAMA_TOKENIZE not in without_openai["paths"]  # llama-server's routes: with the model's vocabulary only
    assert schemas["GenerateRequest"]["properties"]["logit_bias"]["maxProperties"] == 300


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    ["prompt", "tokens", "model", "messages", "max_tokens", "stream", "stop", "n", "logprobs", "response_format",
     "tools", "tool_choice", "temperature", "seed", "cache_salt", "logit_bias", "min_p", "repeat_penalty", "content",
     "with_pieces", "ignore_eos", "unknown"]
)  # fmt: skip
bodies = st.one_of(
    st.dictionaries(fields, json_values, max_size=5).map(lambda d: json.dumps({"model": "m", **d}).encode()),
    st.binary(max_size=200),
)


@settings(max_examples=500, deadline=None)
@given(
    path=st.sampled_from([GENERATE, TOKENIZE, COMPLETIONS, CHAT, LLAMA_TOKENIZE, LLAMA_DETOKENIZE]),
    body=bodies,
    key=st.sampled_from(["k", "x"]),
)
def test_every_status_the_core_answers_is_documented_for_its_route(path: str, body: bytes, key: str) -> None:
    doc = document()
    answer = CORE.handle(Request("POST", path, [(b"x-api-key", key.encode())], body, 0))
    if isinstance(answer, Response):
        assert str(answer.status) in doc["paths"][path]["post"]["responses"], (answer.status, answer.body)
        assert "error" in json.loads(answer.body)
