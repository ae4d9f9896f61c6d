"""llama-server's ``/tokenize`` and ``/detokenize`` in its shapes (edge/apis/llama_utils.py): the fields it takes,
the answers it gives, every bad body refused by name in its error shape, and the routes absent without the model's
own vocabulary."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from helpers.tokenizers import CharTokenizer, CharVocabulary

from edgepath.edge.apis.llama_utils import LlamaUtilRoutes, has_vocabulary
from edgepath.edge.http import Limits, Request, Response, Work
from edgepath.edge.routes import HttpCore

BOS = CharVocabulary.BOS


def core(tokenizer: Any = None) -> HttpCore:
    limits = Limits(1 << 16, 16, 16, CharVocabulary.vocab_size)
    vocabulary = CharVocabulary() if tokenizer is None else tokenizer
    return HttpCore(limits, shapes={"llama": LlamaUtilRoutes(vocabulary)} if has_vocabulary(vocabulary) else {})


def post(path: str, doc: Any, http: HttpCore | None = None) -> Work | Response:
    handled = (http or core()).handle(Request("POST", path, [], json.dumps(doc).encode(), 0))
    assert isinstance(handled, Work | Response)
    return handled


def tokenized(doc: dict[str, Any]) -> dict[str, Any]:
    """The answer to a ``/tokenize`` body, tokenized as the lifecycle does it (with the work's own encoding)."""
    work = post("/tokenize", doc)
    assert isinstance(work, Work) and work.kind == "tokenize" and work.route == "/tokenize"
    response = work.options["answer"](work.options["encode"](work.prompt))
    assert response.status == 200
    return json.loads(response.body)


def test_tokenize_takes_llama_servers_switches_with_its_defaults() -> None:
    assert tokenized({"content": "a<b>"}) == {"tokens": [97, 2]}  # parse_special on, add_special off by default
    assert tokenized({"content": "a<b>", "parse_special": False, "add_special": True}) == {
        "tokens": [BOS, 97, 60, 98, 62]
    }
    assert tokenized({"content": ""}) == {"tokens": []}
    assert tokenized({"content": "é", "with_pieces": True}) == {"tokens": [{"id": 233, "piece": "é"}]}


def test_a_piece_that_is_not_utf8_is_listed_as_its_bytes() -> None:
    work = post("/tokenize", {"content": "x", "with_pieces": True})
    assert isinstance(work, Work)
    response = work.options["answer"](np.array([999, 97], dtype=np.int32))
    assert json.loads(response.body) == {"tokens": [{"id": 999, "piece": [195]}, {"id": 97, "piece": "a"}]}


def test_detokenize_joins_the_pieces() -> None:
    answer = post("/detokenize", {"tokens": [104, 105, 2]})
    assert isinstance(answer, Response) and answer.status == 200
    assert json.loads(answer.body) == {"content": "hi\x02"}
    half = post("/detokenize", {"tokens": [999]})  # not UTF-8 alone: replaced, as llama-server's JSON writer does
    assert isinstance(half, Response) and json.loads(half.body) == {"content": "\ufffd"}
    empty = post("/detokenize", {})
    assert isinstance(empty, Response) and json.loads(empty.body) == {"content": ""}


@pytest.mark.parametrize(
    ("path", "doc", "needle"),
    [
        ("/tokenize", {}, "'content' must be the text to tokenize, got null"),
        ("/tokenize", {"content": ["a", 5]}, "'content' must be the text to tokenize, got array"),
        ("/tokenize", {"content": "a", "with_pieces": "yes"}, "'with_pieces' must be true or false"),
        ("/tokenize", {"content": "a", "add_bos": True}, "unknown field(s) ['add_bos']; allowed: ['content',"),
        ("/tokenize", [1], "must be a JSON object, got array"),
        ("/detokenize", {"tokens": [1, 1000]}, "'tokens' must be a list of token ids in 0..999"),
        ("/detokenize", {"tokens": "ab"}, "'tokens' must be a list of token ids in 0..999"),
        ("/detokenize", {"tokens": [1], "content": "x"}, "unknown field(s) ['content']; allowed: ['tokens']"),
    ],
)
def test_a_bad_body_is_refused_in_llama_servers_error_shape(path: str, doc: Any, needle: str) -> None:
    refused = post(path, doc)
    assert isinstance(refused, Response) and refused.status == 400
    error = json.loads(refused.body)["error"]
    assert (error["code"], error["type"]) == (400, "invalid_request_error") and needle in error["message"]


def test_without_the_models_vocabulary_the_routes_are_not_served() -> None:
    refused = post("/tokenize", {"content": "a"}, core(CharTokenizer()))
    assert isinstance(refused, Response) and refused.status == 404
    assert "not served here" in json.loads(refused.body)["error"]["message"]
