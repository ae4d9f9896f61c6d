"""OpenAI's ``n`` with the real model (SmolLM2 through llama.cpp) and the ``openai`` client over HTTP/1.1: n choices
with their indexes, streamed and not; choices that differ when sampled and agree when greedy; a request whose n
slots cannot all be had is a 429 at once that leaves no slot claimed; a client that goes away cancels every
choice."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator

import pytest
from helpers.edge import RunningEdge, free_port, running_edge

from edgepath.config import EdgeSettings, HandlerSettings, ServeOptions, Sizing

pytestmark = pytest.mark.slow  # serve with its slot-server child running the model

openai = pytest.importorskip("openai", reason="the openai client is in the test extras")

SLOTS = 4
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy, the model goes on counting: a slot busy for its max_tokens


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(kind=socket.SOCK_STREAM)),
        sizing=Sizing(slots=SLOTS),
        handler=HandlerSettings("llama", (("threads", "1"),)),
    )
    with running_edge(options, tmp_path_factory.mktemp("choices"), timeout=300.0) as running:
        yield running


@pytest.fixture(scope="module")
def client(edge: RunningEdge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{edge.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _get(edge: RunningEdge, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def _free(edge: RunningEdge) -> int:
    return int(json.loads(_get(edge, "/health"))["free_slots"])


def _all_free(edge: RunningEdge, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while _free(edge) != SLOTS:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_n_chat_choices_come_with_their_indexes_and_one_usage(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    one = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=8, n=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason in ("stop", "length") for c in out.choices)
    # greedy: every choice is the one answer, and usage counts the prompt once and every choice's tokens
    assert {c.message.content for c in out.choices} == {one.choices[0].message.content}
    assert out.usage is not None and one.usage is not None
    assert out.usage.prompt_tokens == one.usage.prompt_tokens
    assert out.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_sampled_choices_differ_and_a_seed_repeats_them(client: openai.OpenAI, model: str) -> None:
    ask = dict(model=model, prompt="Once upon a time", max_tokens=12, n=3, temperature=1.0, seed=11)
    first = client.completions.create(**ask)
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1  # each choice samples with its own seed (seed + index)
    assert [c.text for c in client.completions.create(**ask).choices] == texts


def test_streamed_choices_carry_their_indexes_and_end_once(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(
        model=model, prompt="The sea is", max_tokens=6, n=3, temperature=0.7, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usages = []
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finished
                finished[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert sorted(texts) == sorted(finished) == [0, 1, 2]
    assert all(texts[i] for i in range(3))
    (usage,) = usages
    assert 3 <= usage.completion_tokens <= 18 and usage.prompt_tokens > 0


def test_n_slots_or_none_a_429_at_once_and_nothing_left_claimed(
    client: openai.OpenAI, model: str, edge: RunningEdge
) -> None:
    assert _all_free(edge)
    busy = client.completions.create(model=model, prompt=COUNTING, max_tokens=400, temperature=0, stream=True)
    next(iter(busy))  # one slot is running: three are free
    try:
        assert _free(edge) == SLOTS - 1
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=model, prompt="hi", max_tokens=4, n=SLOTS)
        refused_in = time.monotonic() - started
        assert info.value.code == "no_slot"
        assert _free(edge) == SLOTS - 1  # the three slots the group got were given back at once
        assert refused_in < 2.0, f"the 429 took {refused_in:.2f} s"  # at once, not after a lease or a wait
        out = client.completions.create(model=model, prompt="hi", max_tokens=4, n=SLOTS - 1)
        assert [c.index for c in out.choices] == [0, 1, 2]
    finally:
        busy.close()
    assert _all_free(edge)


def _counter(edge: RunningEdge, series: str) -> float:
    """A counter of ``/metrics`` (0 while it has no sample)."""
    lines = [line for line in _get(edge, "/metrics").decode().splitlines() if line.startswith(series + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


GONE = 'edgepath_requests_total{route="/v1/completions",status="499"}'  # the client went away
ABANDONED = "edgepath_port_abandoned_total"  # frames given up: their slots cancelled


def test_a_client_that_goes_away_cancels_every_choice(client: openai.OpenAI, model: str, edge: RunningEdge) -> None:
    assert _all_free(edge)
    gone, abandoned = _counter(edge, GONE), _counter(edge, ABANDONED)
    stream = client.completions.create(model=model, prompt=COUNTING, max_tokens=400, n=3, temperature=0, stream=True)
    next(iter(stream))
    assert _free(edge) == SLOTS - 3  # the three choices hold their slots (claimed together, before any token)
    stream.close()
    assert _all_free(edge)  # every choice was cancelled and its slot freed
    assert _counter(edge, GONE) == gone + 1  # one request, counted once
    assert _counter(edge, ABANDONED) == abandoned + 3  # its three choices, each cancelled on its slot
