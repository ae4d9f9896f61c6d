"""The OpenAI-compatible API with real clients: the ``openai`` package over HTTP/1.1 (``--transport tcp``)
and libcurl's HTTP/3 (curl_cffi) over QUIC, against a real ``serve`` whose slot server runs the paced
echo (one token per 20 ms), so streaming, stop strings and cancellation are visible without a model."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.edge import RunningEdge, free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.tls import default_certificate

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child

openai = pytest.importorskip("openai", reason="the openai client is in the test extras")

TOKEN_DELAY = 0.02


@pytest.fixture(scope="module", autouse=True)
def tls_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("tls")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(state))
        yield state


def _options(transport: str) -> ServeOptions:
    port = free_port() if transport == "quic" else free_port(kind=socket.SOCK_STREAM)
    return ServeOptions(
        edge=EdgeSettings(transport=transport, port_asked=port, served_model_name="echo"),
        sizing=Sizing(slots=4, input_capacity=256, output_capacity=64),
        agent=AgentSettings(frames=32),
        handler=HandlerSettings("paced-echo", (("token_delay", str(TOKEN_DELAY)),)),
    )


@pytest.fixture(scope="module")
def tcp_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    with running_edge(_options("tcp"), tmp_path_factory.mktemp("tcp")) as running:
        yield running


@pytest.fixture(scope="module")
def quic_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    with running_edge(_options("quic"), tmp_path_factory.mktemp("quic")) as running:
        yield running


@pytest.fixture
def client(tcp_edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{tcp_edge.port}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["echo"]


def test_completion_echoes_the_prompt_with_exact_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model="echo", prompt="Hello, edge", max_tokens=32)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == "echo"
    assert "Hello, edge" in choice.text  # the echo returns the prompt's tokens (Tekken adds a BOS)
    assert choice.finish_reason == "stop"
    assert out.usage is not None and out.usage.prompt_tokens == out.usage.completion_tokens > 0
    assert out.usage.total_tokens == 2 * out.usage.prompt_tokens


def test_max_tokens_cuts_the_answer_with_length(client: openai.OpenAI) -> None:
    out = client.completions.create(model="echo", prompt="one two three four five six seven", max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage is not None
    assert out.usage.completion_tokens == 3


def test_streamed_completion_arrives_in_pieces_and_ends_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="echo",
        prompt="streaming through the data path",
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    arrivals, texts, usage, reasons = [], [], None, []
    for chunk in stream:
        arrivals.append(time.monotonic())
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "streaming through the data path" in "".join(texts)
    assert reasons[-1] == "stop" and usage is not None and usage.completion_tokens == usage.prompt_tokens
    assert len(texts) >= 4  # tokens come as they are produced (20 ms apart), not in one piece
    assert arrivals[-1] - arrivals[0] > 2 * TOKEN_DELAY


def test_stop_string_trims_the_text_and_ends_the_slot(client: openai.OpenAI, tcp_edge: RunningEdge) -> None:
    out = client.completions.create(
        model="echo", prompt="alpha beta gamma delta epsilon", max_tokens=64, stop=[" gamma"]
    )
    assert out.choices[0].text.endswith("alpha beta") and "gamma" not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"


def test_unsupported_options_are_refused_naming_the_option(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"'n' must be an integer in 1\.\.4 .*got 5"):
        client.completions.create(model="echo", prompt="hi", n=5)  # more choices than the slots of a slot server
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="echo", prompt="hi", logprobs=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="hi")


def test_chat_without_a_template_is_a_clear_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])


def test_no_free_slot_is_a_429_the_client_recognises(tcp_edge: RunningEdge) -> None:
    """Four slots, each busy for about a second: the fifth request gets 429 at once (the openai client
    would retry it on its own; retries are off here to see it)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{tcp_edge.port}/v1", api_key="unused", max_retries=0)
    long_prompt = " ".join(["word"] * 40)
    streams = [
        client.completions.create(model="echo", prompt=long_prompt, max_tokens=64, stream=True) for _ in range(4)
    ]
    for s in streams:
        next(iter(s))  # every slot is running
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="echo", prompt="one more", max_tokens=4)
    for s in streams:
        s.close()  # the client goes away: the edge cancels those slots


def test_http3_stream_arrives_in_pieces_with_a_client_that_is_not_ours(quic_edge: RunningEdge) -> None:
    from curl_cffi import CurlHttpVersion, requests

    arrivals: list[float] = []
    body = bytearray()

    def content(chunk: bytes) -> None:
        arrivals.append(time.monotonic())
        body.extend(chunk)

    r = requests.post(
        f"https://localhost:{quic_edge.port}/v1/completions",
        json={"model": "echo", "prompt": "over HTTP/3, piece by piece", "max_tokens": 64, "stream": True},
        http_version=CurlHttpVersion.V3ONLY,
        verify=str(default_certificate()),
        content_callback=content,
        timeout=30,
    )
    assert r.status_code == 200
    events = [line for line in bytes(body).split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]" and len(events) > 4
    assert len(arrivals) > 2 and arrivals[-1] - arrivals[0] > 2 * TOKEN_DELAY  # the first event well before the last


def test_n_choices_stream_over_http3_each_with_its_index(quic_edge: RunningEdge) -> None:
    from curl_cffi import CurlHttpVersion, requests

    r = requests.post(
        f"https://localhost:{quic_edge.port}/v1/completions",
        json={"model": "echo", "prompt": "three echoes", "max_tokens": 16, "n": 3, "stream": True},
        http_version=CurlHttpVersion.V3ONLY,
        verify=str(default_certificate()),
        timeout=30,
    )
    assert r.status_code == 200
    events = [line for line in r.content.split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]" and events.count(b"data: [DONE]") == 1
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in json.loads(event.removeprefix(b"data: "))["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == [0, 1, 2] and all("three echoes" in text for text in texts.values())
