"""Tool-call arguments streamed as the model writes them (edge/apis/call_stream.py), in every call format and every
API shape: each call's head (id, name) first, then its arguments piece by piece, the pieces adding up to the
arguments of the whole answer -- checked by the SDKs' own stream accumulators (the ``openai`` SDK's
``chat.completions.stream`` and ``responses.stream``, the ``anthropic`` SDK's ``messages.stream``) against the
non-streamed answer, over a mocked transport carrying edgepath's bytes."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from helpers.openai_mock import client_answering
from helpers.tokenizers import CharTokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.edge.apis.anthropic import parse_messages
from edgepath.edge.apis.anthropic_answers import AnthropicFormatter
from edgepath.edge.apis.call_stream import CallDelta, CallScanner, argument_spans
from edgepath.edge.apis.conversation import ChatLimits
from edgepath.edge.apis.openai import OpenAILimits, parse_chat_request
from edgepath.edge.apis.openai_answers import Answer
from edgepath.edge.apis.responses import parse_response_request
from edgepath.edge.apis.responses_answers import ResponsesFormatter
from edgepath.edge.apis.tools import ToolOutput, ToolSpec, parse_tools, read_answer
from edgepath.edge.http import Outcome

MODEL = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
HI = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
# what a model writes: its own spacing, escapes, nesting and a brace inside a string
CALLS = (
    '[{"name": "get_weather", "arguments": {"city":"Paris \\"}\\" Nord",  "days": 3}},\n'
    ' {"name": "get_weather", "arguments": {"city": "Oslo", "n": [1, {"x": "]}"}]}}, {"name": "now", "arguments": {}}]'
)
HERMES = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'
)
LLAMA = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'


def spec(fmt: str = "fallback", **fields: Any) -> ToolSpec:
    parsed = parse_tools({"tools": TOOLS, **fields}, fmt)  # type: ignore[arg-type]
    assert parsed is not None
    return parsed


def keys(fmt: str) -> tuple[str, ...]:
    return ("parameters", "arguments") if fmt == "llama3-json" else ("arguments",)


def cuts(text: str, points: list[int]) -> list[str]:
    at = sorted({min(p, len(text)) for p in points})
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


def replay(out: ToolOutput, pieces: list[str]) -> tuple[list[CallDelta], str, Any]:
    """Feed ``pieces``; the deltas in order (the end's included), the text released, and the calls."""
    deltas, text = [], ""
    for piece in pieces:
        text += out.feed(piece)
        deltas += out.deltas()
    rest, calls = out.finish()
    return [*deltas, *out.deltas()], text + rest, calls


def assembled(deltas: list[CallDelta]) -> list[tuple[str | None, str | None, str]]:
    """Each call's id, name and arguments as a client's accumulator makes them; each head comes first."""
    calls: dict[int, list[Any]] = {}
    for d in deltas:
        if d.name is not None:
            assert d.index not in calls, "a call's head goes out once"
            calls[d.index] = [d.id, d.name, ""]
        calls[d.index][2] += d.arguments  # a KeyError: arguments before the head
    return [tuple(calls[k]) for k in sorted(calls)]  # type: ignore[misc]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([("fallback", CALLS), ("hermes", HERMES), ("llama3-json", LLAMA)]),
    st.lists(st.integers(0, 200), max_size=16),
    st.booleans(),
)
def test_the_pieces_add_up_to_the_calls_however_the_text_is_cut(
    case: tuple[str, str], points: list[int], required: bool
) -> None:
    fmt, text = case
    whole_text, whole = read_answer(text, spec(fmt), "c")
    deltas, released, calls = replay(ToolOutput(spec(fmt, tool_choice="required" if required else "auto"), "c"),
                                     cuts(text, points))  # fmt: skip
    assert calls == whole and whole
    assert assembled(deltas) == [(c.id, c.name, c.arguments) for c in whole]
    # Hermes' text before its first tag goes out at once (auto); the rest is what the whole answer has beside the calls
    assert released == ("Checking.\n" if fmt == "hermes" and not required else whole_text)
    # the arguments are the model's own text of them
    assert [c.arguments for c in whole] == [json.loads(s) if s.startswith('"') else s
                                            for s in argument_spans(text, fmt, keys(fmt)).values()]  # fmt: skip


