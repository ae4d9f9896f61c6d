"""The pre-admission budget (edge/apis/limits.py): every field's limit is a 400 naming it, and the checks that enforce
the limits never recurse, never expand and never build what they bound (issue 49)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.grammars import grammar_for
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.edge.apis.anthropic import AnthropicError, parse_messages
from edgepath.edge.apis.conversation import ChatLimits
from edgepath.edge.apis.limits import (
    JSON_CONTAINERS_MAX,
    JSON_DEPTH_MAX,
    MESSAGES_MAX,
    SCHEMA_DEPTH_MAX,
    SCHEMA_REPEAT_MAX,
    check_json,
    json_depth,
    json_shape,
    pattern_size,
)
from edgepath.edge.apis.openai import OpenAIError, OpenAILimits, parse_chat_request
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.apis.responses import parse_response_request
from edgepath.edge.apis.structured import FormatRefused
from edgepath.edge.http import CHAT, COMPLETIONS, GENERATE, TOKENIZE, Limits, Request, Response
from edgepath.edge.routes import HttpCore
from edgepath.edge.text.stop import StopMatcher, automaton

MODEL = "m"
LIMITS = Limits(max_body=1 << 20, input_capacity=64, output_capacity=32, vocab_size=1000)
CORE = HttpCore(LIMITS, openai=OpenAIRoutes(MODEL, 32, 1000, ChatSupport(True), 0, grammars=True))


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


tricky_text = st.text(alphabet='[]{}"\\ab', max_size=12)
documents = st.recursive(
    st.none() | st.integers() | tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky_text, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(documents)
def test_the_depth_scan_agrees_with_the_document(doc: Any) -> None:
    """Brackets, quotes and backslashes inside strings (escaped every way JSON can) do not count."""
    assert json_depth(json.dumps(doc).encode()) == _depth(doc)
    assert json_depth(json.dumps(doc, ensure_ascii=False).encode()) == _depth(doc)


def deep(depth: int) -> str:
    """JSON text nesting arrays ``depth`` deep (written out: the standard library cannot write it)."""
    return "[" * depth + '"x"' + "]" * depth


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (GENERATE, '{"prompt": "hi", "max_tokens": @}'),
        (TOKENIZE, '{"prompt": @}'),
        (COMPLETIONS, '{"model": "m", "prompt": "hi", "stop": @}'),
        (CHAT, '{"model": "m", "messages": [{"role": "user", "content": @}]}'),
        (CHAT, '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "extra": @}'),
    ],
)
@pytest.mark.parametrize("depth", [JSON_DEPTH_MAX + 1, 1000, 100_000])
def test_json_nested_deeper_than_the_limit_is_a_400_on_every_route(path: str, body: str, depth: int) -> None:
    """~1,000 levels made Python's parser (or a later walk) raise RecursionError and dropped the connection; now the
    body is refused before any shape reads it, in that route's error shape."""
    data = body.replace("@", deep(depth)).encode()
    answer = CORE.handle(Request("POST", path, [], data, t_receive_ns=1))
    assert isinstance(answer, Response) and answer.status == 400
    error = json.loads(answer.body)["error"]
    assert error.get("code", error.get("type")) == "json_too_deep"
    assert f"the limit is {JSON_DEPTH_MAX}" in error["message"]


def test_a_body_at_the_depth_limit_is_read() -> None:
    # metadata: a field OpenAI's routes take whatever it holds (it cannot change the answer)
    chat = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": '
    data = chat + deep(JSON_DEPTH_MAX - 1) + "}"
    assert json_depth(data.encode()) == JSON_DEPTH_MAX
    check_json(data.encode())
    answer = CORE.handle(Request("POST", CHAT, [], data.encode(), t_receive_ns=1))
    assert not isinstance(answer, Response)


def test_a_body_of_more_arrays_and_objects_than_the_limit_is_a_400_before_it_is_parsed() -> None:
    """A megabyte of ``[[],[],...]`` (340,000 lists) took 250 ms to parse, most of it the garbage collector's: the
    scan counts the containers, outside strings, before any parser makes them."""
    flat = '{"prompt": "hi", "x": [' + ",".join(["[]"] * 340_000) + "]}"
    assert json_shape(flat.encode()) == (3, 340_002)
    answer = CORE.handle(Request("POST", GENERATE, [], flat.encode(), t_receive_ns=1))
    assert isinstance(answer, Response) and answer.status == 400
    error = json.loads(answer.body)["error"]
    assert error["type"] == "json_too_many_values" and f"the limit is {JSON_CONTAINERS_MAX}" in error["message"]
    code = json.dumps({"prompt": "[]{}" * 100_000}).encode()  # brackets inside a string are text, not containers
    assert json_shape(code) == (1, 1)
    check_json(code)


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        ("abc", 3),
        ("a{100}", 100),
        ("(a{10}){10}", 100),
        ("[A-Z]{3}-[0-9]{2}", 6),
        ("x{2,}", 3),
        (r"\d{4}-\d{2}", 7),
        ("((a{100}){100}){100}", SCHEMA_REPEAT_MAX + 1),
    ],
)
def test_a_patterns_repetitions_are_counted_as_the_converter_writes_them(pattern: str, size: int) -> None:
    assert pattern_size(pattern) == size


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize(
    ("schema", "where", "says"),
    [
        ({"type": "string", "maxLength": 10**8}, "schema.maxLength", "add up to 100000000"),
        ({"type": "array", "items": {"type": "string"}, "minItems": 10**7}, "schema.minItems", "add up to"),
        ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "schema.pattern", f"at most {SCHEMA_REPEAT_MAX}"),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 1000} for i in range(5)}},
            "schema.properties.p4.maxLength",
            "add up to 5000",
        ),
        ("nested", "schema" + ".items" * (SCHEMA_DEPTH_MAX + 1), f"a schema may nest at most {SCHEMA_DEPTH_MAX}"),
    ],
)
def test_a_schemas_repetitions_are_bounded_before_its_grammar_is_built(schema: Any, where: str, says: str) -> None:
    """``maxLength`` 10^8 cost llama.cpp's converter seconds and 1.8 GB; the budget refuses it from the schema."""
    if schema == "nested":
        schema = {"type": "array", "items": {}}
        for _ in range(SCHEMA_DEPTH_MAX):
            schema = {"type": "array", "items": schema}
    with pytest.raises(FormatRefused) as info:
        grammar_for(schema_format(schema))
    assert info.value.param == f"response_format.json_schema.{where}" and says in info.value.message


