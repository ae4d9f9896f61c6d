"""Edge-stage microbenchmarks, 128-token prompt: HTTP request parse (the sans-I/O core) and
tokenize straight into a registered frame.  Run with ``make bench`` (table in docs/PERFORMANCE.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgepath.dpu.agent import Agent
from edgepath.edge.http import Limits, Request, Work
from edgepath.edge.routes import HttpCore
from edgepath.edge.text.tokenizer import load_tokenizer
from edgepath.peer_secret import peer_keys
from edgepath.transports.loopback import LoopbackTransport

TOKENS = 128
ROUNDS = 5000


def prompt_of(tokens: int) -> str:
    """A text prompt that the default tokenizer turns into exactly ``tokens`` ids (BOS included)."""
    tok = load_tokenizer()
    text = ""
    for i in range(tokens * 2):
        candidate = f"{text} w{i}" if text else f"w{i}"
        if len(tok.encode(candidate)) > tokens:
            break
        text = candidate
    while len(tok.encode(text)) < tokens:
        text += "."
    if len(tok.encode(text)) != tokens:
        raise RuntimeError(f"could not build a prompt of exactly {tokens} tokens")
    return text


@pytest.fixture(scope="module")
def prompt() -> str:
    return prompt_of(TOKENS)


def test_parse(benchmark, prompt: str) -> None:
    core = HttpCore(Limits(max_body=1 << 20, input_capacity=4096, output_capacity=4096, vocab_size=131_072))
    body = json.dumps({"prompt": prompt, "max_tokens": TOKENS}).encode()
    headers = [(b"content-type", b"application/json")]

    def parse() -> object:
        return core.handle(Request("POST", "/v1/generate", headers, body, 0))

    assert isinstance(benchmark.pedantic(parse, rounds=ROUNDS, iterations=1), Work)


def test_tokenize(benchmark, prompt: str) -> None:
    tokenizer = load_tokenizer()
    transport = LoopbackTransport(peer_keys(None))
    agent = Agent(transport, frames=1, input_capacity=4096, output_capacity=16, max_servers=1, max_slots_per_server=1)
    view = agent.frames.tokens[0]

    def tokenize() -> int:
        return tokenizer.encode_into(prompt, view)

    assert benchmark.pedantic(tokenize, rounds=ROUNDS, iterations=1) == TOKENS
    assert np.shares_memory(view, agent.frames_mr.buf)
    assert view[:TOKENS].tolist() == tokenizer.encode(prompt).tolist()
    transport.close()
