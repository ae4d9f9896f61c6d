"""Grammars built off the event loop and kept per tenant (edge/grammars.py, edge/tokenizing.py; issue 49).

The cache is bounded and keyed by tenant; through the lifecycle, a request whose grammar its tenant has not sent
before goes to a tokenizer worker, which builds the words with the prompt's ids, and the next one of that tenant is
submitted at once with the words from the cache -- for every chat shape, ``response_format`` and enforced tools
alike -- while another tenant's same schema is built again.  Through the service, a grammar being built does not hold
up another request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.tokenizers import CharTokenizer
from test_edge_lifecycle import TIMEOUT, Clock, FakePort, Respond
from test_edge_service import (
    Recorded,
    Server,
    free_frames,
    generate,
    start_server,
    until,
)

from edgepath.contract import wire
from edgepath.contract.pool import AgentFrames, FrameLayout
from edgepath.dpu.agent import Agent
from edgepath.edge.apis.anthropic_answers import AnthropicRoutes
from edgepath.edge.apis.anthropic_answers import formatter_factory as anthropic_formatters
from edgepath.edge.apis.conversation import ChatLimits
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.apis.openai_routes import formatter_factory as openai_formatters
from edgepath.edge.apis.responses_answers import ResponsesRoutes
from edgepath.edge.apis.responses_answers import formatter_factory as responses_formatters
from edgepath.edge.grammars import GrammarCache
from edgepath.edge.http import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    MESSAGES,
    RESPONSES,
    Grammar,
    Limits,
    Request,
    Response,
    Work,
)
from edgepath.edge.lifecycle import EdgeLifecycle, Tokenize
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.routes import HttpCore
from edgepath.edge.service import EdgeService
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.tenancy.tenants import Tenant
from edgepath.edge.tokenizing import work_on_worker
from edgepath.native.abi import lib
from edgepath.peer_secret import peer_keys
from edgepath.transports.loopback import LoopbackTransport


def words(n: int, fill: int = 1) -> np.ndarray:
    return np.full(n, fill, np.int32)


# -- the cache ------------------------------------------------------------------------------------------------------


def test_a_tenant_finds_its_own_grammars_and_never_another_tenants() -> None:
    cache = GrammarCache()
    cache.put("a", b"schema", words(4))
    found = cache.get("a", b"schema")
    assert found is not None and found.tolist() == [1] * 4 and not found.flags.writeable
    assert cache.get("b", b"schema") is None  # the same schema sent by another tenant: built for it again
    assert cache.get("a", b"other") is None
    assert (cache.hits, cache.misses) == (1, 2)


def test_each_tenant_keeps_its_most_recently_used_grammars_within_its_count_and_bytes() -> None:
    cache = GrammarCache(per_tenant=2, tenant_bytes=64, total_bytes=1024)
    cache.put("a", b"1", words(4))
    cache.put("a", b"2", words(4))
    assert cache.get("a", b"1") is not None  # 1 is now the most recently used
    cache.put("a", b"3", words(4))
    assert cache.get("a", b"2") is None and cache.get("a", b"1") is not None and cache.held("a") == 2
    cache.put("a", b"big", words(13))  # 52 bytes: one grammar too many, then with 1 (16) over 64 bytes
    assert cache.held("a") == 1 and cache.get("a", b"big") is not None and cache.size == 52
    cache.put("a", b"huge", words(17))  # more than a tenant's bytes alone: not kept, nothing pushed out
    assert cache.get("a", b"huge") is None and cache.get("a", b"big") is not None


def test_past_the_bound_on_all_tenants_the_tenant_holding_most_gives_up_its_oldest() -> None:
    cache = GrammarCache(per_tenant=8, tenant_bytes=64, total_bytes=96)
    cache.put("heavy", b"1", words(8))
    cache.put("heavy", b"2", words(8))
    cache.put("light", b"1", words(4))
    cache.put("light", b"2", words(4))  # 96 bytes in all: at the bound
    cache.put("light", b"3", words(4))  # over it: heavy (64 bytes) gives up its oldest
    assert cache.get("heavy", b"1") is None and cache.get("heavy", b"2") is not None
    assert cache.held("light") == 3 and cache.size == 80


@pytest.mark.parametrize(("per_tenant", "tenant_bytes", "total_bytes"), [(0, 64, 64), (1, 0, 64), (1, 64, 32)])
def test_a_cache_that_could_keep_nothing_is_refused(per_tenant: int, tenant_bytes: int, total_bytes: int) -> None:
    with pytest.raises(ValueError, match="keeps at least 1 grammar"):
        GrammarCache(per_tenant, tenant_bytes, total_bytes)


# -- through the lifecycle, every chat shape ---------------------------------------------------------------------

pytest.importorskip("llama_cpp", reason="grammars are made with llama.cpp's converter (the model extra)")

MODEL = "m"
INPUT = 4096  # a grammar's words follow the prompt in the slot
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
HI = [{"role": "user", "content": "hi"}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
ASKS = {
    "chat response_format": (
        CHAT,
        {"model": MODEL, "messages": HI, "max_tokens": 4,
         "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
    ),
    "chat tools": (
        CHAT, {"model": MODEL, "messages": HI, "max_tokens": 4, "tools": OPENAI_TOOLS, "tool_choice": "required"}
    ),
    "messages output_config": (
        MESSAGES,
        {"model": MODEL, "messages": HI, "max_tokens": 4,
         "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    ),
    "messages tools": (
        MESSAGES,
        {"model": MODEL, "messages": HI, "max_tokens": 4, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}},
    ),
    "responses text.format": (
        RESPONSES,
        {"model": MODEL, "input": "hi", "max_output_tokens": 4,
         "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}},
    ),
    "responses tools": (
        RESPONSES,
        {"model": MODEL, "input": "hi", "max_output_tokens": 4, "tools": RESPONSES_TOOLS, "tool_choice": "required"},
    ),
}  # fmt: skip


class ChatChars(CharTokenizer):
    """One id per character; a chat is its contents run together."""

    def encode_chat_into(self, messages: list[dict[str, Any]], out: np.ndarray, **_: Any) -> int:
        return self.encode_into("".join(str(m.get("content") or "") for m in messages), out)


def wide_port() -> FakePort:
    """The lifecycle tests' port with room for a grammar after the prompt."""
    port = FakePort()
    port.layout = FrameLayout(INPUT, 64)
    req_bytes, rep_bytes = AgentFrames.sizes(4, port.layout)
    port.frames = AgentFrames(np.zeros(req_bytes, np.uint8), np.zeros(rep_bytes, np.uint8), 4, port.layout)
    return port


