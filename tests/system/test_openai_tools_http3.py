"""A tool-calling round trip over HTTP/3, with a client that is not ours (libcurl through ``curl_cffi``), against a
real ``serve --transport quic`` with SmolLM2: an enforced call (whole and streamed), then the conversation sent
back with the assistant's ``tool_calls`` and a ``role: "tool"`` result, answered.

Twice: with SmolLM2's own template, which has no place for tools (the fallback prompt, a JSON list of calls), and
with Qwen2.5-Instruct's template given by ``--chat-template`` -- same ChatML markers as SmolLM2's, so the model
reads it -- which renders the tools, the call and the result itself and asks for Hermes' ``<tool_call>`` blocks,
the format the call's grammar then enforces and the edge reads back (tests/edge/test_edge_tool_templates.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from helpers.edge import RunningEdge, free_port, running_edge
from helpers.templates import template_path

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.tls import default_certificate

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
pytest.importorskip("curl_cffi", reason="libcurl's HTTP/3 client (curl_cffi) is a bench dependency")
pytestmark = pytest.mark.slow  # a served model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module", params=["fallback", "qwen2.5-template"])
def edge(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    from edgepath.model.gguf import default_model_path

    gguf = str(default_model_path())
    template = str(template_path("Qwen-Qwen2.5-7B-Instruct.jinja")) if request.param == "qwen2.5-template" else None
    options = ServeOptions(
        edge=EdgeSettings(transport="quic", port_asked=free_port(), tokenizer=gguf, chat_template=template),
        sizing=Sizing(slots=2, input_capacity=2048, output_capacity=160),  # the calls' grammar follows the prompt
        agent=AgentSettings(frames=8),
        handler=HandlerSettings("llama", (("model", gguf), ("threads", "1"))),
    )
    with running_edge(options, tmp_path_factory.mktemp("tools-h3"), timeout=120.0) as running:
        yield running


def post(edge: RunningEdge, body: dict[str, Any]) -> Any:
    from curl_cffi import CurlHttpVersion, requests

    r = requests.post(
        f"https://localhost:{edge.port}/v1/chat/completions", json=body, http_version=CurlHttpVersion.V3ONLY,
        verify=str(default_certificate()), timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r


def model(edge: RunningEdge) -> str:
    from curl_cffi import CurlHttpVersion, requests

    r = requests.get(
        f"https://localhost:{edge.port}/v1/models", http_version=CurlHttpVersion.V3ONLY,
        verify=str(default_certificate()), timeout=30,
    )  # fmt: skip
    return str(r.json()["data"][0]["id"])


def streamed(raw: bytes) -> tuple[str, list[dict[str, str]], str | None]:
    """A chat stream's text, its calls put together by index (as a client does), and its finish reason."""
    text, calls, reason = "", {}, None
    for block in raw.decode().split("\n\n"):
        if not block.startswith("data: {"):
            continue
        for choice in json.loads(block[6:])["choices"]:
            reason = choice.get("finish_reason") or reason
            text += choice["delta"].get("content") or ""
            for piece in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(piece["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.get("id") or ""
                call["name"] += piece["function"].get("name") or ""
                call["arguments"] += piece["function"].get("arguments") or ""
    return text, [calls[i] for i in sorted(calls)], reason


def test_a_tool_call_round_trip_over_http3(edge: RunningEdge) -> None:
    body = {
        "model": model(edge), "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 120,
        "temperature": 0, "parallel_tool_calls": False,  # one call (SmolLM2 under Hermes' grammar makes several)
    }  # fmt: skip
    whole = post(edge, body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None, whole
    (call,) = whole["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])

    text, calls, reason = streamed(post(edge, {**body, "stream": True}).content)
    assert reason == "tool_calls" and not text
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call["function"]["arguments"])]

    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]
    answer = post(edge, {**body, "messages": conversation, "tool_choice": "none", "max_tokens": 40}).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"]
    assert "tool_calls" not in choice["message"]
    assert answer["usage"]["prompt_tokens"] > 0
