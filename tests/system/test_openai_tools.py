"""Tool calling with SmolLM2 through the ``openai`` SDK, over a real ``serve``: ``tool_choice`` required and a named
function are enforced by a grammar, so every answer is a valid call -- whole and streamed -- and a ``role: "tool"``
result sent back is answered; bad tool fields are a 400 naming the field, and the server serves on."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from helpers.edge import free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
openai = pytest.importorskip("openai", reason="the openai client is in the test extras")
pytestmark = pytest.mark.slow  # a served model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 32}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from edgepath.model.gguf import default_model_path

    gguf = str(default_model_path())
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(kind=socket.SOCK_STREAM), tokenizer=gguf),
        sizing=Sizing(slots=2, input_capacity=2048, output_capacity=160),  # the calls' grammar follows the prompt
        agent=AgentSettings(frames=8),
        handler=HandlerSettings("llama", (("model", gguf), ("threads", "1"))),
    )
    with running_edge(options, tmp_path_factory.mktemp("tools"), timeout=120.0) as edge:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{edge.port}/v1", api_key="unused", max_retries=0)


def model(client: Any) -> str:
    return str(client.models.list().data[0].id)


def valid(calls: list[Any], names: set[str]) -> None:
    """Each call names an offered tool, has an id, and its arguments are JSON valid against that tool's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, str]], str | None]:
    """The calls of a streamed answer put together by their indexes (as a client does), and the finish reason."""
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("choice", ["required", named("get_weather"), named("get_time")])
def test_an_enforced_tool_choice_yields_valid_calls(client: Any, choice: Any) -> None:
    names = {choice["function"]["name"]} if isinstance(choice, dict) else set(SCHEMAS)
    reply = client.chat.completions.create(
        model=model(client), messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    assert message.content is None
    valid(message.tool_calls, names)


def test_an_enforced_tool_choice_streams_its_calls(client: Any) -> None:
    choice = named("get_weather")
    chunks = list(
        client.chat.completions.create(
            model=model(client), messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    calls, reason = streamed_calls(chunks)
    assert reason == "tool_calls" and calls
    assert all(not (c.delta.content or "") for ch in chunks for c in ch.choices)  # calls, no text
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])
    one = client.chat.completions.create(
        model=model(client), messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0
    )
    # the same request whole: the same calls (greedy), and the stream put together is what the SDK reads
    assert [(c.function.name, c.function.arguments) for c in one.choices[0].message.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_one_call_when_parallel_tool_calls_is_off(client: Any) -> None:
    reply = client.chat.completions.create(
        model=model(client), messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=0,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(reply.choices[0].message.tool_calls) == 1
    valid(reply.choices[0].message.tool_calls, set(SCHEMAS))


def test_a_round_trip_the_tool_result_is_answered(client: Any) -> None:
    """The call comes back with the assistant's ``tool_calls`` and a ``role: "tool"`` result; the model answers
    the conversation (tool_choice none: in text), and ``auto`` on the same conversation is served too."""
    first = client.chat.completions.create(
        model=model(client), messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]
    answer = client.chat.completions.create(
        model=model(client), messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    auto = client.chat.completions.create(
        model=model(client), messages=conversation, tools=TOOLS, max_tokens=60, temperature=0, stream=True
    )
    chunks = list(auto)
    calls, reason = streamed_calls(chunks)
    text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    # auto: the model decides -- a text answer, or calls read back from its output
    assert (reason == "tool_calls" and calls and not text) or (reason in ("stop", "length") and text and not calls)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice.function.name"),
        ({"tools": {"get_weather": WEATHER}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
          {"n": {"type": "integer", "minimum": 1}}}}}], "tool_choice": "required"},
         "tools[0].function.parameters.properties.n.minimum"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [*QUESTION, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_a_400_naming_them_and_the_server_serves_on(client: Any, fields: Any, param: str) -> None:
    body = {"model": model(client), "messages": QUESTION, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == 400 and info.value.param == param
    ok = client.chat.completions.create(model=model(client), messages=QUESTION, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
