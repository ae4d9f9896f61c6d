"""OpenAI's ``response_format`` as a grammar the model side enforces token by token, sans I/O.

``{"type": "json_object"}`` is any JSON object; ``{"type": "json_schema", "json_schema": {name, schema,
strict?}}`` is JSON valid against the schema.  Both become a GBNF grammar (llama.cpp's: the JSON grammar it
ships, or its JSON-schema converter, which llama-cpp-python carries as ``llama_cpp.llama_grammar``) that
travels to the slot after the prompt (:func:`edgepath.contract.wire.constraint_encoding`), where llama.cpp's
grammar sampler leaves only the tokens it allows.

A schema is checked before it is converted: a keyword the converter would ignore -- ``minimum``,
``uniqueItems``, ``not``, ... -- would leave the answer silently unconstrained in that respect, so it is a 400
naming the keyword and where it is, never a grammar that enforces less than asked (llama-server fails open:
llama.cpp #19051).  The check also bounds what the grammar costs to build (:mod:`edgepath.edge.apis.limits`): the
converter writes every repetition out (``maxLength`` 10^8 took it seconds and 1.8 GB), so a schema's nesting and its
repetitions are counted first, and a request past them is a 400 before anything is built.

Parsing a request checks its schema and gives a :class:`~edgepath.edge.http.Grammar` -- the schema's digest and how
to build it -- not the grammar itself: the lifecycle takes the words from its tenant's cache (edge/grammars.py) or has
a tokenizer worker build them, off the event loop, and only for a request no cheaper check refused.  Places are
named as the request has them (``where``: ``response_format``, ``text.format``, ``output_config.format``), at the
check and at the build alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import orjson

from edgepath.contract.wire import RequestInvalid, constraint_encoding
from edgepath.edge.apis.limits import LimitExceeded, SchemaBudget
from edgepath.edge.http import Grammar, HttpError

#: keywords the converter enforces
ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
        "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern", "minLength", "maxLength", "format",
    }
)  # fmt: skip
#: keywords that only describe or hold definitions: nothing to enforce
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions",
     "deprecated", "readOnly", "writeOnly"}
)  # fmt: skip
TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")
#: llama-cpp-python's converter lets a string hold raw control characters, which JSON does not allow (a newline
#: inside a string was seen from SmolLM2); llama.cpp's own converter has since excluded them, as this rule does
_LOOSE_CHAR, _JSON_CHAR = r'char ::= [^"\\] |', r'char ::= [^"\\\x7F\x00-\x1F] |'
#: sub-schemas by keyword: one schema, a list of them, or a map of them
_ONE, _LIST, _MAP = ("items", "additionalProperties"), ("prefixItems", "anyOf", "oneOf", "allOf"), ("properties",)


class FormatRefused(ValueError):
    """A ``response_format`` this server cannot enforce or does not understand; ``param`` names where."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def digest_of(*parts: Any) -> bytes:
    """The digest of what a grammar is built from (a schema and how it is used), whatever the order of its keys; a
    document orjson does not write (integers past 64 bits, NaN, unpaired surrogates: the standard library read it)
    is written by the standard library."""
    try:
        text = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        text = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(text).digest()


def deferred(digest: bytes, gbnf: Callable[[], str], param: str) -> Grammar:
    """A grammar whose GBNF ``gbnf`` makes when it is built (FormatRefused naming the place), encoded as the words
    that follow a prompt; ``param`` is named when it is too large to travel.  Building raises a 400
    :class:`HttpError` either way, for the lifecycle to answer in the request's shape."""

    def build() -> np.ndarray:
        try:
            return constraint_encoding(gbnf())
        except FormatRefused as exc:
            raise HttpError(400, "invalid_value", exc.message, param=exc.param) from None
        except RequestInvalid as exc:
            raise HttpError(400, "invalid_value", f"'{param}': the grammar is too large: {exc}", param=param) from None

    return Grammar(digest, build, param)


