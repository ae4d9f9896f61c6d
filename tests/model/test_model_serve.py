"""SmolLM2 served end to end: ``serve --transport tcp --handler llama`` with the GGUF tokenizer at the
edge, asked by the ``openai`` client -- a real answer from the real model through the slots."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from helpers.edge import RunningEdge, free_port, running_edge

from edgepath.config import ServeOptions

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
openai = pytest.importorskip("openai", reason="the openai client is in the test extras")

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@pytest.fixture(scope="module")
def model_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    from edgepath.model.gguf import default_model_path

    gguf = str(default_model_path())
    options = ServeOptions(
        transport="tcp",
        port=free_port(kind=socket.SOCK_STREAM),
        slots=2,
        frames=8,
        input_capacity=256,
        output_capacity=64,
        tokenizer=gguf,
        handler="llama",
        handler_options=(("model", gguf), ("threads", "1"), ("ctx_per_slot", "256")),
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
