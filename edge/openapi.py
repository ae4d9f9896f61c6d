"""The OpenAPI document of edgepath's routes (``GET /openapi.json``): what API tooling expects, and what the fuzz
lane generates requests from (schemathesis over HTTP/1.1, tests/system/test_edge_fuzz.py).

It is written from the route table and the limits the routes enforce (:mod:`edgepath.edge.apis.limits`, the slot's
capacities), so a limit changes in one place and the document follows.  It states every status a route can answer
and the error body each comes with -- edgepath's ``{"error": {"type", "message"}}``, or OpenAI's ``{"error":
{"message", "type", "param", "code"}}`` on the OpenAI routes -- so an answer outside them is a bug the fuzzer
finds.  The request schemas say what the routes read; the routes stay the judges of a body (a schema cannot say
that a prompt fits a slot once tokenized).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgepath.contract.wire import BIAS_MAX, LOGIT_BIAS_MAX, PENALTY_MAX, REPETITION_MAX, TOP_LOGPROBS_MAX
from edgepath.edge.apis.limits import JSON_DEPTH_MAX, MESSAGES_MAX, STOP_CHARS_MAX, STOPS_MAX, TOOLS_MAX
from edgepath.edge.apis.sampling import CACHE_SALT_MAX, SEED_MAX, SEED_MIN, TOP_K_MAX
from edgepath.edge.http import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    GENERATE,
    HEALTH,
    LIVE,
    LLAMA_DETOKENIZE,
    LLAMA_TOKENIZE,
    MESSAGES,
    METRICS,
    MODELS,
    OPENAPI,
    READY,
    RESPONSES,
    TOKENIZE,
    Limits,
)

#: the statuses of a request that runs on a slot: refused (400, 401, 404 model, 408, 413, 429), failed (500
#: tokenizer, 502 slot server), unavailable or shedding (503), past its deadline (504)
GENERATION_STATUSES = ("400", "401", "408", "413", "429", "500", "502", "503", "504")
_DESCRIPTIONS = {
    "200": "the answer (a JSON document, or server-sent events when streamed)",
    "400": "the request is malformed or past a limit; the error names the field and the limit",
    "401": "no valid API key",
    "404": "no such model",
    "408": "the request did not arrive complete within --body-timeout",
    "413": "the body is larger than --max-body",
    "431": "the request's target and header fields take more than 16 KiB",
    "429": "refused at once (no slot, over the bound on waiting, quota, slot cap, tokenizer workers); Retry-After",
    "500": "the tokenizer failed",
    "502": "the slot server answered with an error status",
    "503": "no slot server is up, the edge is draining, or it sheds new work over its memory high-water mark",
    "504": "no result from the slot server in time",
    "529": "Anthropic's routes: no slot could be had now (429 no_slot or over_bound elsewhere)",
}


def document(limits: Limits, routes: Mapping[str, tuple[str, ...]], model: str | None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (path -> methods) as this edge serves them (``limits``: its body and
    slot capacities; ``model``: the model the OpenAI routes serve, None when they are not served)."""
    schemas = _schemas(limits, model)
    operations = {
        GENERATE: _post("Generate from a prompt or token ids", "GenerateRequest", "Generated", "EdgeError", True),
        TOKENIZE: _post("Token ids of a prompt", "TokenizeRequest", "Tokenized", "EdgeError", False),
        COMPLETIONS: _post("OpenAI completions", "CompletionRequest", "OpenAIAnswer", "OpenAIError", True, "404"),
        CHAT: _post("OpenAI chat completions", "ChatRequest", "OpenAIAnswer", "OpenAIError", True, "404"),
        RESPONSES: _post("OpenAI responses", "ResponsesRequest", "Response", "OpenAIError", True, "404"),
        MESSAGES: _post("Anthropic messages", "MessagesRequest", "Message", "AnthropicError", True, "404", "529"),
        COUNT_TOKENS: _post("Anthropic token count", "MessagesRequest", "TokenCount", "AnthropicError", False, "404"),
        LLAMA_TOKENIZE: _post("llama-server's tokenize", "LlamaTokenizeRequest", "LlamaTokens", "LlamaError", False),
        LLAMA_DETOKENIZE: _post(
            "llama-server's detokenize", "LlamaDetokenizeRequest", "LlamaContent", "LlamaError", False
        ),
        MODELS: _get("The served model", _json("Models"), _errors(("401",), "OpenAIError")),
        HEALTH: _get("Slot servers, free slots, live latency", _json("Health"), _unready(("400", "401"))),
        LIVE: _get("Liveness: the edge process answers", _json("Health"), _errors(("401",), "EdgeError")),
        READY: _get("Readiness: a slot server is up", _json("Health"), _unready(("401",))),
        METRICS: _get(
            "Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}, _errors(("401",), "EdgeError")
        ),
        OPENAPI: _get("This document", {"application/json": {"schema": {"type": "object"}}}, {}),
    }
    paths: dict[str, Any] = {}
    for path, methods in routes.items():
        if path in (COMPLETIONS, CHAT, MODELS, RESPONSES, MESSAGES, COUNT_TOKENS) and model is None:
            continue
        operation = operations[path]
        error = {
            COMPLETIONS: "OpenAIError", CHAT: "OpenAIError", MODELS: "OpenAIError", RESPONSES: "OpenAIError",
            LLAMA_TOKENIZE: "LlamaError", LLAMA_DETOKENIZE: "LlamaError",
        }.get(path, "AnthropicError" if path in (MESSAGES, COUNT_TOKENS) else "EdgeError")  # fmt: skip
        operation["responses"].update(_errors(("431",), error))  # a head past 16 KiB, on any route
        paths[path] = {method.lower(): operation for method in methods}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "edgepath",
            "version": "1",
            "description": "An edge-to-GPU ingress data path for LLM serving: edgepath's own routes and OpenAI's "
            f"(bodies at most {limits.max_body} bytes, nested at most {JSON_DEPTH_MAX} deep; docs/API.md lists every "
            "limit)",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _unready(statuses: tuple[str, ...]) -> dict[str, Any]:
    """The errors of a health page, and its 503: no slot server is up (its body says why, in the page's shape)."""
    return {
        **_errors(statuses, "EdgeError"),
        "503": {"description": "no slot server is up", "content": _json("Health")},
    }