def test_arguments_go_out_as_they_come_not_at_the_end() -> None:
    out = ToolOutput(spec(), "c")
    seen: list[list[CallDelta]] = []
    for ch in CALLS:
        out.feed(ch)
        seen.append(out.deltas())
    first = CALLS.index('{"city"')
    assert seen[first] == [CallDelta(0, "", "c_0", "get_weather"), CallDelta(0, "{")]  # head, then the brace
    assert seen[first + 1] == [CallDelta(0, '"')]
    closing = CALLS.index("}},\n")  # the first call's arguments close here
    assert "".join(d.arguments for step in seen[: closing + 1] for d in step) == CALLS[first : closing + 1]
    assert sum(1 for step in seen for d in step if d.index == 0 and d.arguments) > 10


def test_what_is_not_streamed_goes_out_whole_at_the_end() -> None:
    """Arguments before the name, and Hermes' arguments as a JSON string: their head and arguments at the end."""
    text = '[{"arguments": {"city": "Rome"}, "name": "get_weather"}]'
    deltas, _, calls = replay(ToolOutput(spec(), "c"), list(text))
    assert (
        deltas == [CallDelta(0, '{"city": "Rome"}', "c_0", "get_weather")] and calls[0].arguments == '{"city": "Rome"}'
    )
    hermes = replay(ToolOutput(spec("hermes"), "c"), list(HERMES))[0]
    assert hermes[-1] == CallDelta(1, '{"tz": "UTC"}', "c_1", "now")


def test_a_call_not_offered_is_not_streamed_and_the_answer_is_text() -> None:
    text = '[{"name": "launch", "arguments": {"at": 1}}]'
    deltas, released, calls = replay(ToolOutput(spec(), "c"), list(text))
    assert (deltas, released, calls) == ([], text, ())


def test_calls_cut_short_end_with_their_text_released() -> None:
    """Cut by max_tokens inside the arguments: the pieces sent stay sent, and the text is the answer's."""
    text = CALLS[: CALLS.index("Nord")]
    deltas, released, calls = replay(ToolOutput(spec(), "c"), list(text))
    assert calls == () and released == text
    assert assembled(deltas) == [("c_0", "get_weather", text[text.index('{"city"') :])]


def test_the_scanner_ignores_what_is_not_calls() -> None:
    for fmt, text in [("fallback", '"[{"'), ("fallback", "12"), ("hermes", "no <tool_ call> here <tool_c")]:
        assert CallScanner(fmt, ["now"], "c", keys(fmt)).feed(text) == []


# -- the three shapes, through the SDKs' accumulators --------------------------------------------------------------


def openai_chat(stream: bool, text: str) -> bytes:
    limits = OpenAILimits(max_tokens=256, vocab_size=100, models=(MODEL,))
    req = parse_chat_request({"model": MODEL, "messages": HI, "tools": TOOLS, "stream": stream}, limits)
    answer = Answer(req, CharTokenizer(), "ep7", 1700000000, prompt_tokens=5)
    out = answer.start()
    for ch in text:  # one token a character
        out += answer.feed([ord(ch)]).data
    return out + answer.finish("stop")