def test_tools_share_one_budget_and_tool_choice_required_is_bounded_too() -> None:
    limits = OpenAILimits(max_tokens=32, vocab_size=1000, models=(MODEL,), grammars=True)
    tool = {"type": "object", "properties": {"s": {"type": "string", "maxLength": SCHEMA_REPEAT_MAX // 2 + 1}}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": tool}} for i in range(2)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    with pytest.raises(Exception) as info:
        parse_chat_request(body, limits)
    assert getattr(info.value, "status", None) == 400 and "add up to" in str(info.value)
    assert parse_chat_request({**body, "tools": tools[:1]}, limits).constraint is not None


def test_the_stop_matcher_grows_with_the_stop_strings_not_their_square() -> None:
    """Its automaton has one node per distinct prefix; the prefix set it replaced held the square of the length."""
    stop = "ab" * 16_000
    machine = automaton((stop,))
    assert len(machine.goto) == len(stop) + 1
    m = StopMatcher([stop])
    assert m.feed("x" + stop[:-1]).text == "x" and len(m.held) == len(stop) - 1
    assert m.feed(stop[-1]).stopped


def test_every_chat_shape_holds_a_chat_to_the_same_message_limit_in_its_own_400() -> None:
    """Messages and Responses take their chats' limit from the one module, as OpenAI's chat does: one message (item)
    past it is that shape's 400 naming the field and the limit; at the limit the chat is read."""
    turn = {"role": "user", "content": "hi"}
    reply = {"role": "assistant", "content": "ok"}
    chat = [turn, *([reply, turn] * (MESSAGES_MAX // 2))]  # ends with the user's turn, one past the limit
    assert len(chat) == MESSAGES_MAX + 1
    anthropic_limits = ChatLimits(8, (MODEL,))
    with pytest.raises(AnthropicError) as refused:
        parse_messages({"model": MODEL, "max_tokens": 8, "messages": chat}, anthropic_limits)
    error = refused.value.payload()["error"]
    assert refused.value.status == 400 and error["type"] == "invalid_request_error"
    assert error["message"] == f"messages: 'messages' holds {MESSAGES_MAX + 1} messages; at most {MESSAGES_MAX}"
    assert len(parse_messages({"model": MODEL, "max_tokens": 8, "messages": chat[1:]}, anthropic_limits).chat.messages)
    responses_limits = ChatLimits(8, (MODEL,))
    with pytest.raises(OpenAIError) as info:
        parse_response_request({"model": MODEL, "input": chat}, responses_limits)
    assert (info.value.status, info.value.param, info.value.code) == (400, "input", "limit_exceeded")
    assert f"'input' holds {MESSAGES_MAX + 1} items; at most {MESSAGES_MAX}" in info.value.message
    assert parse_response_request({"model": MODEL, "input": chat[1:]}, responses_limits).chat.messages


def test_calls_and_their_results_are_matched_across_a_chat_at_the_limit() -> None:
    """Every result answers an earlier call: checked against the set of ids made so far, kept as it grows (it was
    rebuilt from every earlier turn for each message, quadratic in the chat's length)."""
    calls = [
        {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}}]}
        for i in range(MESSAGES_MAX // 2)
    ]
    results = [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "r"}]}
        for i in range(MESSAGES_MAX // 2)
    ]
    chat = [m for pair in zip(calls, results, strict=True) for m in pair]
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    req = parse_messages({"model": MODEL, "max_tokens": 8, "messages": chat, "tools": tools}, ChatLimits(8, (MODEL,)))
    assert len(req.chat.messages) > MESSAGES_MAX // 2
    bad = [*chat[:-1], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t999999"}]}]
    with pytest.raises(AnthropicError, match="'t999999' answers no tool_use"):
        parse_messages({"model": MODEL, "max_tokens": 8, "messages": bad, "tools": tools}, ChatLimits(8, (MODEL,)))
