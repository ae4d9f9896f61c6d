"""Anthropic's Messages API and OpenAI's Responses API at the edge, sans I/O: requests read into the one chat path,
answers (whole and streamed) checked against the SDKs' own types (``anthropic.types``, ``openai.types.responses``),
errors in each shape, and -- through the lifecycle with a fake port -- the same admission, quotas and usage records
for every shape, and ``count_tokens`` that holds no frame."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pytest
from helpers.grammars import gbnf
from helpers.tokenizers import CharTokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from test_edge_lifecycle import TIMEOUT, Clock, FakePort, Respond, only

from edgepath.edge.apis.anthropic import AnthropicError, parse_messages
from edgepath.edge.apis.anthropic_answers import AnthropicFormatter, AnthropicRoutes
from edgepath.edge.apis.anthropic_answers import formatter_factory as anthropic_formatters
from edgepath.edge.apis.conversation import ChatLimits
from edgepath.edge.apis.openai import OpenAIError
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.apis.openai_routes import formatter_factory as openai_formatters
from edgepath.edge.apis.responses import parse_response_request
from edgepath.edge.apis.responses_answers import ResponsesFormatter, ResponsesRoutes
from edgepath.edge.apis.responses_answers import formatter_factory as responses_formatters
from edgepath.edge.http import CHAT, COUNT_TOKENS, MESSAGES, RESPONSES, HttpError, Limits, Outcome, Request, Work
from edgepath.edge.lifecycle import EdgeLifecycle, EndStream
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.refusals import Refusals
from edgepath.edge.routes import HttpCore
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.tenancy.gate import TenantGate
from edgepath.edge.tenancy.tenants import Tenant
from edgepath.edge.tenancy.usage import Usage
from edgepath.edge.text.chat import ChatTemplate

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is in the test extras")
openai = pytest.importorskip("openai", reason="the openai SDK is in the test extras")

MODEL = "m"
ALABAMA = [{"role": "user", "content": "hi"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
A_LIMITS = ChatLimits(64, (MODEL,))
R_LIMITS = ChatLimits(64, (MODEL,))


def messages(**fields: Any) -> Any:
    return parse_messages({"model": MODEL, "max_tokens": 64, "messages": ALABAMA, **fields}, A_LIMITS)


def refused_messages(**fields: Any) -> AnthropicError:
    with pytest.raises(AnthropicError) as info:
        messages(**fields)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def responses(**fields: Any) -> Any:
    return parse_response_request({"model": MODEL, "input": "hi", **fields}, R_LIMITS)


def refused_responses(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        responses(**fields)
    assert info.value.status == 400
    return info.value


# -- Anthropic: requests ------------------------------------------------------------------------------------------


def test_a_conversation_with_a_tool_round_trip_becomes_the_chat_the_template_renders() -> None:
    req = messages(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "A tool.", "signature": ""},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
        stop_sequences=["\n\nHuman:"], top_k=5, stream=True,
    )  # fmt: skip
    # the fallback (SmolLM2's template has no tools): calls and results written as plain turns
    turns = [(m.role, m.content) for m in req.chat.messages]
    assert turns == [
        ("system", "Be brief."),
        ("user", "Weather in Paris?"),
        ("assistant", 'Looking.\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
        ("user", "Result of the call toolu_1 to get_weather:\n18C"),
        ("user", "And tomorrow?"),
    ]
    assert req.stop == ("\n\nHuman:",) and req.sampling.top_k == 5 and req.stream
    assert req.sampling.temperature == 1.0  # Anthropic's default


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"frequency_penalty": 1}, "frequency_penalty: Extra inputs are not permitted"),
        ({"temperature": 1.5}, r"temperature: must be a number in [0, 1]"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 65}, "max_tokens: must be an integer in 1..64"),
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"messages": []}, "messages: must be a non-empty list"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name: Extra inputs"),
        ({"messages": [*ALABAMA, {"role": "assistant", "content": "Sure"}]}, "prefill"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]: content blocks of type 'image' are not supported",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, "tools[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
            "messages[0].content[0].tool_use_id: 'toolu_9' answers no tool_use",
        ),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema: Field required"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
        ({"tool_choice": {"type": "any"}}, "needs 'tools'"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice: must be"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
        ({"metadata": {"user": "x"}}, "metadata"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "no grammar"),
        ({"model": "claude"}, "model: 'claude' is not served"),
    ],
)
def test_a_bad_field_is_anthropics_400_naming_it(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(AnthropicError) as info:
        messages(**fields)
    assert needle in info.value.message, info.value.message
    assert info.value.status in (400, 404)
    body = anthropic.types.ErrorResponse.model_validate(json.loads(info.value.body()))
    assert body.error.type == ("not_found_error" if info.value.status == 404 else "invalid_request_error")


def test_tool_choice_maps_onto_the_one_tool_spec() -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}, {"name": "now", "input_schema": {}}]
    assert messages(tools=tools).chat.tools.choice == "auto"
    assert messages(tools=tools, tool_choice={"type": "none"}).chat.tools is None
    grammars = ChatLimits(64, (MODEL,), grammars=True)
    pytest.importorskip("llama_cpp", reason="grammars are made with llama.cpp's converter")
    doc = {"model": MODEL, "max_tokens": 16, "messages": ALABAMA, "tools": tools}
    any_ = parse_messages({**doc, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, grammars)
    assert any_.chat.tools.choice == "required" and not any_.chat.tools.parallel and any_.constraint
    one = parse_messages({**doc, "tool_choice": {"type": "tool", "name": "now"}}, grammars)
    assert one.chat.tools.named == "now" and one.constraint
    shaped = parse_messages(
        {**doc, "tools": None, "output_config": {"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}}},
        grammars,
    )
    assert shaped.constraint is not None and "city" in (gbnf(shaped.constraint) or "")


def test_refusals_for_want_of_a_slot_are_529_and_a_tenants_limits_429() -> None:
    refusals = Refusals(1)
    overloaded = AnthropicError.of(refusals.no_slot(1500))
    assert overloaded.status == 529 and overloaded.type == "overloaded_error"
    assert dict(overloaded.headers)[b"retry-after"] == b"2"
    capped = AnthropicError.of(refusals.over_cap(1))
    assert capped.status == 429 and capped.type == "rate_limit_error"
    assert AnthropicError.of(HttpError(504, "timeout", "late")).type == "timeout_error"
    assert AnthropicError.of(HttpError(401, "unauthorized", "no key")).type == "authentication_error"


# -- Anthropic: answers -------------------------------------------------------------------------------------------


def anthropic_answer(text: str, stream: bool, outcome: str = "STOP", **fields: Any) -> tuple[Any, list[Any]]:
    """The whole answer, or the stream's events (each validated as the SDK's event union) and the message the
    SDK's own accumulator makes of them."""
    from anthropic.lib.streaming._messages import accumulate_event
    from pydantic import TypeAdapter

    req = messages(stream=stream, **fields)
    fmt = AnthropicFormatter(req, CharTokenizer(), "msg_ep7")
    ids = np.array([ord(c) for c in text], np.int32)
    done = Outcome(7, 11, ids, outcome, 1, cached_tokens=4)
    if not stream:
        return anthropic.types.Message.model_validate(json.loads(fmt.complete(done).body)), []
    raw = fmt.tokens(ids[:5]) + fmt.tokens(ids[5:9]) + fmt.end(done)
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = adapter.validate_python(json.loads(data[6:])) if name != "event: ping" else None
        assert name == f"event: {json.loads(data[6:])['type']}"
        if event is not None:
            events.append(event)
    message, buffers = None, {}
    for event in events:
        message = accumulate_event(event=event, current_snapshot=message, json_bufs=buffers)
    return message, events


