"""Tool calling, sans I/O: the fields checked (a 400 naming each bad one), the tools offered by the fallback
prompt, the calls' grammar, the conversation's calls and results written as text, and an answer read back as
calls -- whole and streamed, in the shapes the ``openai`` SDK reads."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.grammars import gbnf
from helpers.openai_mock import client_answering

from edgepath.contract import wire
from edgepath.edge.apis.openai import OpenAIError, OpenAILimits, parse_chat_request
from edgepath.edge.apis.openai_answers import Answer, TokenLogprob
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.apis.tools import ToolOutput, ToolSpec, calls_text, fallback_prompt, parse_tools, read_calls
from edgepath.edge.http import CHAT, Work
from edgepath.edge.text.chat import ChatMessage

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

MODEL = "m"
GRAMMARS = OpenAILimits(max_tokens=64, vocab_size=100, models=(MODEL,), grammars=True)
PLAIN = OpenAILimits(max_tokens=64, vocab_size=100, models=(MODEL,))
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"],
            "$defs": {"unit": {"enum": ["c", "f"]}},
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: takes none
TOOLS = [WEATHER, NOW]
HI = [{"role": "user", "content": "hi"}]


def chat(limits: OpenAILimits = GRAMMARS, messages: Any = None, **fields: Any) -> Any:
    return parse_chat_request({"model": MODEL, "messages": messages or HI, **fields}, limits)


def refused(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        chat(**fields)
    assert info.value.status == 400
    return info.value


def spec(**fields: Any) -> ToolSpec:
    got = parse_tools({"tools": TOOLS, **fields})
    assert got is not None
    return got


# -- the request ----------------------------------------------------------------------------------------


def test_tool_choice_each_way() -> None:
    assert spec().choice == "auto" and spec().parallel and spec().constrained is False
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None  # not offered
    assert parse_tools({}) is None and parse_tools({"tools": [], "tool_choice": "auto"}) is None
    required = spec(tool_choice="required", parallel_tool_calls=False)
    assert (required.choice, required.parallel, required.constrained) == ("required", False, True)
    named = spec(tool_choice={"type": "function", "function": {"name": "now"}})
    assert (named.choice, named.named, [t.name for t in named.offered]) == ("named", "now", ["now"])
    assert spec().tools[1].parameters == {"type": "object", "properties": {}}


def test_auto_offers_the_tools_and_constrains_nothing() -> None:
    req = chat(tools=TOOLS)
    assert req.constraint is None and req.tools is not None
    system = req.messages[0]
    assert system.role == "system" and req.messages[1:] == (ChatMessage("user", "hi"),)
    assert system.content == fallback_prompt(req.tools)
    for tool in TOOLS:  # each tool as JSON: name, description, schema
        listed = {"name": tool["function"]["name"], "description": tool["function"].get("description", "")}
        assert json.dumps(listed)[:-1] in system.content
    assert "If no tool is needed, answer in plain text" in system.content
    assert chat(tools=TOOLS, tool_choice="none").messages == (ChatMessage("user", "hi"),)  # none: not offered


def test_the_offer_joins_an_existing_system_turn() -> None:
    req = chat(messages=[{"role": "system", "content": "Be brief."}, *HI], tools=TOOLS, tool_choice="required")
    assert req.messages[0].content.startswith("Be brief.\n\nYou can call the following tools")
    assert "You must call at least one tool." in req.messages[0].content and len(req.messages) == 2


def test_required_and_named_are_enforced_by_a_grammar_of_calls() -> None:
    required = gbnf(chat(tools=TOOLS, tool_choice="required").constraint)
    assert required is not None and "root ::=" in required
    assert '"\\"get_weather\\""' in required and '"\\"now\\""' in required  # each name a constant
    assert 'unit ::= "\\"c\\"" | "\\"f\\""' in required  # the tool's own $defs, moved with it
    assert '("," space item)*' in required  # a list of calls
    one = gbnf(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).constraint)
    assert one is not None and '("," space item)*' not in one
    named = gbnf(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}).constraint)
    assert named is not None and '"\\"now\\""' in named and "get_weather" not in named


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"tools": {"a": 1}}, "tools", "must be a list"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function tools only"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [NOW, NOW]}, "tools[1].function.name", "given twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
         "tools[0].function.description", "must be a string"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools[0].function.parameters", "an object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]},
         "tools[0].function.parameters", "an object"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "allowed: 'none', 'auto', 'required'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "not one of the tools given: get_weather, now"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "true or false"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
          "n": {"type": "integer", "minimum": 1}}}}}], "tool_choice": "required"},
         "tools[0].function.parameters.properties.n.minimum", "'minimum' cannot be enforced"),
        ({"tools": [NOW, {"type": "function", "function": {"name": "g", "parameters": {"type": "object",
          "uniqueItems": True}}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tools[1].function.parameters.uniqueItems", "cannot be enforced"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         "cannot be combined with 'tools'"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_refused_naming_them(fields: dict[str, Any], param: str, needle: str) -> None:
    err = refused(**fields)
    assert err.param == param and needle in err.message, err.message


def test_a_schema_is_only_enforced_when_a_grammar_is_made() -> None:
    """``auto`` constrains nothing, so a keyword no grammar could enforce is no reason to refuse it."""
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": 1}}}]
    assert chat(tools=loose).tools is not None
    assert chat(PLAIN, tools=TOOLS).tools is not None  # auto needs no grammar from the model side
    err = refused(limits=PLAIN, tools=TOOLS, tool_choice="required")
    assert (err.param, err.code) == ("tool_choice", "unsupported_parameter")


# -- the conversation -----------------------------------------------------------------------------------

CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    ],
}


def test_calls_and_results_are_written_as_the_fallback_asks() -> None:
    messages = [*HI, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "3 C, rain"}]
    req = chat(messages=messages, tools=TOOLS)
    assert req.messages[2:] == (
        ChatMessage("assistant", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
        ChatMessage("user", "Result of the call call_1 to get_weather:\n3 C, rain"),
    )
    # with no tools offered the history is still written the same way
    assert chat(messages=messages).messages == (ChatMessage("user", "hi"), *req.messages[2:])


@pytest.mark.parametrize(
    ("messages", "param", "needle"),
    [
        ([*HI, {"role": "tool", "content": "x"}], "messages[1].tool_call_id", "must name the call"),
        ([*HI, {"role": "tool", "tool_call_id": "call_9", "content": "x"}], "messages[1].tool_call_id",
         "answers no call of an earlier assistant message"),
        ([*HI, CALLED, {"role": "tool", "tool_call_id": "call_1"}], "messages[2].content", "string or a list"),
        ([*HI, {"role": "user", "content": "x", "tool_calls": CALLED["tool_calls"]}], "messages[1].tool_calls",
         "only allowed on assistant messages"),
        ([*HI, {"role": "assistant", "tool_calls": "f()"}], "messages[1].tool_calls", "must be a list"),
        ([*HI, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}],
         "messages[1].tool_calls[0]", "arguments\": str (JSON)"),
    ],
)  # fmt: skip
def test_bad_tool_turns_are_refused_naming_the_message(messages: Any, param: str, needle: str) -> None:
    err = refused(messages=messages)
    assert err.param == param and needle in err.message, err.message


# -- the answer -----------------------------------------------------------------------------------------


def test_read_calls_takes_only_calls_to_offered_tools() -> None:
    s = spec()
    (call,) = read_calls(' [{"name": "now", "arguments": {}}] ', s, "call_x")
    assert (call.id, call.name, call.arguments) == ("call_x_0", "now", "{}")
    both = '[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    two = read_calls(both, s, "c")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in two] == [
        ("c_0", "now", {}),
        ("c_1", "get_weather", {"city": "Rome"}),
    ]
    assert calls_text(two) == both  # and back: the format the fallback asks for
    assert read_calls('{"name": "now", "arguments": {}}', s, "c")  # a single call, not in a list
    for text in [
        '[{"name": "other", "arguments": {}}]',
        '[{"name": "now", "arguments": "{}"}]',
        "[]",
        "[1]",
        '{"temperature": 18}',
        "Sunny",
        '[{"name": "now", "arguments": {}, "extra": 1}]',
        '[{"name": "now"',
    ]:
        assert read_calls(text, s, "c") == (), text  # fmt: skip
    single = spec(parallel_tool_calls=False)
    assert read_calls('[{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]', single, "c") == ()


def test_auto_releases_text_at_once_and_holds_what_may_be_calls() -> None:
    text = ToolOutput(spec(), "c")
    assert text.feed("  ") == "" and text.feed("The ") == "  The " and text.feed("sky") == "sky"
    assert text.finish() == ("", ())
    held = ToolOutput(spec(), "c")
    assert held.feed('[{"name": "now", ') == "" and held.feed('"arguments": {}}]') == ""
    rest, calls = held.finish()
    assert rest == "" and [c.name for c in calls] == ["now"]
    not_calls = ToolOutput(spec(), "c")
    assert not_calls.feed('{"temperature": 18}') == ""
    assert not_calls.finish() == ('{"temperature": 18}', ())
    required = ToolOutput(spec(tool_choice="required"), "c")
    assert required.feed("Well") == ""  # enforced: held to the end whatever it starts with
    assert required.finish() == ("Well", ())


class Chars:
    """A decoder whose token ids are characters' code points, so an answer's text is fed exactly."""

    def decode(self, ids: Any) -> str:
        return "".join(map(chr, ids))


def run(req: Any, text: str, reason: str = "stop") -> bytes:
    answer = Answer(req, Chars(), "ep7", 1700000000, prompt_tokens=5)
    out = answer.start()
    for ch in text:
        out += answer.feed([ord(ch)]).data
    return out + answer.finish(reason)  # type: ignore[arg-type]


CALLS = '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, {"name": "now", "arguments": {}}]'


def test_a_whole_answer_of_calls_in_openai_shape(client_for: Any) -> None:
    body = json.loads(run(chat(tools=TOOLS, tool_choice="required"), CALLS))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "call_ep7_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}},
        {"id": "call_ep7_1", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]  # fmt: skip
    got = client_for(200, json.dumps(body).encode(), b"application/json").chat.completions.create(
        model=MODEL, messages=HI, tools=TOOLS
    )
    assert [c.function.name for c in got.choices[0].message.tool_calls] == ["get_weather", "now"]
    cut = json.loads(run(chat(tools=TOOLS, tool_choice="required"), CALLS[:30], "length"))["choices"][0]
    assert (cut["finish_reason"], cut["message"]["content"]) == ("length", CALLS[:30])  # cut: the text, as it is
    plain = json.loads(run(chat(tools=TOOLS), "It is sunny."))["choices"][0]
    assert (plain["finish_reason"], plain["message"]["content"]) == ("stop", "It is sunny.")
    assert "tool_calls" not in plain["message"]


def test_a_streamed_answer_of_calls_as_openai_streams_them(client_for: Any) -> None:
    raw = run(chat(tools=TOOLS, stream=True, stream_options={"include_usage": True}), "  " + CALLS)
    chunks = list(
        client_for(200, raw, b"text/event-stream").chat.completions.create(
            model=MODEL, messages=HI, tools=TOOLS, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # held, then read as calls: no text sent
    pieces = [p for d in deltas for p in d.tool_calls or ()]
    heads = [(k, p.index, p.id, p.function.name, p.function.arguments) for k, p in enumerate(pieces) if p.id]
    assert [h[1:] for h in heads] == [(0, "call_ep7_0", "get_weather", ""), (1, "call_ep7_1", "now", "")]
    # then each call's arguments as they were written (a character a token here), before the next call's head
    first = [p.function.arguments for p in pieces[1 : heads[1][0]]]
    assert all(p.index == 0 and p.id is None for p in pieces[1 : heads[1][0]])
    assert first == list('{"city": "Oslo", "unit": "c"}')
    assert "".join(p.function.arguments for p in pieces[heads[1][0] + 1 :]) == "{}"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(CALLS) + 2
    text = run(chat(tools=TOOLS, stream=True), "Hi there")
    contents = [e["choices"][0]["delta"].get("content") for e in sse(text)[1:-2]]
    assert contents == list("Hi there")  # text streams as it comes: nothing held once it is not a call


def sse(raw: bytes) -> list[Any]:
    blocks = raw.decode().split("\n\n")[:-1]
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks]


@pytest.fixture
def client_for() -> Any:
    pytest.importorskip("openai")
    return client_answering


def test_held_tokens_keep_their_log_probabilities() -> None:
    """Entries of tokens held while they may be calls are sent with the calls' pieces, one per token."""
    limits = OpenAILimits(max_tokens=64, vocab_size=100, models=(MODEL,), logprobs=True, grammars=True)
    req = parse_chat_request({"model": MODEL, "messages": HI, "tools": TOOLS, "stream": True, "logprobs": True}, limits)
    answer = Answer(req, Chars(), "ep8", 1700000000, prompt_tokens=5)
    out = answer.start()
    text = '[{"name": "now", "arguments": {}}]'
    for ch in text:
        out += answer.feed([ord(ch)], [TokenLogprob(ch, -0.5)]).data
    evs = sse(out + answer.finish("stop"))
    entries = [e for ev in evs[1:-1] if ev["choices"][0]["logprobs"] for e in ev["choices"][0]["logprobs"]["content"]]
    assert "".join(e["token"] for e in entries) == text and {e["logprob"] for e in entries} == {-0.5}
    calls = [p for ev in evs[1:-1] for p in ev["choices"][0]["delta"].get("tool_calls") or ()]
    assert [p.get("id") for p in calls] == ["call_ep8_0", None, None]  # its head, then "{" and "}" as they came
    # the entries of the head's tokens go out just before it, those of each piece of its arguments before that piece
    chunks = [ev["choices"][0] for ev in evs[1:-1]]
    head = next(k for k, c in enumerate(chunks) if c["delta"].get("tool_calls"))
    before = [e["token"] for c in chunks[:head] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert "".join(before) == '[{"name": "now", "arguments": {'


def test_the_route_sends_the_calls_grammar_after_the_prompt() -> None:
    routes = OpenAIRoutes(MODEL, 256, 1000, ChatSupport(True), 0, grammars=True)
    body = {"model": MODEL, "messages": HI, "tools": TOOLS, "tool_choice": "required"}
    work = routes.parse(CHAT, json.dumps(body).encode())
    assert isinstance(work, Work) and work.grammar is work.options["openai"].constraint and work.grammar is not None
    assert wire.read_constraint(work.grammar.build()) == gbnf(work.options["openai"].constraint)
    assert work.options["messages"][0]["role"] == "system" and "get_weather" in work.options["messages"][0]["content"]
    auto = routes.parse(CHAT, json.dumps({**body, "tool_choice": "auto"}).encode())
    assert isinstance(auto, Work) and auto.grammar is None
