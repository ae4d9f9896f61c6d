"""SmolLM2 served end to end: ``serve --transport tcp --handler llama`` with the GGUF tokenizer at the
edge, asked by the ``openai`` client -- a real answer from the real model through the slots."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from helpers.edge import RunningEdge, free_port, running_edge
from helpers.supervised import metric

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
openai = pytest.importorskip("openai", reason="the openai client is in the test extras")

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@pytest.fixture(scope="module")
def model_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    from edgepath.model.gguf import default_model_path

    gguf = str(default_model_path())
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(kind=socket.SOCK_STREAM), tokenizer=gguf),
        sizing=Sizing(slots=2, input_capacity=256, output_capacity=64),
        agent=AgentSettings(frames=8),
        handler=HandlerSettings("llama", (("model", gguf), ("threads", "1"), ("ctx_per_slot", "256"))),
    )
    with running_edge(options, tmp_path_factory.mktemp("model"), timeout=120.0) as running:
        yield running


@pytest.fixture
def client(model_edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{model_edge.port}/v1", api_key="unused", max_retries=0)


def test_chat_completion_is_a_real_answer(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_chat_arrives_token_by_token(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[SYSTEM, {"role": "user", "content": "What is the capital of Japan?"}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3
    assert "Tokyo" in "".join(pieces)


LONG_SYSTEM = {
    "role": "system",
    "content": "You are the help desk of a small railway. You answer questions about routes, tickets, luggage, "
    "pets and refunds, politely and briefly. When you are not sure, say so and point to the ticket office.",
}


def test_cached_prompt_tokens_are_reported_in_usage_and_metrics(client: openai.OpenAI, model_edge: RunningEdge) -> None:
    """The second chat with the same system prompt reuses its KV: OpenAI's usage field says how many prompt
    tokens came from the cache -- in a whole answer and in a stream's usage chunk -- and /metrics counts it."""
    model = client.models.list().data[0].id
    port = model_edge.port
    hits = metric(port, 'edgepath_prefix_cache_requests_total{result="hit"}')
    cached = metric(port, "edgepath_prefix_cache_tokens_total")
    first = client.chat.completions.create(
        model=model, messages=[LONG_SYSTEM, {"role": "user", "content": "Can I bring my dog?"}], max_tokens=8
    )
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(
        model=model, messages=[LONG_SYSTEM, {"role": "user", "content": "Is there wifi?"}], max_tokens=8
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert 40 < reused < second.usage.prompt_tokens  # the system prompt, not the question
    stream = client.chat.completions.create(
        model=model,
        messages=[LONG_SYSTEM, {"role": "user", "content": "Is there wifi?"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # the same prompt again
    assert metric(port, 'edgepath_prefix_cache_requests_total{result="hit"}') == hits + 2
    assert metric(port, "edgepath_prefix_cache_tokens_total") == cached + reused + usage.prompt_tokens - 1