def _errors(statuses: tuple[str, ...], error: str) -> dict[str, Any]:
    return {
        status: {"description": _DESCRIPTIONS[status], "content": {"application/json": {"schema": _ref(error)}}}
        for status in statuses
    }


def _post(summary: str, request: str, answer: str, error: str, generates: bool, *more: str) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": _ref(answer)}}
    if generates:
        ok["text/event-stream"] = {"schema": {"type": "object"}}  # each event: its data, and its name
    statuses = GENERATION_STATUSES if generates else ("400", "401", "408", "413", "429", "500", "503")
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": _DESCRIPTIONS["200"], "content": ok},
            **_errors((*more, *statuses), error),
        },
    }


def _get(summary: str, content: dict[str, Any], errors: dict[str, Any]) -> dict[str, Any]:
    return {"summary": summary, "responses": {"200": {"description": "the page", "content": content}, **errors}}


def _schemas(limits: Limits, model: str | None) -> dict[str, Any]:
    vocab, output = limits.vocab_size, limits.output_capacity
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    sampling = {
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": 0, "maximum": TOP_K_MAX},
        "seed": {"type": ["integer", "null"], "minimum": SEED_MIN, "maximum": SEED_MAX},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "presence_penalty": {"type": ["number", "null"], "minimum": -PENALTY_MAX, "maximum": PENALTY_MAX},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -PENALTY_MAX, "maximum": PENALTY_MAX},
        "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": REPETITION_MAX},
        "repeat_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": REPETITION_MAX},
        "logit_bias": {
            "type": ["object", "null"],
            "maxProperties": LOGIT_BIAS_MAX,
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -BIAS_MAX, "maximum": BIAS_MAX},
        },
        "ignore_eos": {"type": ["boolean", "null"]},
        "cache_salt": {"type": ["string", "null"], "minLength": 1, "maxLength": CACHE_SALT_MAX},
    }
    stop = {
        "anyOf": [
            {"type": "string", "minLength": 1, "maxLength": STOP_CHARS_MAX},
            {
                "type": "array",
                "maxItems": STOPS_MAX,
                "items": {"type": "string", "minLength": 1, "maxLength": STOP_CHARS_MAX},
            },
            {"type": "null"},
        ]
    }
    openai_common = {
        "model": {"type": "string", **({"enum": [model]} if model else {})},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": output},
        "stream": {"type": ["boolean", "null"]},
        "stop": stop,
        "n": {"type": ["integer", "null"], "minimum": 1},
        **sampling,
    }
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant", "tool"]},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        },
                    },
                    {"type": "null"},
                ]
            },
        },
    }
    error_body = {"type": "object", "required": ["type", "message"]}
    return {
        "GenerateRequest": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "prompt": {"type": "string", "minLength": 1},
                "tokens": ids,
                "max_tokens": {"type": "integer", "minimum": 1, "maximum": output},
                "stream": {"type": "boolean"},
                **sampling,
            },
            "oneOf": [{"required": ["prompt"]}, {"required": ["tokens"]}],
        },
        "TokenizeRequest": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"prompt": {"type": "string", "minLength": 1}, "tokens": ids},
            "oneOf": [{"required": ["prompt"]}, {"required": ["tokens"]}],
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                **openai_common,
                "prompt": {"anyOf": [{"type": "string", "minLength": 1}, ids]},
                "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
            },
        },
        "ChatRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **openai_common,
                "messages": {"type": "array", "minItems": 1, "maxItems": MESSAGES_MAX, "items": message},
                "tools": {"type": ["array", "null"], "maxItems": TOOLS_MAX},
                "logprobs": {"type": ["boolean", "null"]},
                "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": TOP_LOGPROBS_MAX},
            },
        },
        "ResponsesRequest": {
            "type": "object",
            "required": ["model", "input"],
            "properties": {"input": {"maxItems": MESSAGES_MAX}},  # a string, or at most this many items
        },
        "LlamaTokenizeRequest": {
            "type": "object",
            "additionalProperties": False,
            "required": ["content"],
            "properties": {
                "content": {"type": "string"},
                "add_special": {"type": ["boolean", "null"]},
                "parse_special": {"type": ["boolean", "null"]},
                "with_pieces": {"type": ["boolean", "null"]},
            },
        },
        "LlamaDetokenizeRequest": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"tokens": {**ids, "minItems": 0}},
        },
        "LlamaTokens": {"type": "object", "required": ["tokens"]},
        "LlamaContent": {"type": "object", "required": ["content"]},
        "LlamaError": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["code", "message", "type"]}},
        },
        "MessagesRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {"messages": {"type": "array", "maxItems": MESSAGES_MAX}},
        },
        "Message": {"type": "object", "required": ["id", "type"]},
        "Response": {"type": "object", "required": ["id", "object"]},
        "TokenCount": {"type": "object", "required": ["input_tokens"]},
        "AnthropicError": {
            "type": "object",
            "required": ["type", "error"],
            "properties": {"error": {"type": "object", "required": ["type", "message"]}},
        },
        "Generated": {"type": "object", "required": ["id", "tokens", "text"]},
        "Tokenized": {"type": "object", "required": ["tokens", "count"]},
        "OpenAIAnswer": {"type": "object", "required": ["id", "object", "choices"]},
        "Models": {"type": "object", "required": ["object", "data"]},
        "Health": {"type": "object", "required": ["status"]},
        "EdgeError": {"type": "object", "required": ["error"], "properties": {"error": error_body}},
        "OpenAIError": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"]}},
        },
    }
