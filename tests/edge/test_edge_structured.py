"""``response_format`` to a grammar: what a schema asks for is enforced, or the request is refused naming the
keyword (never a grammar that enforces less than asked)."""

from __future__ import annotations

from typing import Any

import pytest

from edgepath.edge.apis.openai import OpenAIError, OpenAILimits, parse_chat_request

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
from helpers.grammars import gbnf, grammar_for

from edgepath.edge.apis.structured import FormatRefused

MODEL = "m"
GRAMMARS = OpenAILimits(max_tokens=64, vocab_size=100, models=(MODEL,), grammars=True)
PLAIN = OpenAILimits(max_tokens=64, vocab_size=100, models=(MODEL,))


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def chat(limits: OpenAILimits, response_format: Any) -> Any:
    return parse_chat_request(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": response_format}, limits
    )


MIXED = {
    "type": "object",
    "title": "Order",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "status": {"enum": ["open", "paid", "shipped"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},
        "when": {"type": "string", "format": "date"},
    },
    "required": ["id", "items", "status"],
    "additionalProperties": False,
    "$defs": {
        "item": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "count": {"type": "integer"}},
            "required": ["sku", "count"],
        }
    },
}


def test_a_schema_with_what_the_grammar_enforces_becomes_one() -> None:
    grammar = grammar_for(schema_format(MIXED))
    assert grammar is not None and "root ::=" in grammar and '"\\"status\\""' in grammar
    assert gbnf(chat(GRAMMARS, schema_format(MIXED)).constraint) == grammar
    assert "object" in (grammar_for({"type": "json_object"}) or "")
    assert grammar_for({"type": "text"}) is None and chat(GRAMMARS, {"type": "text"}).constraint is None


@pytest.mark.parametrize(
    ("schema", "where", "says"),
    [
        ({"type": "integer", "minimum": 0}, "schema.minimum", "'minimum' cannot be enforced"),
        (
            {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
            "schema.properties.a.uniqueItems",
            "'uniqueItems' cannot be enforced",
        ),
        ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "schema.anyOf[1].not", "'not'"),
        ({"type": "string", "format": "email"}, "schema.format", "formats enforced: date"),
        ({"$ref": "https://example.com/s.json"}, "schema.$ref", "within the schema"),
        ({"type": "decimal"}, "schema.type", "one of string, number"),
        ({"type": "object", "properties": []}, "schema.properties", "an object of schemas"),
        ({"anyOf": []}, "schema.anyOf", "non-empty list"),
    ],
)
def test_a_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(schema: Any, where: str, says: str) -> None:
    with pytest.raises(OpenAIError) as info:
        chat(GRAMMARS, schema_format(schema))
    assert (info.value.status, info.value.param) == (400, f"response_format.json_schema.{where}")
    assert says in info.value.message


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format.json_schema"),
    ],
)
def test_a_malformed_response_format_is_a_400_naming_where(response_format: Any, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        chat(GRAMMARS, response_format)
    assert (info.value.status, info.value.param) == (400, param)


def test_a_model_side_without_grammars_refuses_them_by_name() -> None:
    with pytest.raises(OpenAIError) as info:
        chat(PLAIN, {"type": "json_object"})
    assert (info.value.status, info.value.param, info.value.code) == (400, "response_format", "unsupported_parameter")
    assert chat(PLAIN, {"type": "text"}).constraint is None


def test_the_checker_walks_every_place_a_schema_can_hold_another() -> None:
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {"allOf": [{"maxProperties": 1}]}}}}
    with pytest.raises(FormatRefused) as info:
        grammar_for(schema_format(nested))
    assert info.value.param.endswith("properties.a.items.allOf[0].maxProperties")


@pytest.mark.parametrize("string", [{"type": "string"}, {"type": "string", "maxLength": 8}])
def test_a_string_may_not_hold_raw_control_characters(string: dict[str, Any]) -> None:
    """JSON strings cannot hold raw control characters; llama-cpp-python's converter allowed them (SmolLM2 put a
    raw newline in one), so its character rule is replaced with JSON's, as llama.cpp's own converter has it."""
    grammar = grammar_for(schema_format({"type": "object", "properties": {"s": string}, "required": ["s"]}))
    assert grammar is not None
    (rule,) = [line for line in grammar.splitlines() if line.startswith("char ::=")]
    assert rule.startswith('char ::= [^"\\\\\\x7F\\x00-\\x1F] |')
