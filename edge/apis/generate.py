"""edgepath's own routes, ``/v1/generate`` and ``/v1/tokenize``: a prompt (text or token ids) and the sampling fields
in, token ids and text out -- the shape with nothing between the client and the data path.

:class:`GenerateRoutes` turns a body into a :class:`~edgepath.edge.http.Work` item (every bad field a 400 naming it
and what is allowed); :class:`GenerateFormatter` shapes the answer: one JSON document, or one ``data: {"token": id}``
event per token and ``event: done`` with the summary when streamed.  Errors are edgepath's shape,
``{"error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from edgepath.contract import wire
from edgepath.contract.wire import Sampling
from edgepath.edge.apis.sampling import FIELDS as SAMPLING_FIELDS
from edgepath.edge.apis.sampling import (
    GENERATE_DEFAULT,
    SamplingInvalid,
    fresh_seed,
    parse_cache_salt,
    parse_sampling,
)
from edgepath.edge.http import (
    GENERATE,
    RECLAIMED,
    Headers,
    HttpError,
    Limits,
    Outcome,
    Response,
    Work,
    error_payload,
    error_response,
    json_response,
    json_type,
    request_object,
)


def tokenize_response(ids: Sequence[int]) -> Response:
    """``/v1/tokenize``'s answer: the ids and how many."""
    return json_response(200, {"tokens": list(ids), "count": len(ids)})


class GenerateRoutes:
    """``/v1/generate`` and ``/v1/tokenize`` bodies into :class:`Work` (``limits``: the slot's capacities and the
    vocabulary the token ids must come from; ``seeds``: where a request that samples without a seed gets one)."""

    def __init__(self, limits: Limits, seeds: Callable[[], int] = fresh_seed) -> None:
        self.limits = limits
        self.seeds = seeds

    def handle(self, path: str, method: str, body: bytes) -> Work:
        """The work a POST asks for; :class:`HttpError` (400) naming the field that is wrong."""
        doc = request_object(body)
        kind = "generate" if path == GENERATE else "tokenize"
        generating = {"max_tokens", "stream", "cache_salt", "ignore_eos", *SAMPLING_FIELDS}
        allowed = {"prompt", "tokens"} | (generating if kind == "generate" else set())
        unknown = sorted(set(doc) - allowed)
        if unknown:
            raise HttpError(400, "invalid_request", f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        prompt, tokens = self._input(doc)
        if kind == "tokenize":
            return Work(kind, prompt, tokens, 0, False, route=path)
        sampling = self._sampling(doc)
        work = Work(kind, prompt, tokens, self._max_tokens(doc), _stream(doc), sampling, route=path)
        work.constraint = wire.after_prompt(None, sampling.logit_bias)  # the logit biases follow the prompt
        work.flags = wire.FLAG_IGNORE_EOS if _flag(doc, "ignore_eos") else 0
        try:
            work.cache_salt = parse_cache_salt(doc)
        except SamplingInvalid as exc:
            raise HttpError(400, "invalid_request", exc.message) from None
        return work

    @staticmethod
    def error(exc: HttpError) -> Response:
        return error_response(exc)

    def _input(self, doc: Mapping[str, Any]) -> tuple[str | None, list[int] | None]:
        has_prompt, has_tokens = "prompt" in doc, "tokens" in doc
        if has_prompt == has_tokens:
            raise HttpError(400, "invalid_request", "give exactly one of 'prompt' (a string) or 'tokens' (token ids)")
        if has_prompt:
            prompt = doc["prompt"]
            if not isinstance(prompt, str):
                raise HttpError(400, "invalid_request", f"'prompt' must be a string, got {json_type(prompt)}")
            if not prompt:
                raise HttpError(400, "invalid_request", "'prompt' is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise HttpError(
                    400, "invalid_utf8", "'prompt' contains an unpaired surrogate escape, which is not valid UTF-8"
                ) from None
            return prompt, None
        tokens = doc["tokens"]
        vocab = self.limits.vocab_size
        if not isinstance(tokens, list) or not tokens or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise HttpError(400, "invalid_request", f"'tokens' must be a non-empty list of token ids in 0..{vocab - 1}")
        return None, tokens

    def _sampling(self, doc: Mapping[str, Any]) -> Sampling:
        """The sampling fields, parsed and refused exactly as on the OpenAI routes (greedy by default)."""
        try:
            return parse_sampling(doc, GENERATE_DEFAULT, vocab_size=self.limits.vocab_size, seeds=self.seeds)
        except SamplingInvalid as exc:
            raise HttpError(400, "invalid_request", exc.message) from None

    def _max_tokens(self, doc: Mapping[str, Any]) -> int:
        cap = self.limits.output_capacity
        value = doc.get("max_tokens", cap)
        if type(value) is not int or not 1 <= value <= cap:
            raise HttpError(400, "invalid_max_tokens", f"'max_tokens' must be an integer in 1..{cap}, got {value!r}")
        return value


def _stream(doc: Mapping[str, Any]) -> bool:
    return _flag(doc, "stream")


def _flag(doc: Mapping[str, Any], name: str) -> bool:
    """A boolean field (false when absent or null)."""
    value = doc.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HttpError(400, "invalid_request", f"'{name}' must be true or false, got {json_type(value)}")
    return value


class GenerateFormatter:
    """``/v1/generate``: one JSON document, or one ``data: {"token": id}`` event per token then
    ``event: done`` with the summary and the first-token time when streamed."""

    def __init__(self, decode: Callable[[np.ndarray], str], model: str | None = None) -> None:
        """``model``: the served model's name, for the usage log (the answer itself names none)."""
        self._decode = decode
        self.watch: bool = False  # /v1/generate has no stop strings: the model decides when it is done
        self.done: bool = False
        self.answer_id: str | None = None  # its answer's id is the edge's request id
        self.model = model

    @staticmethod
    def _summary(outcome: Outcome) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "id": outcome.request_id,
            "input_count": outcome.input_count,
            "output_count": len(outcome.tokens),
            "cached_tokens": outcome.cached_tokens,
        }
        if outcome.status == "RECLAIMED":
            summary["finish_details"] = dict(RECLAIMED)
        return summary

    def complete(self, outcome: Outcome) -> Response:
        summary = self._summary(outcome)
        return json_response(200, {**summary, "tokens": outcome.tokens, "text": self._decode(outcome.tokens)})

    def start(self) -> tuple[int, Headers]:
        return 200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    def tokens(self, ids: np.ndarray) -> bytes:
        return b"".join(b'data: {"token": %d}\n\n' % t for t in ids.tolist())

    def end(self, outcome: Outcome) -> bytes:
        doc = {
            **self._summary(outcome),
            "text": self._decode(outcome.tokens),
            "first_token_ms": round(outcome.first_token_ns / 1e6, 3),
        }
        return f"event: done\ndata: {json.dumps(doc)}\n\n".encode()

    @staticmethod
    def failure(error: HttpError) -> Response:
        return error_response(error)

    def error(self, error: HttpError) -> bytes:
        return f"event: error\ndata: {json.dumps(error_payload(error))}\n\n".encode()