def blocks(message: Any) -> list[dict[str, Any]]:
    """A message's content blocks as the API sends them (the SDK's accumulator makes its Parsed* blocks)."""
    return [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in message.content]


def test_a_whole_and_a_streamed_message_say_the_same_in_anthropics_types() -> None:
    whole, _ = anthropic_answer("Paris is the capital.", False)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == "Paris is the capital."
    assert whole.stop_reason == "end_turn" and whole.id == "msg_ep7"
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens, whole.usage.output_tokens) == (7, 4, 21)
    streamed, events = anthropic_answer("Paris is the capital.", True)
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert [e.type for e in events][-2:] == ["message_delta", "message_stop"]
    assert blocks(streamed) == blocks(whole) and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == 21 and streamed.usage.input_tokens == 7


def test_stop_sequences_and_max_tokens_say_why_the_message_ended() -> None:
    cut, _ = anthropic_answer("one two\n\nHuman: three", False, stop_sequences=["\n\nHuman:"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "\n\nHuman:" and cut.content[0].text == "one two"
    long, _ = anthropic_answer("x" * 16, False, outcome="LENGTH")
    assert long.stop_reason == "max_tokens"
    paused, _ = anthropic_answer("half", False, outcome="RECLAIMED")
    assert paused.stop_reason == "pause_turn"  # cut short for a floor: send it back to go on


def test_a_tool_use_whole_and_streamed_with_input_json_deltas() -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}]
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    whole, _ = anthropic_answer(text, False, tools=tools)
    (use,) = whole.content
    assert whole.stop_reason == "tool_use" and use.type == "tool_use" and use.input == {"city": "Paris"}
    assert use.id == "toolu_ep7_0" and use.name == "get_weather"
    streamed, events = anthropic_answer(text, True, tools=tools)
    assert blocks(streamed) == blocks(whole) and streamed.stop_reason == "tool_use"
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)


