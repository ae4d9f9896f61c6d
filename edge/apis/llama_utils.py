"""llama-server's utility routes, ``POST /tokenize`` and ``POST /detokenize``, in its shapes (tools/server/README.md):
tools written against llama-server count and inspect tokens here unchanged.

``/tokenize`` takes ``content`` (a string), ``add_special`` (add the special tokens the vocabulary asks for, such as
BOS; default false), ``parse_special`` (text that names a control token is that token; default true) and
``with_pieces`` (each id with its piece: a string when its bytes are UTF-8, else the list of its bytes; default
false), and answers ``{"tokens": [...]}``.  ``/detokenize`` takes ``tokens`` (ids) and answers ``{"content": text}``:
the ids' pieces joined, control tokens' text included (bytes that are not UTF-8 replaced, as llama-server's JSON
writer does).  Errors are llama-server's shape, ``{"error": {"code", "message", "type"}}``; a field these routes do
not know is refused by name, never ignored.

They need the model's own vocabulary in llama.cpp (:class:`~edgepath.edge.text.tokenizer.GGUFTokenizer`), which
``serve`` has whenever it serves a model.  A large ``content`` is tokenized on a worker as every prompt is (the
lifecycle's ``/v1/tokenize`` path); ``/detokenize`` is answered at once, a look-up per id in the vocabulary's piece
table (:meth:`~edgepath.edge.text.tokenizer.GGUFTokenizer.pieces`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol, TypeGuard

import numpy as np

from edgepath.edge.http import LLAMA_TOKENIZE, HttpError, Response, Work, json_response, json_type, request_object

#: llama-server's error ``type`` for each status (tools/server/server-common.cpp, format_error_response)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "unavailable_error",  # a busy tokenizer; llama-server says 503 where it is busy
    503: "unavailable_error",
}
TOKENIZE_FIELDS = {"content": None, "add_special": False, "parse_special": True, "with_pieces": False}
DETOKENIZE_FIELDS = {"tokens": None}


class Vocabulary(Protocol):
    """What the routes need of the tokenizer: llama.cpp's tokenization with its switches, and every token's piece."""

    vocab_size: int

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> np.ndarray: ...

    def pieces(self) -> list[bytes]: ...


def has_vocabulary(tokenizer: object) -> TypeGuard[Vocabulary]:
    """Whether ``tokenizer`` can serve these routes (the GGUF tokenizer can; Tekken and tokenizer.json cannot)."""
    return callable(getattr(tokenizer, "tokenize", None)) and callable(getattr(tokenizer, "pieces", None))


class LlamaUtilRoutes:
    """``/tokenize`` bodies into tokenize :class:`Work` (answered in llama-server's shape), ``/detokenize`` bodies
    into their answer."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary

    def handle(self, path: str, method: str, body: bytes) -> Work | Response:
        doc = request_object(body)
        if path == LLAMA_TOKENIZE:
            return self._tokenize(doc)
        return self._detokenize(doc)

    def error(self, exc: HttpError) -> Response:
        return error_response(exc)

    def _tokenize(self, doc: Mapping[str, Any]) -> Work:
        _known(doc, TOKENIZE_FIELDS)
        content = doc.get("content")
        if not isinstance(content, str):
            raise HttpError(400, "invalid_request", f"'content' must be the text to tokenize, got {json_type(content)}")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise HttpError(400, "invalid_request", "'content' holds an unpaired surrogate escape, not UTF-8") from None
        add_special, parse_special, with_pieces = (_flag(doc, name) for name in list(TOKENIZE_FIELDS)[1:])
        encode = functools.partial(self.vocabulary.tokenize, add_special=add_special, parse_special=parse_special)
        answer = functools.partial(self._tokens, with_pieces)
        # an empty text has no tokens but, maybe, BOS: llama-server answers it; the lifecycle's path takes it too
        options = {"encode": encode, "answer": answer}  # the lifecycle's refusals take this shape by the path
        return Work("tokenize", content, None, 0, False, route=LLAMA_TOKENIZE, options=options)

    def _tokens(self, with_pieces: bool, ids: np.ndarray) -> Response:
        tokens = ids.tolist()
        if not with_pieces:
            return json_response(200, {"tokens": tokens})
        pieces = self.vocabulary.pieces()
        return json_response(200, {"tokens": [{"id": t, "piece": _piece(pieces[t])} for t in tokens]})

    def _detokenize(self, doc: Mapping[str, Any]) -> Response:
        _known(doc, DETOKENIZE_FIELDS)
        tokens = doc.get("tokens", [])
        size = self.vocabulary.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < size for t in tokens):
            raise HttpError(400, "invalid_request", f"'tokens' must be a list of token ids in 0..{size - 1}")
        pieces = self.vocabulary.pieces()
        text = b"".join(pieces[t] for t in tokens).decode("utf-8", errors="replace")
        return json_response(200, {"content": text})


def error_response(exc: HttpError) -> Response:
    """An error in llama-server's shape: ``{"error": {"code", "message", "type"}}``."""
    kind = ERROR_TYPES.get(exc.status, "server_error")
    response = json_response(exc.status, {"error": {"code": exc.status, "message": exc.message, "type": kind}})
    response.headers += exc.headers
    return response


def _known(doc: Mapping[str, Any], fields: dict[str, Any]) -> None:
    unknown = sorted(set(doc) - set(fields))
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown field(s) {unknown}; allowed: {list(fields)}")


def _flag(doc: Mapping[str, Any], name: str) -> bool:
    value = doc.get(name)
    if value is None:
        return bool(TOKENIZE_FIELDS[name])
    if not isinstance(value, bool):
        raise HttpError(400, "invalid_request", f"'{name}' must be true or false, got {json_type(value)}")
    return value


def _piece(data: bytes) -> str | list[int]:
    """A piece as llama-server lists it: its text when its bytes are UTF-8, else the bytes themselves."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