def lifecycle(port: FakePort, tokenizer: CharTokenizer) -> EdgeLifecycle:
    keys = ApiKeys.of_digests([(hashlib.sha256(k.encode()).digest(), Tenant(k, k.encode())) for k in ("a", "b")])
    shapes = {
        "anthropic": AnthropicRoutes(ChatLimits(64, (MODEL,), grammars=True), True),
        "responses": ResponsesRoutes(ChatLimits(64, (MODEL,), grammars=True), True),
    }
    openai = OpenAIRoutes(MODEL, 64, 1000, ChatSupport(True), 0, grammars=True)
    core = HttpCore(Limits(1 << 20, INPUT, 64, tokenizer.vocab_size), keys, openai, shapes=shapes)
    formatters = {
        CHAT: openai_formatters(lambda: 0),
        COMPLETIONS: openai_formatters(lambda: 0),
        MESSAGES: anthropic_formatters(),
        RESPONSES: responses_formatters(lambda: 0),
    }
    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
    return EdgeLifecycle(
        core, tokenizer, port, metrics, Clock(), workers=3, request_timeout_ns=TIMEOUT, formatters=formatters
    )


def post(path: str, body: dict[str, Any], key: str) -> Request:
    return Request("POST", path, [(b"x-api-key", key.encode())], json.dumps(body).encode(), t_receive_ns=0)


