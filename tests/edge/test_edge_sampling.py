"""One ``Sampling`` from both HTTP APIs to the model side: ``/v1/generate`` and the OpenAI routes take the same
sampling fields, refuse a bad one with the same message, and the values reach the handler through the slot's
request header (over the real edge service, agent and slot server)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from helpers.tokenizers import CharTokenizer

from edgepath.contract import wire
from edgepath.contract.wire import Sampling
from edgepath.dpu.agent import Agent
from edgepath.edge.apis.generate import GenerateRoutes
from edgepath.edge.apis.openai import OpenAIError, OpenAILimits, parse_completion_request
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes, formatter_factory
from edgepath.edge.apis.sampling import RULES
from edgepath.edge.http import COMPLETIONS, Headers, Limits, Request, Response, Work
from edgepath.edge.lifecycle import DEFAULT_FORMATTERS
from edgepath.edge.routes import HttpCore
from edgepath.edge.service import EdgeService
from edgepath.native.abi import lib
from edgepath.peer_secret import peer_keys
from edgepath.slots.handlers import SlotRequest, echo
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.loopback import LoopbackTransport

CAP = 16
LIMITS = Limits(max_body=1 << 16, input_capacity=CAP, output_capacity=CAP, vocab_size=CharTokenizer.vocab_size)
MODEL = "echo"
ASKED = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "seed": -7,
    "min_p": 0.05,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "repetition_penalty": 1.1,
    "logit_bias": {"7": 1.5, "5": -100},
}
#: what travels to the model side for ASKED (an int64 seed as its two's-complement u64; the biases' ids ascending)
CARRIED = Sampling(0.7, 0.9, 40, 2**64 - 7, 0.05, 0.5, -0.25, 1.1, ((5, -100.0), (7, 1.5)))


def generate(body: dict[str, Any]) -> Work | Response:
    handled = HttpCore(LIMITS).handle(Request("POST", "/v1/generate", [], json.dumps(body).encode(), 0))
    assert isinstance(handled, Work | Response)
    return handled


def complete(body: dict[str, Any], seeds: Any = None) -> Sampling:
    """The sampling of a ``/v1/completions`` body (``seeds``: where a missing seed comes from)."""
    extra = {} if seeds is None else {"seeds": seeds}
    return parse_completion_request({"model": MODEL, "prompt": "a", **body}, _openai_limits(), **extra).sampling


def test_the_parser_knows_every_field_of_sampling() -> None:
    """A new sampling parameter is a field of ``Sampling``: until the one parser knows it, this fails."""
    assert set(RULES) == {f.name for f in fields(Sampling)}


def test_generate_takes_the_sampling_fields_and_is_greedy_without_them() -> None:
    work = generate({"prompt": "a", **ASKED})
    assert isinstance(work, Work) and work.sampling == CARRIED
    plain = generate({"prompt": "a"})
    assert isinstance(plain, Work) and plain.sampling == Sampling() and plain.sampling.temperature == 0.0
    nulls = generate({"prompt": "a", **dict.fromkeys(ASKED)})  # null is "not given", as on the OpenAI routes
    assert isinstance(nulls, Work) and nulls.sampling == Sampling()
    assert complete(ASKED) == CARRIED
    assert work.constraint is not None and wire.read_after_prompt(work.constraint, 2) == (None, CARRIED.logit_bias)
    assert plain.constraint is None  # nothing follows the prompt


def test_a_request_that_samples_without_a_seed_gets_a_fresh_one() -> None:
    """OpenAI's and llama-server's way: no seed, a new draw per request; a given seed is kept; greedy needs none."""
    seeds = iter(range(100, 200))
    assert complete({}, lambda: next(seeds)).seed == 100  # OpenAI's default temperature is 1
    assert complete({"temperature": 0.5}, lambda: next(seeds)).seed == 101
    assert complete({"seed": 3}, lambda: next(seeds)).seed == 3
    assert complete({"temperature": 0}, lambda: next(seeds)).seed == 0
    routes = GenerateRoutes(LIMITS, lambda: next(seeds))
    sampled = routes.handle("/v1/generate", "POST", b'{"prompt": "a", "temperature": 1}')
    greedy = routes.handle("/v1/generate", "POST", b'{"prompt": "a"}')
    assert isinstance(sampled, Work) and sampled.sampling.seed == 102
    assert isinstance(greedy, Work) and greedy.sampling.seed == 0
    assert len({complete({}).seed for _ in range(10)}) == 10  # the OS's source: 64 bits each


def test_generate_takes_ignore_eos_as_a_request_flag() -> None:
    work = generate({"prompt": "a", "ignore_eos": True})
    assert isinstance(work, Work) and work.flags & wire.FLAG_IGNORE_EOS
    plain = generate({"prompt": "a", "ignore_eos": None})
    assert isinstance(plain, Work) and not plain.flags & wire.FLAG_IGNORE_EOS
    refused = generate({"prompt": "a", "ignore_eos": 1})
    assert isinstance(refused, Response) and refused.status == 400
    assert "'ignore_eos' must be true or false" in json.loads(refused.body)["error"]["message"]


def test_repeat_penalty_is_repetition_penalty() -> None:
    """llama.cpp's name for vLLM's field: either, or both when they agree."""
    assert complete({"repeat_penalty": 1.3}).repetition_penalty == 1.3
    assert complete({"repeat_penalty": 1.3, "repetition_penalty": 1.3}).repetition_penalty == 1.3
    with pytest.raises(OpenAIError) as info:
        complete({"repeat_penalty": 1.3, "repetition_penalty": 1.2})
    assert (info.value.param, info.value.code) == ("repeat_penalty", "invalid_value")
    assert "disagree; give one of them" in info.value.message
    work = generate({"prompt": "a", "repeat_penalty": 1.5})
    assert isinstance(work, Work) and work.sampling.repetition_penalty == 1.5


def _openai_limits() -> OpenAILimits:
    return OpenAILimits(max_tokens=CAP, vocab_size=CharTokenizer.vocab_size, models=(MODEL,))


BAD = [
    ("temperature", -0.1, "[0, 2]"),
    ("temperature", 2.5, "[0, 2]"),
    ("temperature", "1", "[0, 2]"),
    ("temperature", True, "[0, 2]"),
    ("top_p", 0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_k", -1, "0..2147483647"),
    ("top_k", 2**31, "0..2147483647"),
    ("top_k", 4.0, "0..2147483647"),
    ("top_k", False, "0..2147483647"),
    ("seed", 2**63, "-9223372036854775808..9223372036854775807"),
    ("seed", 1.5, "-9223372036854775808..9223372036854775807"),
    ("seed", "7", "-9223372036854775808..9223372036854775807"),
    ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.01, "[0, 1]"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("presence_penalty", "0.5", "[-2, 2]"),
    ("frequency_penalty", -2.01, "[-2, 2]"),
    ("repetition_penalty", 0, "(0, 10]"),
    ("repetition_penalty", 11, "(0, 10]"),
    ("repeat_penalty", -1, "(0, 10]"),
    ("logit_bias", [[5, -100]], 'an object of at most 300 token ids (as strings: {"50256": -100})'),
    ("logit_bias", {"five": -100}, "is not a token id"),
    ("logit_bias", {"-5": -100}, "is not a token id"),
    ("logit_bias", {"5": -101}, "in [-100, 100], got -101"),
    ("logit_bias", {"5": True}, "in [-100, 100], got true"),
    ("logit_bias", {"5": 1, "05": 2}, "names token 5 twice"),
    ("logit_bias", {"1000": 1}, "this model's token ids are 0..999"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "has 301 entries; at most 300"),
]


@pytest.mark.parametrize(("name", "value", "allowed"), BAD)
def test_a_bad_sampling_field_is_refused_the_same_way_on_both_apis(name: str, value: Any, allowed: str) -> None:
    refused = generate({"prompt": "a", name: value})
    assert isinstance(refused, Response) and refused.status == 400
    error = json.loads(refused.body)["error"]
    assert error["type"] == "invalid_request"
    assert error["message"].startswith(f"'{name}' ") and allowed in error["message"]
    with pytest.raises(OpenAIError) as info:
        parse_completion_request({"model": MODEL, "prompt": "a", name: value}, _openai_limits())
    assert (info.value.status, info.value.param, info.value.code) == (400, name, "invalid_value")
    assert info.value.message == error["message"]  # one parser, one message


def test_tokenize_still_takes_no_sampling_field() -> None:
    handled = HttpCore(LIMITS).handle(Request("POST", "/v1/tokenize", [], b'{"prompt": "a", "top_k": 4}', 0))
    assert isinstance(handled, Response) and handled.status == 400
    assert "unknown field(s) ['top_k']" in json.loads(handled.body)["error"]["message"]


class Answer:
    """The one, unstreamed answer of a request."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.response: Response | None = None

    def respond(self, response: Response) -> None:
        self.response = response
        self.done.set()

    def start(self, status: int, headers: Headers) -> None:
        raise AssertionError("not a streamed request")

    def send(self, data: bytes) -> None:
        raise AssertionError("not a streamed request")

    def end(self, data: bytes) -> None:
        raise AssertionError("not a streamed request")