def test_openai_chat_streams_arguments_the_sdk_reassembles_as_the_whole_answer() -> None:
    whole = client_answering(200, openai_chat(False, CALLS), b"application/json").chat.completions.create(
        model=MODEL, messages=HI, tools=TOOLS
    )
    raw = openai_chat(True, CALLS)
    client = client_answering(200, raw, b"text/event-stream")
    with client.chat.completions.stream(model=MODEL, messages=HI, tools=TOOLS) as stream:
        pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    got = [(c.id, c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    assert got == [(c.id, c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert len(got) == 3 and final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    assert sum(1 for p in pieces if p.index == 0) > 10  # a multi-token argument: many deltas


def anthropic_client(body: bytes, content_type: bytes) -> Any:
    anthropic = pytest.importorskip("anthropic")
    base = pytest.importorskip("anthropic._base_client")
    httpx = getattr(base, "httpx2", None) or base.httpx  # the HTTP library the installed SDK is built on

    def handler(request: Any) -> Any:
        return httpx.Response(200, headers=[(b"content-type", content_type)], content=body)

    return anthropic.Anthropic(api_key="k", base_url="http://edgepath.test", max_retries=0,
                               http_client=httpx.Client(transport=httpx.MockTransport(handler)))  # fmt: skip


def chars(text: str) -> np.ndarray:
    """``text`` as CharTokenizer's ids: one per character."""
    return np.array([ord(c) for c in text], np.int32)


def formatted(fmt: AnthropicFormatter | ResponsesFormatter, stream: bool, text: str, done: Outcome) -> bytes:
    """``fmt``'s answer of ``text``: whole, or streamed one token at a time, then its end."""
    if not stream:
        return fmt.complete(done).body
    ids = chars(text)
    return b"".join(fmt.tokens(ids[i : i + 1]) for i in range(len(ids))) + fmt.end(done)


def anthropic_answer(stream: bool, text: str) -> bytes:
    tools = [{"name": "get_weather", "input_schema": WEATHER}, {"name": "now", "input_schema": {"type": "object"}}]
    doc = {"model": MODEL, "max_tokens": 256, "messages": HI, "tools": tools, "stream": stream}
    fmt = AnthropicFormatter(parse_messages(doc, ChatLimits(256, (MODEL,))), CharTokenizer(), "msg_ep7")
    return formatted(fmt, stream, text, Outcome(7, 11, chars(text), "STOP", 1))


def test_anthropic_streams_input_json_the_sdk_reassembles_as_the_whole_message() -> None:
    ask = {"model": MODEL, "max_tokens": 256, "messages": HI}
    whole = anthropic_client(anthropic_answer(False, CALLS), b"application/json").messages.create(**ask)
    client = anthropic_client(anthropic_answer(True, CALLS), b"text/event-stream")
    with client.messages.stream(**ask) as stream:
        pieces = [e for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    uses = [(b.id, b.name, b.input) for b in final.content]
    assert uses == [(b.id, b.name, b.input) for b in whole.content] and len(uses) == 3
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert uses[0][2] == {"city": 'Paris "}" Nord', "days": 3}
    assert len(pieces) > 20  # many input_json_delta events, not one per call


def responses_answer(stream: bool, text: str) -> bytes:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}, {"type": "function", "name": "now"}]
    req = parse_response_request({"model": MODEL, "input": "hi", "tools": tools, "stream": stream},
                                 ChatLimits(256, (MODEL,)))  # fmt: skip
    fmt = ResponsesFormatter(req, CharTokenizer(), "ep1", 0)
    return formatted(fmt, stream, text, Outcome(1, 3, chars(text), "STOP", 1))


def test_responses_streams_function_call_arguments_the_sdk_reassembles_as_the_whole_response() -> None:
    whole = client_answering(200, responses_answer(False, CALLS), b"application/json").responses.create(
        model=MODEL, input="hi"
    )
    client = client_answering(200, responses_answer(True, CALLS), b"text/event-stream")
    with client.responses.stream(model=MODEL, input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    got = [(i.call_id, i.name, i.arguments) for i in final.output if i.type == "function_call"]
    assert got == [(i.call_id, i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert len(got) == 3
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [a for _, _, a in got] and sum(1 for d in deltas if d.output_index == 0) > 10