def constraint_in(port: FakePort, frame: int) -> str:
    """The grammar written after the prompt in ``frame`` (as the slot server reads it)."""
    req = port.frames.request_headers[frame]
    n, count = req.token_count, wire.constraint_words(req.flags)
    assert count > 0, "no grammar follows the prompt"
    return wire.read_constraint(port.frames.tokens[frame, n : n + count])


@pytest.mark.parametrize("ask", list(ASKS))
def test_a_grammar_is_built_on_a_worker_once_per_tenant_and_then_taken_from_its_cache(ask: str) -> None:
    path, doc = ASKS[ask]
    port, tokenizer = wide_port(), ChatChars()
    edge = lifecycle(port, tokenizer)
    (first,) = edge.receive(1, post(path, doc, "a"), now=0)  # a small prompt, but a grammar to build: a worker's
    assert isinstance(first, Tokenize) and first.grammar is not None and tokenizer.calls == 0
    n, built = work_on_worker(tokenizer, first)  # what the worker does, off the loop
    assert isinstance(n, int) and built is not None
    assert edge.tokenized(1, n, now=1, words=built) == []  # submitted, the grammar after the prompt
    grammar = constraint_in(port, port.submitted[0])
    assert grammar.startswith("root ::=") or "root ::=" in grammar
    assert edge.receive(2, post(path, doc, "a"), now=2) == []  # the same tenant again: from its cache, inline
    assert constraint_in(port, port.submitted[1]) == grammar and edge.grammars.hits == 1
    (other,) = edge.receive(3, post(path, doc, "b"), now=3)  # another tenant, the same schema: built for it
    assert isinstance(other, Tokenize) and other.grammar is not None and edge.grammars.misses == 2


def test_a_requests_logit_biases_follow_its_grammars_words_built_or_from_the_cache() -> None:
    """The cache keeps a grammar's words alone; each request's own logit biases follow them after its prompt."""
    port, tokenizer = wide_port(), ChatChars()
    edge = lifecycle(port, tokenizer)
    path, doc = ASKS["chat response_format"]
    (first,) = edge.receive(1, post(path, {**doc, "logit_bias": {"5": 2}}, "a"), now=0)
    assert isinstance(first, Tokenize)
    n, built = work_on_worker(tokenizer, first)
    assert edge.tokenized(1, n, now=1, words=built) == []
    assert edge.receive(2, post(path, {**doc, "logit_bias": {"7": -3}}, "a"), now=2) == []  # from the cache
    read = []
    for frame in port.submitted:
        req = port.frames.request_headers[frame]
        after = port.frames.tokens[frame, req.token_count : req.token_count + wire.constraint_words(req.flags)]
        read.append(wire.read_after_prompt(after, req.logit_biases))
    assert read[0][0] == read[1][0] and read[0][0] is not None and "root ::=" in read[0][0]
    assert (read[0][1], read[1][1]) == (((5, 2.0),), ((7, -3.0),)) and edge.grammars.hits == 1


def test_a_grammar_and_logit_biases_too_many_words_together_are_a_400_naming_both_and_the_frame_is_given_back() -> None:
    port, tokenizer = wide_port(), ChatChars()
    edge = lifecycle(port, tokenizer)
    path, doc = ASKS["chat response_format"]
    (first,) = edge.receive(1, post(path, {**doc, "logit_bias": {"5": 2}}, "a"), now=0)
    assert isinstance(first, Tokenize)
    n, _ = work_on_worker(tokenizer, first)
    full = np.ones(wire.CONSTRAINT_WORDS_MAX, np.int32)  # a grammar as large as may travel: no room for a bias
    (answer,) = edge.tokenized(1, n, now=1, words=full)
    assert isinstance(answer, Respond) and answer.response.status == 400
    error = json.loads(answer.response.body)["error"]
    assert error["param"].startswith("response_format") and "'logit_bias'" in error["message"]
    assert not port.held and not port.submitted