@pytest.fixture
def recording_server(tmp_path: Path) -> Iterator[tuple[SlotServer, list[Sampling]]]:
    """An echo slot server on its real loop that records each request's sampling as the handler gets it."""
    seen: list[Sampling] = []

    def handler(request: SlotRequest) -> int:
        seen.append(request.sampling)
        return echo(request)

    config = SlotServerConfig(slots=2, input_capacity=CAP, output_capacity=CAP)
    server = SlotServer(LoopbackTransport(peer_keys(None)), str(tmp_path / "slots.sock"), handler, config)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield server, seen
    server.stop()
    thread.join(timeout=5)
    server.close()


def test_sampling_reaches_the_handler_from_both_apis(recording_server: tuple[SlotServer, list[Sampling]]) -> None:
    """The values of a ``/v1/generate`` and of a ``/v1/completions`` body are what the model side's handler is
    given, through the frame's request header and the slot's."""
    server, seen = recording_server
    transport = LoopbackTransport(peer_keys(None))
    agent = Agent(transport, frames=2, input_capacity=CAP, output_capacity=CAP)
    agent.attach(server.address)
    tokenizer = CharTokenizer()
    routes = OpenAIRoutes(MODEL, CAP, tokenizer.vocab_size, ChatSupport(False, "no template"), 0, seeds=lambda: 42)
    bodies = [
        ("/v1/generate", {"tokens": [1, 2, 3], "max_tokens": 3, **ASKED}),
        ("/v1/generate", {"tokens": [1, 2, 3], "max_tokens": 3}),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, **ASKED}),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3}),
    ]

    async def main() -> list[int]:
        openai_format = formatter_factory(lambda: 0.0)
        service = EdgeService(
            HttpCore(LIMITS, None, routes),
            tokenizer,
            agent,
            asyncio.get_running_loop(),
            ThreadPoolExecutor(1),
            workers=1,
            formatters={**DEFAULT_FORMATTERS, COMPLETIONS: openai_format},
        )
        service.start()
        statuses = []
        for path, body in bodies:  # one at a time: the handler sees them in this order
            answer = Answer()
            service.handle(Request("POST", path, [], json.dumps(body).encode(), lib.ep_now_ns()), answer)
            await asyncio.wait_for(answer.done.wait(), 30)
            assert answer.response is not None
            statuses.append(answer.response.status)
        service.stop()
        return statuses

    try:
        assert asyncio.run(main()) == [200] * len(bodies)
    finally:
        transport.close()
    openai_default = Sampling(temperature=1.0, top_p=1.0, seed=42)  # OpenAI's default temperature is 1: a fresh seed
    assert seen == [_expected(s) for s in (CARRIED, Sampling(), CARRIED, openai_default)]


def _expected(sampling: Sampling) -> Sampling:
    """A sampling as the model side reads it (the header's floats are float32)."""
    close = {
        f.name: pytest.approx(getattr(sampling, f.name), rel=1e-6)
        for f in fields(Sampling)
        if isinstance(getattr(sampling, f.name), float)
    }
    return replace(sampling, **close)
