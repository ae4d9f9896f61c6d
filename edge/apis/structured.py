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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgepath.edge.apis.limits import LimitExceeded, SchemaBudget

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


def grammar_for(response_format: Any) -> str | None:
    """The GBNF grammar ``response_format`` asks for (None: plain text); FormatRefused says what is wrong."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise FormatRefused("response_format", f"'response_format' must be an object, got {_show(response_format)}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    from llama_cpp import llama_grammar  # the model extra: a server that enforces grammars runs llama.cpp

    if kind == "json_object":
        return llama_grammar.JSON_GBNF
    if kind != "json_schema":
        raise FormatRefused(
            "response_format.type",
            f"'response_format.type' = {_show(kind)} is not supported; allowed: text, json_object, json_schema",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
        raise FormatRefused(
            "response_format.json_schema",
            f"'response_format.json_schema' must be an object with 'name' and 'schema' (an object), got {_show(spec)}",
        )
    return schema_grammar(spec["schema"], "response_format.json_schema.schema")


def schema_grammar(schema: Mapping[str, Any], where: str) -> str:
    """The GBNF grammar of JSON valid against ``schema`` (checked first: FormatRefused names what cannot be
    enforced, ``where`` being the schema's place in the request); tool calls' grammars are made here too."""
    import json

    from llama_cpp import llama_grammar

    check_schema(schema, where, schema)
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
