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


def test_logprobs_come_from_the_logits_the_sampler_used(client: openai.OpenAI) -> None:
    """At temperature 0 the chosen token is the likeliest: each entry's token and log probability are its first
    alternative's; log probabilities are <= 0 and the alternatives sorted, likeliest first; one entry per
    completion token, streamed or not (whose records are carried back through the stream entries)."""
    model = client.models.list().data[0].id
    question = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model=model, messages=question, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = reply.choices[0].logprobs.content
    assert reply.usage is not None and len(entries) == reply.usage.completion_tokens > 0
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob)
        ranked = [t.logprob for t in e.top_logprobs]
        assert ranked == sorted(ranked, reverse=True) and ranked[-1] <= 0
    assert entries[0].logprob > -5  # the model's own choice, not a flat distribution

    stream = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    tops = [d for c in chunks if c.choices and c.choices[0].logprobs for d in c.choices[0].logprobs.top_logprobs]
    assert chunks[-1].usage is not None and len(tokens) == chunks[-1].usage.completion_tokens == len(tops)
    assert all(max(d, key=d.__getitem__) == t for d, t in zip(tops, tokens, strict=True))
