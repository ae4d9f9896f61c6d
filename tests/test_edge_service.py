"""The edge service without a network: every request answered once, every frame given back.

A real agent and a real slot server (echo, on a thread) over the loopback transport; requests are
fed to :meth:`EdgeService.handle` directly, as the adapters do.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edgepath.dma.handlers import SlotRequest, echo
from edgepath.dma.loopback import LoopbackTransport
from edgepath.dma.slot_server import SlotServer, SlotServerConfig
from edgepath.dpu.agent import Agent
from edgepath.edge.http import HttpCore, Limits, Request, Response
from edgepath.edge.service import EdgeService
from edgepath.edge.tokenizer import INLINE_CHARS
from edgepath.native.abi import lib


class CountingTokenizer:
    """One id per character (id = code point % 1000); counts calls; can be told to fail."""

    name = "test"
    vocab_size = 1000

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def encode(self, text: str) -> np.ndarray:
        self.calls += 1
        if self.fail:
            raise ValueError("tokenizer exploded")
        return np.array([ord(c) % 1000 for c in text], dtype=np.int32)

    def encode_into(self, text: str, out: np.ndarray) -> int:
        ids = self.encode(text)
        if len(ids) <= len(out):
            out[: len(ids)] = ids
        return len(ids)

    def decode(self, ids: np.ndarray) -> str:
        return "".join(chr(int(i)) for i in ids)


@dataclass
class Server:
    address: str
    server: SlotServer
    gate: threading.Event  # the handler waits for it; set unless a test holds results back


@pytest.fixture
def slot_server(tmp_path: Path) -> Iterator[Server]:
    gate = threading.Event()
    gate.set()

    def gated_echo(request: SlotRequest) -> int:
        gate.wait(30)
        return echo(request)

    address = str(tmp_path / "slots.sock")
    server = SlotServer(LoopbackTransport(), address, gated_echo, SlotServerConfig(slots=4, input_capacity=64))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield Server(address, server, gate)
    gate.set()
    server.stop()
    thread.join(timeout=5)
    server.close()


async def new_service(srv: Server, tokenizer: CountingTokenizer, frames: int, **options: float) -> EdgeService:
    agent = Agent(LoopbackTransport(), frames=frames, input_capacity=64, output_capacity=64)
    agent.attach(srv.address)
    # attach() returns before the slot server's connection thread has admitted the agent, and a
    # doorbell from a connection it has not admitted yet gets its result dropped (a data-path race,
    # reported); wait for the admission so the first requests do not hit it.
    for _ in range(5000):
        if srv.server.stats.connections:
            break
        await asyncio.sleep(0.001)
    service = EdgeService(
        HttpCore(Limits(1 << 20, 64, 64, tokenizer.vocab_size)),
        tokenizer,
        agent,
        asyncio.get_running_loop(),
        ThreadPoolExecutor(1),
        **options,
    )
    service.start()
    return service


def free_frames(agent: Agent) -> int:
    taken = []
    while (index := agent.acquire()) is not None:
        taken.append(index)
    for index in taken:
        agent.release(index)
    return len(taken)


async def serve_requests(
    srv: Server, tokenizer: CountingTokenizer, frames: int, requests: list[Request]
) -> tuple[list[Response], EdgeService]:
    service = await new_service(srv, tokenizer, frames)
    answers: list[list[Response]] = [[] for _ in requests]
    done = asyncio.Event()

    def responder(i: int) -> Callable[[Response], None]:
        def respond(response: Response) -> None:
            answers[i].append(response)
            if all(answers):
                done.set()

        return respond

    for i, request in enumerate(requests):
        service.handle(request, responder(i))
    await asyncio.wait_for(done.wait(), 30)
    await asyncio.sleep(0)  # anything answered twice would show up now
    assert all(len(a) == 1 for a in answers), "every request is answered exactly once"
    service.stop()
    return [a[0] for a in answers], service


def generate(prompt: str) -> Request:
    return Request("POST", "/v1/generate", [], f'{{"prompt": "{prompt}"}}'.encode(), lib.ep_now_ns())


def test_more_requests_than_frames_are_refused_before_tokenizing(slot_server: Server) -> None:
    tokenizer = CountingTokenizer()
    responses, service = asyncio.run(serve_requests(slot_server, tokenizer, 2, [generate(f"p{i}") for i in range(6)]))
    statuses = [r.status for r in responses]
    assert statuses.count(200) == 2 and statuses.count(429) == 4
    assert tokenizer.calls == 2  # the refused ones never reached the tokenizer
    assert free_frames(service.agent) == 2


def test_tokenizer_failure_is_a_500_and_the_frame_comes_back(slot_server: Server) -> None:
    tokenizer = CountingTokenizer()
    tokenizer.fail = True
    big = "x" * (INLINE_CHARS + 1)  # also the worker-thread path
    responses, service = asyncio.run(serve_requests(slot_server, tokenizer, 4, [generate("small"), generate(big)]))
    assert [r.status for r in responses] == [500, 500]
    assert b"tokenizer exploded" in responses[0].body
    assert free_frames(service.agent) == 4


def test_too_long_after_tokenizing_releases_the_frame(slot_server: Server) -> None:
    responses, service = asyncio.run(
        serve_requests(slot_server, CountingTokenizer(), 4, [generate("y" * 65), generate("y" * 64)])
    )
    assert [r.status for r in responses] == [400, 200]
    assert b"65 tokens" in responses[0].body
    assert free_frames(service.agent) == 4


def test_cancelled_requests_release_frames_without_answering(slot_server: Server) -> None:
    async def go() -> tuple[list[Response], int]:
        service = await new_service(slot_server, CountingTokenizer(), 4)
        agent = service.agent
        answered: list[Response] = []
        tickets = [service.handle(generate(p), answered.append) for p in ("a" * 10, "b" * (INLINE_CHARS + 1))]
        for ticket in tickets:
            ticket.cancel()  # one in flight at the slot server, one on the tokenizer thread
        last = asyncio.Event()
        service.handle(generate("after"), lambda r: (answered.append(r), last.set()))
        await asyncio.wait_for(last.wait(), 30)
        for _ in range(200):  # the cancelled ones finish in the background
            if not service.inflight and free_frames(agent) == 4:
                break
            await asyncio.sleep(0.01)
        service.stop()
        return answered, free_frames(agent)

    answered, free = asyncio.run(go())
    assert [r.status for r in answered] == [200]
    assert free == 4


def test_a_request_without_result_in_time_gets_504_and_its_frame_back_later(slot_server: Server) -> None:
    async def go() -> tuple[list[Response], int, int]:
        service = await new_service(slot_server, CountingTokenizer(), 2, request_timeout=0.05, check_interval=0.02)
        slot_server.gate.clear()  # the handler holds the result back
        answered: list[Response] = []
        first = asyncio.Event()
        service.handle(generate("slow"), lambda r: (answered.append(r), first.set()))
        await asyncio.wait_for(first.wait(), 30)
        held = free_frames(service.agent)  # the frame stays out while a late result may still land in it
        slot_server.gate.set()
        for _ in range(3000):
            if not service.inflight:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # a second answer would show up now
        service.stop()
        return answered, held, free_frames(service.agent)

    answered, held, free = asyncio.run(go())
    assert [r.status for r in answered] == [504]
    assert held == 1 and free == 2