def test_a_grammar_the_converter_refuses_is_a_400_naming_the_field_in_the_shape_and_nothing_is_kept() -> None:
    """The check at parse passes what it can see; the converter's own refusal comes from the worker: answered in the
    route's shape, the frame given back, nothing cached."""
    port, tokenizer = wide_port(), ChatChars()
    edge = lifecycle(port, tokenizer)
    bad = {"type": "string", "pattern": "abc"}  # the converter wants ^...$
    body = {"model": MODEL, "messages": HI, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": bad}}}  # fmt: skip
    (work,) = edge.receive(1, post(CHAT, body, "a"), now=0)
    assert isinstance(work, Tokenize)
    with pytest.raises(Exception) as raised:
        work_on_worker(tokenizer, work)
    (answer,) = edge.tokenized(1, raised.value, now=1)
    assert isinstance(answer, Respond) and answer.response.status == 400
    error = json.loads(answer.response.body)["error"]
    assert error["param"] == "response_format.json_schema.schema" and "cannot be made a grammar" in error["message"]
    assert not port.held and edge.grammars.held("a") == 0
    anthropic = {"model": MODEL, "messages": HI, "max_tokens": 4,
                 "output_config": {"format": {"type": "json_schema", "schema": bad}}}  # fmt: skip
    (work,) = edge.receive(2, post(MESSAGES, anthropic, "a"), now=2)
    assert isinstance(work, Tokenize)
    with pytest.raises(Exception) as raised:
        work_on_worker(tokenizer, work)
    (answer,) = edge.tokenized(2, raised.value, now=3)
    refused = json.loads(answer.response.body)
    assert answer.response.status == 400 and refused["type"] == "error"
    assert refused["error"]["message"].startswith("the schema cannot be made a grammar")


# -- through the service: a grammar being built holds up nobody -----------------------------------------------------


class BlockingShape:
    """An API shape whose requests ask for a grammar whose build waits for ``release`` (a converter that takes
    long), counted in ``started``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def build(self) -> np.ndarray:
        self.started.set()
        assert self.release.wait(30), "the test never released the build"
        return wire.constraint_encoding('root ::= "x"')

    def handle(self, path: str, method: str, body: bytes) -> Work:
        grammar = Grammar(b"slow", self.build, "response_format")
        return Work("generate", "hi", None, 4, False, route=GENERATE, grammar=grammar)

    def error(self, exc: Any) -> Response:
        raise AssertionError(f"no error expected: {exc}")


@pytest.fixture
def slots(tmp_path: Path) -> Iterator[Server]:
    yield from start_server(tmp_path, None)


def test_a_grammar_being_built_does_not_hold_up_another_request(slots: Server) -> None:
    async def go() -> tuple[Recorded, Recorded, EdgeService]:
        shape = BlockingShape()
        agent = Agent(LoopbackTransport(peer_keys(None)), frames=4, input_capacity=64, output_capacity=64)
        agent.attach(slots.address)
        tokenizer = CharTokenizer()
        core = HttpCore(Limits(1 << 20, 64, 64, tokenizer.vocab_size), openai=shape)  # type: ignore[arg-type]
        service = EdgeService(core, tokenizer, agent, asyncio.get_running_loop(), ThreadPoolExecutor(2), workers=2)
        service.start()
        slow, quick = Recorded(), Recorded()
        service.handle(Request("POST", COMPLETIONS, [], b"{}", lib.ep_now_ns()), slow)
        await asyncio.to_thread(shape.started.wait, 30)  # its grammar is being built on a worker
        service.handle(generate("quick"), quick)
        await asyncio.wait_for(quick.done.wait(), 30)  # answered while the build still waits
        assert not slow.done.is_set()
        shape.release.set()
        await asyncio.wait_for(slow.done.wait(), 30)
        await until(lambda: service.pending == 0, "the service holds nothing")
        service.stop()
        return slow, quick, service

    slow, quick, service = asyncio.run(go())
    assert quick.response.status == 200 and slow.response.status == 200
    assert service.lifecycle.grammars.held("anonymous") == 1  # kept for the (anonymous) tenant that sent it
    assert free_frames(service) == 4