def grammar_of(response_format: Any, where: str = "response_format") -> Grammar | None:
    """The grammar ``response_format`` asks for, checked now and built later (None: plain text); FormatRefused says
    what is wrong.  ``where``: the request's name for it (its JSON schema sits at ``where.json_schema.schema``)."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise FormatRefused(where, f"'{where}' must be an object, got {_show(response_format)}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar(where)
    if kind != "json_schema":
        raise FormatRefused(
            f"{where}.type", f"'{where}.type' = {_show(kind)} is not supported; allowed: text, json_object, json_schema"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
        raise FormatRefused(
            f"{where}.json_schema",
            f"'{where}.json_schema' must be an object with 'name' and 'schema' (an object), got {_show(spec)}",
        )
    return schema_grammar(spec["schema"], f"{where}.json_schema.schema")


def json_object_grammar(where: str) -> Grammar:
    """Any JSON object: the grammar llama.cpp ships."""
    return deferred(digest_of("json_object"), _json_object, where)


def _json_object() -> str:
    from llama_cpp import llama_grammar  # the model extra: a server that enforces grammars runs llama.cpp

    return str(llama_grammar.JSON_GBNF)


def schema_grammar(schema: Mapping[str, Any], where: str) -> Grammar:
    """The grammar of JSON valid against ``schema``, checked now (FormatRefused names what cannot be enforced or
    is past a limit, ``where`` being the schema's place in the request) and built later."""
    check_schema(schema, where, schema)
    return deferred(digest_of("json_schema", schema), lambda: schema_gbnf(schema, where), where)


def schema_gbnf(schema: Mapping[str, Any], where: str) -> str:
    """The converter's GBNF for a checked ``schema`` (FormatRefused when the converter itself refuses it: a pattern
    it cannot read, a bad reference); tool calls' grammars are made from it too."""
    from llama_cpp import llama_grammar

    try:
        return str(llama_grammar.json_schema_to_gbnf(json.dumps(schema))).replace(_LOOSE_CHAR, _JSON_CHAR)
    except Exception as exc:  # the converter's own refusals (a pattern it cannot read, a bad reference)
        raise FormatRefused(where, f"the schema cannot be made a grammar: {exc or type(exc).__name__}") from None


def check_schema(schema: Any, where: str, root: Mapping[str, Any]) -> None:
    """Every keyword of ``schema`` (and of its sub-schemas) is one the grammar enforces, or an annotation; its
    nesting and its repetitions are within the limits (:mod:`edgepath.edge.apis.limits`)."""
    try:
        _check(schema, where, root, SchemaBudget(), 0)
    except LimitExceeded as exc:
        raise FormatRefused(exc.param, exc.message) from None


def _check(schema: Any, where: str, root: Mapping[str, Any], budget: SchemaBudget, depth: int) -> None:
    if isinstance(schema, bool):
        return  # true: anything; false is refused by the converter
    if not isinstance(schema, Mapping):
        raise FormatRefused(where, f"'{where}' must be a schema (an object), got {_show(schema)}")
    budget.depth(depth, where)
    budget.schema(schema, where)
    for key, value in schema.items():
        at = f"{where}.{key}"
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise FormatRefused(
                at,
                f"'{at}': the keyword {key!r} cannot be enforced by this server's constrained decoding, so it is "
                f"refused rather than ignored; enforced: {', '.join(sorted(ENFORCED))}",
            )
        if key == "type":
            types = value if isinstance(value, list) else [value]
            if not types or any(t not in TYPES for t in types):
                raise FormatRefused(
                    at, f"'{at}' must be one of {', '.join(TYPES)} (or a list of them), got {_show(value)}"
                )
        elif key == "format" and value not in FORMATS:
            raise FormatRefused(
                at, f"'{at}' = {_show(value)} cannot be enforced; formats enforced: {', '.join(FORMATS)}"
            )
        elif key == "$ref" and not (isinstance(value, str) and value.startswith("#/")):
            raise FormatRefused(at, f"'{at}' must be a reference within the schema ('#/...'), got {_show(value)}")
        elif key in _ONE and isinstance(value, Mapping | bool):
            _check(value, at, root, budget, depth + 1)
        elif key in _LIST:
            if not isinstance(value, list) or not value:
                raise FormatRefused(at, f"'{at}' must be a non-empty list of schemas, got {_show(value)}")
            for i, sub in enumerate(value):
                _check(sub, f"{at}[{i}]", root, budget, depth + 1)
        elif key in (*_MAP, "$defs", "definitions"):
            if not isinstance(value, Mapping):
                raise FormatRefused(at, f"'{at}' must be an object of schemas, got {_show(value)}")
            for name, sub in value.items():
                _check(sub, f"{at}.{name}", root, budget, depth + 1)
        elif key in _ONE:
            raise FormatRefused(at, f"'{at}' must be a schema (an object) or a boolean, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