def test_a_thinking_models_thought_is_a_thinking_block() -> None:
    from edgepath.edge.text.thinking import Thinking, ThinkingModes

    req = parse_messages(
        {"model": MODEL, "max_tokens": 64, "messages": ALABAMA, "stream": True},
        ChatLimits(64, (MODEL,), thinking=ThinkingModes(Thinking())),
    )
    fmt = AnthropicFormatter(req, CharTokenizer(), "msg_ep1")
    text = "<think>\nHmm.\n</think>\n\nHello."
    ids = np.array([ord(c) for c in text], np.int32)
    raw = fmt.tokens(ids[:12]) + fmt.end(Outcome(1, 3, ids, "STOP", 1))
    assert b'"thinking_delta","thinking":"Hmm."' in raw and b'"text_delta","text":"Hello."' in raw
    assert b"<think>" not in raw
    whole = AnthropicFormatter(parse_messages({**{"model": MODEL, "max_tokens": 64, "messages": ALABAMA}},
                                              ChatLimits(64, (MODEL,), thinking=ThinkingModes(Thinking()))),
                               CharTokenizer(), "msg_ep2").complete(Outcome(2, 3, ids, "STOP", 1))  # fmt: skip
    message = anthropic.types.Message.model_validate(json.loads(whole.body))
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "Hmm."), ("text", "Hello.")
    ]  # fmt: skip


# -- Responses: requests and answers ------------------------------------------------------------------------------


def test_input_items_become_the_chat_with_calls_and_their_outputs() -> None:
    req = responses(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use celsius."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        ],
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}],
        max_output_tokens=20, temperature=0.5,
    )  # fmt: skip
    roles = [m.role for m in req.chat.messages]
    assert roles == ["system", "system", "user", "assistant", "user"]  # the fallback writes calls as plain turns
    assert req.chat.messages[0].content.startswith("Be brief.")  # the tools offered after the instructions
    assert req.max_tokens == 20 and req.sampling.temperature == 0.5 and req.chat.tools.choice == "auto"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"input": [{"type": "input_image"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"max_output_tokens": 65}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"model": "gpt-5"}, "model"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"min_p": 0.1}, "min_p"),  # a chat route's field, not this one's: refused, never dropped
        ({"max_tokens": 5}, "max_tokens"),  # the chat routes' name for max_output_tokens
        ({"tempreature": 0.5}, "tempreature"),
    ],
)
def test_what_responses_cannot_do_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        responses(**fields)
    assert info.value.param == param, info.value.message
    assert info.value.status == (404 if param == "model" else 400)
    if param in ("min_p", "max_tokens", "tempreature"):
        assert info.value.code == "unknown_parameter" and f'"{param}"' in info.value.message


def test_responses_takes_the_fields_that_change_nothing() -> None:
    req = responses(user="u1", safety_identifier="s", prompt_cache_key="k", service_tier="auto", store=False,
                    truncation="disabled", include=[], reasoning=None, stream_options={"include_obfuscation": False},
                    text={"format": {"type": "text"}, "verbosity": None}, metadata={"a": "b"})  # fmt: skip
    assert req.model == MODEL and req.metadata == {"a": "b"}


def responses_answer(text: str, stream: bool, outcome: str = "STOP", **fields: Any) -> tuple[Any, list[Any]]:
    from pydantic import TypeAdapter

    req = responses(stream=stream, **fields)
    fmt = ResponsesFormatter(req, CharTokenizer(), "ep3", 1700000000)
    ids = np.array([ord(c) for c in text], np.int32)
    done = Outcome(3, 9, ids, outcome, 1, cached_tokens=2)
    if not stream:
        return openai.types.responses.Response.model_validate(json.loads(fmt.complete(done).body)), []
    raw = fmt.tokens(ids[:4]) + fmt.tokens(ids[4:]) + fmt.end(done)
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(b.split("\n")[1][6:])) for b in raw.decode().split("\n\n")[:-1]]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response, events


