"""Anthropic's Messages API and OpenAI's Responses API with the SDKs people start from, against a real ``serve``
with SmolLM2 (``--transport tcp``: the SDKs speak HTTP/1.1), and one request of each shape over HTTP/3 (libcurl
through curl_cffi, on a ``--transport quic`` serve).

The ``anthropic`` SDK: ``messages.create`` and ``messages.stream`` (text, and a tool round trip), ``count_tokens``,
Anthropic's 400 for an unknown field or a value out of range, and a 429 (a tenant at its ``slot_cap``) the SDK
retries as it does against Anthropic.  The ``openai`` SDK's ``responses.create`` (streamed and not, a function
tool round trip, ``text.format`` json_schema) and the ``openai-agents`` SDK's ``Runner.run`` with one function
tool.  Every shape goes through the same admission, quotas, tenant cache and usage log: the usage log's lines equal
the answers' usage, and a second tenant sending the first's long system prompt reads nothing cached, per shape."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers.edge import RunningEdge, free_port, running_edge
from helpers.supervised import scrape

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.tls import default_certificate

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is in the test extras")
openai = pytest.importorskip("openai", reason="the openai SDK is in the test extras")
pytestmark = pytest.mark.slow  # a served model

KEYS = {"alpha": "key-alpha", "beta": "key-beta", "capped": "key-capped"}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
QUESTION = "What is the weather like in Paris today?"
# a long system prompt (~260 tokens) whose prefix the model side caches for the tenant that sent it
SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and in plain English without lists." for i in range(24))


@pytest.fixture(scope="module", autouse=True)
def tls_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("tls")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(state))
        mp.delenv("EDGEPATH_API_KEYS", raising=False)
        yield state


def _options(transport: str, tmp: Path) -> ServeOptions:
    from edgepath.model.gguf import default_model_path

    gguf = str(default_model_path())
    tenants = tmp / "tenants.toml"
    tenants.write_text(
        "".join(
            f'[tenants.{name}]\nkeys = ["sha256:{hashlib.sha256(key.encode()).hexdigest()}"]\n'
            + ("slot_cap = 1\n" if name == "capped" else "")
            for name, key in KEYS.items()
        )
    )
    port = free_port() if transport == "quic" else free_port(kind=socket.SOCK_STREAM)
    return ServeOptions(
        edge=EdgeSettings(
            transport=transport, port_asked=port, tokenizer=gguf, tenants_file=str(tenants),
            usage_log=str(tmp / "usage.jsonl"),
        ),
        sizing=Sizing(slots=2, input_capacity=2048, output_capacity=160),  # the calls' grammar follows the prompt
        agent=AgentSettings(frames=8),
        handler=HandlerSettings("llama", (("model", gguf), ("threads", "1"))),
    )  # fmt: skip


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    tmp = tmp_path_factory.mktemp("shapes")
    with running_edge(_options("tcp", tmp), tmp, timeout=120.0) as running:
        yield running


@pytest.fixture(scope="module")
def model(edge: RunningEdge) -> str:
    with urllib.request.urlopen(
        urllib.request.Request(f"http://127.0.0.1:{edge.port}/v1/models", headers={"x-api-key": KEYS["alpha"]})
    ) as r:
        return str(json.load(r)["data"][0]["id"])


def claude(edge: RunningEdge, tenant: str = "alpha", retries: int = 0) -> Any:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{edge.port}", api_key=KEYS[tenant], max_retries=retries)


def oai(edge: RunningEdge, tenant: str = "alpha") -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{edge.port}/v1", api_key=KEYS[tenant], max_retries=0)


def usage_lines(edge: RunningEdge) -> list[dict[str, Any]]:
    path = edge.options.edge.usage_log
    assert path is not None
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# -- Anthropic's Messages API ----------------------------------------------------------------------------------


def test_messages_create_answers_with_a_text_block_and_its_usage(edge: RunningEdge, model: str) -> None:
    message = claude(edge).messages.create(
        model=model, max_tokens=24, messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"temperature": 0}, metadata={"user_id": "u-1"},
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant" and message.model == model
    (block,) = message.content
    assert block.type == "text" and "Paris" in block.text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    counted = claude(edge).messages.count_tokens(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}]
    )
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    line = next(u for u in reversed(usage_lines(edge)) if u.get("answer_id") == message.id)
    assert line["route"] == "/v1/messages" and line["tenant"] == "alpha"
    assert line["completion_tokens"] == message.usage.output_tokens
    assert line["prompt_tokens"] == counted.input_tokens


def test_messages_stream_sends_anthropics_events_and_the_same_text(edge: RunningEdge, model: str) -> None:
    kinds = []
    with claude(edge).messages.stream(
        model=model, max_tokens=32, extra_body={"temperature": 0}, system="Be brief.",
        messages=[{"role": "user", "content": "Name three colours."}],
    ) as stream:  # fmt: skip
        texts = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                texts.append(event.text)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].type == "text" and final.content[0].text == "".join(texts) != ""
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    assert final.usage.input_tokens > 0


def test_a_tool_round_trip_with_the_anthropic_sdk(edge: RunningEdge, model: str) -> None:
    tools = [{"name": "get_weather", "description": "The current weather in a city.", "input_schema": WEATHER_SCHEMA}]
    asked = [{"role": "user", "content": QUESTION}]
    client = claude(edge)
    message = client.messages.create(
        model=model, max_tokens=120, extra_body={"temperature": 0}, tools=tools, messages=asked,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    with client.messages.stream(
        model=model, max_tokens=120, extra_body={"temperature": 0}, tools=tools, messages=asked,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [("get_weather", use.input)]
    answer = client.messages.create(
        model=model, max_tokens=40, extra_body={"temperature": 0}, tools=tools,
        messages=[
            *asked,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"temperature": 18})},
            ]},
        ],
    )  # fmt: skip
    assert answer.content and answer.content[0].type in ("text", "tool_use")


def test_an_unknown_field_or_a_value_out_of_range_is_anthropics_400(edge: RunningEdge, model: str) -> None:
    client = claude(edge)
    asked = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError, match="frequency_penalty: Extra inputs are not permitted") as info:
        client.messages.create(model=model, max_tokens=8, messages=asked, extra_body={"frequency_penalty": 1})
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match=r"temperature: must be a number in \[0, 1\]"):
        client.messages.create(model=model, max_tokens=8, messages=asked, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=model, max_tokens=1000, messages=asked)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-not-here", max_tokens=8, messages=asked)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=f"http://127.0.0.1:{edge.port}", api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=8, messages=asked
        )


def test_a_429_is_retried_by_the_anthropic_sdk(edge: RunningEdge, model: str) -> None:
    """The ``capped`` tenant may have one request in flight: a second one while a stream holds it gets 429
    ``rate_limit_error`` with ``retry-after``; the SDK (two retries, as by default) comes back and is answered."""
    before = _refused(edge)
    holding = threading.Event()

    def hold() -> None:
        with claude(edge, "capped").messages.stream(
            model=model, max_tokens=48, messages=[{"role": "user", "content": "Tell me a story."}]
        ) as stream:
            for _ in stream:
                holding.set()

    worker = threading.Thread(target=hold)
    worker.start()
    assert holding.wait(60)
    message = claude(edge, "capped", retries=4).messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    worker.join(60)
    assert message.content is not None and _refused(edge) > before  # refused at least once, then answered


def _refused(edge: RunningEdge) -> float:
    text = scrape(edge.port, KEYS["alpha"])  # with keys configured, /metrics needs one (or the ops listener)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("edgepath_refusals_total") and 'reason="slot_cap"' in line
    )


# -- OpenAI's Responses API ----------------------------------------------------------------------------------


def test_responses_create_whole_and_streamed(edge: RunningEdge, model: str) -> None:
    client = oai(edge)
    whole = client.responses.create(
        model=model, input="What is the capital of France?", instructions="Answer in one sentence.",
        max_output_tokens=24, temperature=0,
    )  # fmt: skip
    assert whole.object == "response" and whole.status in ("completed", "incomplete") and "Paris" in whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0
    line = next(u for u in reversed(usage_lines(edge)) if u.get("answer_id") == whole.id)
    assert line["route"] == "/v1/responses" and line["completion_tokens"] == whole.usage.output_tokens
    with client.responses.stream(
        model=model, input="What is the capital of France?", instructions="Answer in one sentence.",
        max_output_tokens=24, temperature=0,
    ) as stream:  # fmt: skip
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert final.output_text == "".join(deltas) == whole.output_text  # temperature 0: the same answer


def test_a_function_tool_round_trip_and_a_json_schema_with_responses(edge: RunningEdge, model: str) -> None:
    client = oai(edge)
    tools = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
              "parameters": WEATHER_SCHEMA, "strict": True}]  # fmt: skip
    first = client.responses.create(
        model=model, input=QUESTION, tools=tools, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=120, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    answer = client.responses.create(
        model=model, tools=tools, tool_choice="none", max_output_tokens=40, temperature=0,
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 18})},
        ],
    )  # fmt: skip
    assert answer.output_text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    shaped = client.responses.create(
        model=model, input="Which city is the capital of France? Answer in JSON.", max_output_tokens=40,
        temperature=0, text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(shaped.output_text), schema)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="hi", previous_response_id="resp_1")


def test_the_agents_sdk_runs_an_agent_with_one_function_tool(edge: RunningEdge, model: str) -> None:
    agents = pytest.importorskip("agents", reason="the openai-agents SDK is in the test extras")
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"It is 18 degrees and sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{edge.port}/v1", api_key=KEYS["alpha"], max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=4))
    assert called and isinstance(result.final_output, str) and result.final_output


# -- every shape: the tenant's cache is its own ------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["chat", "messages", "responses"])
def test_a_second_tenant_reads_nothing_cached_on_every_shape(edge: RunningEdge, model: str, shape: str) -> None:
    """Alpha sends a long system prompt twice (its second is served from its cache); beta sends the same and reads
    nothing cached, whichever API shape carries it."""
    system = f"({shape}) {SYSTEM}"  # a prefix of its own: no other test's request wrote it
    asked = "Say hello."

    def cached(tenant: str) -> int:
        if shape == "chat":
            out = oai(edge, tenant).chat.completions.create(
                model=model, max_tokens=2, messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": asked}],
            )  # fmt: skip
            assert out.usage is not None and out.usage.prompt_tokens_details is not None
            return int(out.usage.prompt_tokens_details.cached_tokens or 0)
        if shape == "messages":
            message = claude(edge, tenant).messages.create(
                model=model, max_tokens=2, system=system, messages=[{"role": "user", "content": asked}]
            )
            return int(message.usage.cache_read_input_tokens or 0)
        response = oai(edge, tenant).responses.create(
            model=model, max_output_tokens=2, instructions=system, input=asked
        )
        assert response.usage is not None
        return int(response.usage.input_tokens_details.cached_tokens)

    cached("alpha")
    assert cached("alpha") > 200  # its own follow-up: the system prompt from its cache
    assert cached("beta") == 0


# -- HTTP/3 ----------------------------------------------------------------------------------------------------


def test_one_request_of_each_shape_over_http3(tmp_path_factory: pytest.TempPathFactory) -> None:
    curl = pytest.importorskip("curl_cffi", reason="libcurl's HTTP/3 client (curl_cffi) is a bench dependency")
    from curl_cffi import CurlHttpVersion, requests

    del curl
    tmp = tmp_path_factory.mktemp("shapes-h3")
    with running_edge(_options("quic", tmp), tmp, timeout=120.0) as h3:
        base = f"https://localhost:{h3.port}"
        common = {"http_version": CurlHttpVersion.V3ONLY, "verify": str(default_certificate()), "timeout": 120}
        name = requests.get(f"{base}/v1/models", headers={"x-api-key": KEYS["alpha"]}, **common).json()
        model = name["data"][0]["id"]
        r = requests.post(
            f"{base}/v1/messages", headers={"x-api-key": KEYS["alpha"], "anthropic-version": "2023-06-01"},
            json={"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "Capital of France?"}]},
            **common,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        body = anthropic.types.Message.model_validate(r.json())
        assert body.content and body.usage.output_tokens > 0
        r = requests.post(
            f"{base}/v1/responses", headers={"authorization": f"Bearer {KEYS['alpha']}"},
            json={"model": model, "input": "Capital of France?", "max_output_tokens": 16, "stream": True}, **common,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        events = [json.loads(b[6:]) for b in r.text.split("\n") if b.startswith("data: ")]
        assert events[0]["type"] == "response.created" and events[-1]["type"] in (
            "response.completed", "response.incomplete"
        )  # fmt: skip
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        done = openai.types.responses.Response.model_validate(events[-1]["response"])
        assert done.output_text and done.usage is not None
