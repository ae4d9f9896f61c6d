"""The zero-copy promise checked on the real edge path, over the chosen data path (loopback here, RDMA
verbs in the soft-RoCE lane, ``--transport verbs``); ``edgepath serve`` over it end to end is in
tests/system/test_serve_data_path.py."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers.tokenizers import CharTokenizer

from edgepath.dpu.agent import Agent
from edgepath.edge.http import Headers, Limits, Request, Response
from edgepath.edge.lifecycle import Action, EdgeLifecycle, Respond
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.routes import HttpCore
from edgepath.edge.service import EdgeService
from edgepath.edge.text.tokenizer import Tokenizer, load_tokenizer
from edgepath.native.abi import REQUEST_HEADER, State, lib
from edgepath.slots.handlers import echo
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.base import Transport


class RecordingTokenizer:
    """The real default tokenizer, with a record of where each call put its ids (delegation, not a mock)."""

    def __init__(self, real: Tokenizer) -> None:
        self.real = real
        self.name, self.vocab_size = real.name, real.vocab_size
        self.into: list[np.ndarray] = []  # the ``out`` arrays encode_into wrote into
        self.fresh = 0  # calls that produced ids in memory of their own

    def encode_into(self, text: str, out: np.ndarray) -> int:
        self.into.append(out)
        return self.real.encode_into(text, out)

    def encode(self, text: str) -> np.ndarray:
        self.fresh += 1
        return self.real.encode(text)

    def decode(self, ids: np.ndarray) -> str:
        return self.real.decode(ids)


class OneAnswer:
    """A reply that keeps the one, unstreamed answer."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.body = b""

    def respond(self, response: Response) -> None:
        self.body = response.body
        self.done.set()

    def start(self, status: int, headers: Headers) -> None:
        raise AssertionError("not a streamed request")

    def send(self, data: bytes) -> None:
        raise AssertionError("not a streamed request")

    def end(self, data: bytes) -> None:
        raise AssertionError("not a streamed request")


@pytest.mark.transport
def test_the_edge_writes_token_ids_once_and_only_into_the_registered_frame(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> None:
    """The real EdgeService, the real default tokenizer (Tekken) and a real agent: every prompt's ids
    are produced by one tokenizer call whose output array *is* the frame's token area in the agent's
    registered requests region -- no list, no staging array, no second write."""
    tokenizer = RecordingTokenizer(load_tokenizer())
    address = new_address("slot-server")
    server = SlotServer(
        new_transport(), address, echo, SlotServerConfig(slots=4, input_capacity=256, output_capacity=256)
    )
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    prompts = ["zero copy at the edge", "Grüße aus 東京 🚀", "one more, " * 20]
    try:
        agent = Agent(new_transport(), frames=4, input_capacity=256, output_capacity=256)
        agent.attach(address)
        registered = agent.frames_mr.buf

        async def main() -> list[dict]:
            service = EdgeService(
                HttpCore(Limits(1 << 20, 256, 256, tokenizer.vocab_size)),
                tokenizer,
                agent,
                asyncio.get_running_loop(),
                ThreadPoolExecutor(1),
                workers=1,
            )
            service.start()
            answers: list[dict] = []
            for prompt in prompts:
                reply = OneAnswer()
                body = json.dumps({"prompt": prompt}).encode()
                service.handle(Request("POST", "/v1/generate", [], body, lib.ep_now_ns()), reply)
                await asyncio.wait_for(reply.done.wait(), 30)
                answers.append(json.loads(reply.body))
            service.stop()
            return answers

        answers = asyncio.run(main())
    finally:
        server.stop()
        thread.join(timeout=5)
        server.close()
    assert tokenizer.fresh == 0, "a generate request's ids were produced outside the frame"
    assert len(tokenizer.into) == len(prompts), "one tokenizer write per request"
    frame_bytes = agent.frames.request_stride
    for out, answer, prompt in zip(tokenizer.into, answers, prompts, strict=True):
        assert np.shares_memory(out, registered), "the tokenizer wrote outside the registered region"
        offset = out.__array_interface__["data"][0] - registered.__array_interface__["data"][0]
        index, within = divmod(offset, frame_bytes)
        assert 0 <= index < 4 and within == REQUEST_HEADER.itemsize and out.shape == (256,), "not a token area"
        expected = tokenizer.real.encode(prompt)
        assert answer["tokens"] == expected.tolist() and answer["text"] == prompt  # echoed from the slot
        assert answer["input_count"] == len(expected)


@pytest.mark.transport
def test_a_429_is_decided_inside_the_request_event_while_the_slot_server_does_nothing(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> None:
    """The "429 at once" promise, structurally: with every slot claimed, the refusal is the return value of the
    very call that received the request -- no event, no poll, no timer in between -- and the slot server's loop never
    turned meanwhile (its heartbeat did not move): the refusal awaited nothing from it.  Admission is the
    agent's compare-and-swap on the pool's memory, answered by the NIC (or shared memory), never by the server."""
    server = SlotServer(new_transport(), new_address("slot-server"), echo, SlotServerConfig(slots=2, input_capacity=64))
    server.start_connection_manager()  # accepts the agent; the loop that serves slots is never run here
    try:
        agent = Agent(new_transport(), frames=4, input_capacity=64, output_capacity=64)
        agent.attach(server.address)
        edge = EdgeLifecycle(
            HttpCore(Limits(1 << 20, 64, 64, CharTokenizer.vocab_size)),
            CharTokenizer(),
            agent,
            EdgeMetrics(lambda: 0, lambda: agent.delivery_stats),
            lib.ep_now_ns,
            workers=1,
            request_timeout_ns=60 * 10**9,
        )

        def receive(rid: int) -> list[Action]:
            body = json.dumps({"tokens": [1, 2, 3], "max_tokens": 3}).encode()
            now = lib.ep_now_ns()
            return edge.receive(rid, Request("POST", "/v1/generate", [], body, now), now)

        assert receive(1) == [] and receive(2) == []  # both slots claimed: in flight, waiting for the server
        (refused,) = receive(3)
        assert isinstance(refused, Respond) and refused.response.status == 429
        assert json.loads(refused.response.body)["error"]["type"] == "no_slot"
        assert server.memory.beats == 0 and server.pool.count(State.CLAIMED) == 2
    finally:
        server.close()