def test_a_whole_and_a_streamed_response_say_the_same_in_openais_types() -> None:
    whole, _ = responses_answer("Paris.", False)
    assert whole.output_text == "Paris." and whole.status == "completed" and whole.store is False
    assert whole.usage.input_tokens == 9 and whole.usage.input_tokens_details.cached_tokens == 2
    assert whole.usage.output_tokens == 6 and whole.usage.total_tokens == 15
    final, events = responses_answer("Paris.", True)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris."
    assert final.output == whole.output and final.usage == whole.usage
    cut, _ = responses_answer("x" * 5, False, "LENGTH", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_a_function_call_whole_and_streamed() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}]
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    whole, _ = responses_answer(text, False, tools=tools)
    (call,) = whole.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    final, events = responses_answer(text, True, tools=tools)
    assert final.output == whole.output
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(deltas)) == {"city": "Paris"}


# -- through the lifecycle: one submit path for every shape ------------------------------------------------------


class ChatChars(CharTokenizer):
    """One id per character, with SmolLM2's chat template (no place for tools)."""

    chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"

    def encode_chat_into(self, messages: list[dict[str, Any]], out: np.ndarray, **_: Any) -> int:
        return self.encode_into(ChatTemplate(self.chat_template).render(messages), out)


ACME = Tenant("acme", b"tenant:acme", tokens_per_minute=60)
BODIES = {
    CHAT: {"model": MODEL, "messages": ALABAMA, "max_tokens": 8},
    MESSAGES: {"model": MODEL, "messages": ALABAMA, "max_tokens": 8},
    RESPONSES: {"model": MODEL, "input": "hi", "max_output_tokens": 8},
}


def lifecycle(port: FakePort, records: list[Usage]) -> EdgeLifecycle:
    tokenizer = ChatChars()
    keys = ApiKeys.of_digests([(hashlib.sha256(b"k").digest(), ACME)])
    limits = Limits(1 << 20, 64, 64, tokenizer.vocab_size)
    chat = ChatSupport(True)
    shapes = {
        "anthropic": AnthropicRoutes(ChatLimits(64, (MODEL,)), True),
        "responses": ResponsesRoutes(ChatLimits(64, (MODEL,)), True),
    }
    core = HttpCore(limits, keys, OpenAIRoutes(MODEL, 64, 1000, chat, 0), shapes=shapes)
    formatters = {CHAT: openai_formatters(lambda: 0), MESSAGES: anthropic_formatters(),
                  RESPONSES: responses_formatters(lambda: 0)}  # fmt: skip
    gate = TenantGate(wall_clock=lambda: 0)
    gate.record = records.append  # type: ignore[method-assign]
    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
    return EdgeLifecycle(
        core, tokenizer, port, metrics, Clock(), workers=2, request_timeout_ns=TIMEOUT, formatters=formatters, gate=gate
    )


def post(path: str, body: dict[str, Any]) -> Request:
    return Request("POST", path, [(b"x-api-key", b"k")], json.dumps(body).encode(), t_receive_ns=0)


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
def test_every_shape_is_admitted_charged_and_logged_on_the_one_path(path: str) -> None:
    port, records = FakePort(), []
    edge = lifecycle(port, records)
    assert edge.receive(1, post(path, BODIES[path]), now=0) == []  # tokenized into a frame and submitted
    (frame,) = port.submitted
    prompt = int(port.frames.requests[frame]["token_count"])
    # the tenant's quota (60 tokens a minute) holds the prompt and max_tokens: a second request does not fit
    more = {"max_output_tokens" if path == RESPONSES else "max_tokens": 60}
    (refused,) = edge.receive(2, post(path, {**BODIES[path], **more}), now=0)
    assert isinstance(refused, Respond) and refused.response.status == 429
    error = json.loads(refused.response.body)
    if path == MESSAGES:
        assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error"
    else:
        assert error["error"]["code"] == "quota_exceeded"
    assert b"x-ratelimit-remaining-tokens" in dict(refused.response.headers)
    port.produce(frame, [104, 105])
    (answer,) = edge.deliveries([port.finish(frame)], now=1)
    assert isinstance(answer, Respond) and answer.response.status == 200
    body = json.loads(answer.response.body)
    (usage,) = records
    assert (usage.tenant, usage.route, usage.prompt_tokens, usage.completion_tokens) == ("acme", path, prompt, 2)
    assert usage.answer_id == body["id"] and usage.model == MODEL


def test_count_tokens_counts_the_chat_as_the_template_renders_it_and_holds_no_frame() -> None:
    port, records = FakePort(), []
    edge = lifecycle(port, records)
    (counted,) = edge.receive(1, post(COUNT_TOKENS, {"model": MODEL, "messages": ALABAMA, "system": "S"}), now=0)
    assert isinstance(counted, Respond) and counted.response.status == 200
    rendered = "<|system|>S<|user|>hi<|assistant|>"
    assert anthropic.types.MessageTokensCount.model_validate(json.loads(counted.response.body)).input_tokens == len(
        rendered
    )
    assert port.submitted == [] and not port.held and records == []  # no frame, no slot, nothing charged
    (bad,) = edge.receive(2, post(COUNT_TOKENS, {"model": MODEL, "messages": ALABAMA, "max_tokens": 3}), now=0)
    assert bad.response.status == 400 and json.loads(bad.response.body)["error"]["type"] == "invalid_request_error"


def test_a_streamed_message_ends_in_anthropics_events_through_the_lifecycle() -> None:
    port, records = FakePort(), []
    edge = lifecycle(port, records)
    edge.receive(1, post(MESSAGES, {**BODIES[MESSAGES], "stream": True}), now=0)
    (frame,) = port.submitted
    edge.deliveries([port.produce(frame, [104, 105])], now=1)
    actions = edge.deliveries([port.finish(frame)], now=2)
    (end,) = only(actions, EndStream)
    assert end.data.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert records[0].answer_id == "msg_ep1"


# -- hostile input: whatever arrives, each shape answers in its own error shape and never raises ------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=16,
)
KEYS = ["model", "messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences", "temperature",
        "input", "instructions", "max_output_tokens", "text", "stream", "thinking", "output_config"]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    path=st.sampled_from([MESSAGES, COUNT_TOKENS, RESPONSES]),
    doc=st.dictionaries(st.sampled_from(KEYS), json_values, max_size=3),
    with_model=st.booleans(),
)
def test_any_document_is_work_or_an_error_in_the_shapes_own_form(
    path: str, doc: dict[str, Any], with_model: bool
) -> None:
    """A valid body with up to three fields replaced by anything JSON can hold."""
    shape: Any = ResponsesRoutes(R_LIMITS, True) if path == RESPONSES else AnthropicRoutes(A_LIMITS, True)
    base = BODIES[MESSAGES if path == COUNT_TOKENS else path] if with_model else {}
    if path == COUNT_TOKENS:
        base = {k: v for k, v in base.items() if k != "max_tokens"}
    doc = {**base, **doc}
    result = shape.handle(path, "POST", json.dumps(doc).encode())
    if isinstance(result, Work):
        assert (result.options["messages"] and 1 <= result.max_tokens <= 64) or result.kind == "tokenize"
        return
    assert result.status in (400, 404)
    body = json.loads(result.body)
    if path == RESPONSES:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    else:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]


def test_a_thinking_models_thought_is_a_reasoning_item_with_its_tokens_counted() -> None:
    from pydantic import TypeAdapter

    from edgepath.edge.text.thinking import Thinking, ThinkingModes

    text = "<think>\nHmm.\n</think>\n\nHello."
    ids = np.array([ord(c) for c in text], np.int32)
    limits = ChatLimits(64, (MODEL,), thinking=ThinkingModes(Thinking()))
    whole = ResponsesFormatter(parse_response_request({"model": MODEL, "input": "hi"}, limits), CharTokenizer(),
                               "ep1", 0).complete(Outcome(1, 3, ids, "STOP", 1))  # fmt: skip
    response = openai.types.responses.Response.model_validate(json.loads(whole.body))
    reasoning, _ = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Hmm."
    assert response.output_text == "Hello."
    # one id per character: the thinking's ids are those up to the close tag (its white space included)
    assert response.usage.output_tokens_details.reasoning_tokens == text.index("</think>") + len("</think>")
    fmt = ResponsesFormatter(
        parse_response_request({"model": MODEL, "input": "hi", "stream": True}, limits), CharTokenizer(), "ep1", 0
    )
    raw = fmt.tokens(ids[:10]) + fmt.end(Outcome(2, 3, ids, "STOP", 1))
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(b.split("\n")[1][6:])) for b in raw.decode().split("\n\n")[:-1]]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Hmm."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello."
    assert events[-1].response.output == response.output
