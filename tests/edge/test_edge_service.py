"""The edge service without a network: every request answered once, every frame given back.

A real agent and a real slot server (on a thread) over the loopback transport; requests are fed to
:meth:`EdgeService.handle` directly with a recording reply, as the adapters do.  Nothing waits by
time: tests wait for answers (events) or for states (frames free, nothing pending).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.tokenizers import CharTokenizer

from edgepath.dpu.agent import Agent
from edgepath.edge.http import Headers, Limits, Request, Response
from edgepath.edge.routes import HttpCore
from edgepath.edge.service import WORKER_NICE, EdgeService, lower_priority
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.text.tokenizer import INLINE_CHARS
from edgepath.edge.turns import LARGE_BODY
from edgepath.native.abi import lib
from edgepath.peer_secret import peer_keys
from edgepath.slots.handlers import BatchHandler, PacedEcho, SlotRequest, echo
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.loopback import LoopbackTransport

CAP = 64


@dataclass
class Recorded:
    """A reply that records what the service sent, in order, and signals when the answer is complete."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    parts: list[tuple[str, object]] = field(default_factory=list)

    def respond(self, response: Response) -> None:
        self.parts.append(("respond", response))
        self.done.set()

    def start(self, status: int, headers: Headers) -> None:
        self.parts.append(("start", status))

    def send(self, data: bytes) -> None:
        self.parts.append(("send", data))

    def end(self, data: bytes) -> None:
        self.parts.append(("end", data))
        self.done.set()

    @property
    def response(self) -> Response:
        (kind, response), *_ = self.parts
        assert kind == "respond" and len(self.parts) == 1, self.parts
        assert isinstance(response, Response)
        return response


@dataclass
class Server:
    address: str
    server: SlotServer
    gate: threading.Event  # the gated echo waits for it; set unless a test holds results back


def start_server(tmp_path: Path, handler: object, stream_window: float = 0.0) -> Iterator[Server]:
    gate = threading.Event()
    gate.set()
    if handler is None:

        def handler(request: SlotRequest) -> int:
            gate.wait(30)
            return echo(request)

    address = str(tmp_path / "slots.sock")
    config = SlotServerConfig(slots=4, input_capacity=CAP, output_capacity=CAP, stream_window=stream_window)
    server = SlotServer(LoopbackTransport(peer_keys(None)), address, handler, config)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield Server(address, server, gate)
    gate.set()
    server.stop()
    thread.join(timeout=5)
    server.close()


@pytest.fixture
def slot_server(tmp_path: Path) -> Iterator[Server]:
    yield from start_server(tmp_path, None)


@pytest.fixture
def paced_server(tmp_path: Path) -> Iterator[Server]:
    handler: BatchHandler = PacedEcho(token_delay=0.02)
    yield from start_server(tmp_path, handler)


def new_service(srv: Server, tokenizer: CharTokenizer, frames: int, workers: int = 1, **options: float) -> EdgeService:
    agent = Agent(LoopbackTransport(peer_keys(None)), frames=frames, input_capacity=CAP, output_capacity=CAP)
    agent.attach(srv.address)  # returns once the slot server has admitted the agent
    service = EdgeService(
        HttpCore(Limits(1 << 20, CAP, CAP, tokenizer.vocab_size)),
        tokenizer,
        agent,
        asyncio.get_running_loop(),
        ThreadPoolExecutor(workers),
        workers=workers,
        **options,
    )
    service.start()
    return service


def free_frames(service: EdgeService) -> int:
    port = service.port
    taken = []
    while (index := port.acquire()) is not None:
        taken.append(index)
    for index in taken:
        port.release(index)
    return len(taken)


async def until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Wait for a state (checked on every loop turn), failing after ``limit`` seconds with ``what``."""
    async with asyncio.timeout(limit):
        while not condition():
            await asyncio.sleep(0.002)
    assert condition(), what


async def serve_requests(
    srv: Server, tokenizer: CharTokenizer, frames: int, requests: list[Request], workers: int = 1
) -> tuple[list[Recorded], EdgeService]:
    service = new_service(srv, tokenizer, frames, workers)
    replies = [Recorded() for _ in requests]
    for request, reply in zip(requests, replies, strict=True):
        service.handle(request, reply)
    await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in replies)), 30)
    await until(lambda: service.pending == 0, "the service holds nothing")
    assert all(len([p for p in r.parts if p[0] in ("respond", "end")]) == 1 for r in replies), "answered once"
    service.stop()
    return replies, service


def generate(prompt: str, stream: bool = False) -> Request:
    body = f'{{"prompt": "{prompt}", "stream": {"true" if stream else "false"}}}'.encode()
    return Request("POST", "/v1/generate", [], body, lib.ep_now_ns())


def test_more_requests_than_frames_are_refused_before_tokenizing(slot_server: Server) -> None:
    tokenizer = CharTokenizer()
    replies, service = asyncio.run(serve_requests(slot_server, tokenizer, 2, [generate(f"p{i}") for i in range(6)]))
    statuses = [r.response.status for r in replies]
    assert statuses.count(200) == 2 and statuses.count(429) == 4
    assert tokenizer.calls == 2  # the refused ones never reached the tokenizer
    assert free_frames(service) == 2


def test_tokenizer_failure_is_a_500_and_the_frame_comes_back(slot_server: Server) -> None:
    tokenizer = CharTokenizer()
    tokenizer.fail = True
    big = "x" * (INLINE_CHARS + 1)  # also the worker-thread path
    replies, service = asyncio.run(serve_requests(slot_server, tokenizer, 4, [generate("small"), generate(big)]))
    assert [r.response.status for r in replies] == [500, 500]
    assert b"tokenizer exploded" in replies[0].response.body
    assert free_frames(service) == 4


def test_too_long_after_tokenizing_releases_the_frame(slot_server: Server) -> None:
    requests = [generate("y" * (CAP + 1)), generate("y" * CAP)]
    replies, service = asyncio.run(serve_requests(slot_server, CharTokenizer(), 4, requests))
    assert [r.response.status for r in replies] == [400, 200]
    assert f"{CAP + 1} tokens".encode() in replies[0].response.body
    assert free_frames(service) == 4


def test_a_burst_of_large_prompts_gets_the_free_workers_and_429_for_the_rest(slot_server: Server) -> None:
    big = [generate(f"{i}" + "q" * (CAP - 1) + " " * INLINE_CHARS) for i in range(6)]  # long text, fits no slot
    replies, service = asyncio.run(serve_requests(slot_server, CharTokenizer(), 8, big, workers=3))
    kinds = [r.response.status for r in replies]
    # the burst (one tenant's) arrives in one loop turn: its share of the workers (all but one) takes two prompts,
    # the rest are refused at once
    assert kinds[:2] == [400, 400] and kinds[2:] == [429] * 4
    assert all(b"tokenizer_busy" in r.response.body for r in replies[2:])
    assert free_frames(service) == 8


def test_clients_gone_abandon_their_frames_and_get_nothing(slot_server: Server) -> None:
    async def go() -> tuple[list[Recorded], Recorded, EdgeService]:
        service = new_service(slot_server, CharTokenizer(), 4)
        gone = [Recorded(), Recorded()]
        tickets = [
            service.handle(generate(p), r) for p, r in zip(("a" * 10, "b" * (INLINE_CHARS + 1)), gone, strict=True)
        ]
        for ticket in tickets:
            ticket.cancel()  # one in flight at the slot server, one on the tokenizer thread
        last = Recorded()
        service.handle(generate("after"), last)
        await asyncio.wait_for(last.done.wait(), 30)
        await until(lambda: service.pending == 0 and free_frames(service) == 4, "every frame back")
        service.stop()
        return gone, last, service

    gone, last, service = asyncio.run(go())
    assert [r.parts for r in gone] == [[], []]
    assert last.response.status == 200
    assert service.port.delivery_stats.abandoned == 1  # the in-flight one; the other never left the edge


def test_a_tick_that_raises_does_not_end_the_ticks(slot_server: Server) -> None:
    """Issue 37: the ticks answer what no delivery will (a lost link's 503, a deadline's 504); one tick that raised
    used to end them all, so every stream on a lost link stalled until its client's idle timeout.  Here the first
    tick raises, and a later one still answers the request past its deadline."""

    async def go() -> tuple[Recorded, int]:
        service = new_service(slot_server, CharTokenizer(), 2, request_timeout=0.05, check_interval=0.02)
        slot_server.gate.clear()  # the handler holds the result back: only a tick answers (504)
        tick, raised = service.lifecycle.tick, []

        def flaky(now: int) -> list:
            if not raised:
                raised.append(now)
                raise RuntimeError("a tick that failed")
            return tick(now)

        service.lifecycle.tick = flaky  # type: ignore[method-assign]
        reply = Recorded()
        service.handle(generate("slow"), reply)
        await asyncio.wait_for(reply.done.wait(), 30)
        slot_server.gate.set()
        service.stop()
        return reply, len(raised)

    reply, raised = asyncio.run(go())
    assert raised == 1
    assert reply.response.status == 504


def test_a_request_without_result_in_time_gets_504_and_the_edge_holds_nothing(slot_server: Server) -> None:
    async def go() -> tuple[Recorded, int, int, EdgeService]:
        service = new_service(slot_server, CharTokenizer(), 2, request_timeout=0.05, check_interval=0.02)
        slot_server.gate.clear()  # the handler holds the result back
        reply = Recorded()
        service.handle(generate("slow"), reply)
        await asyncio.wait_for(reply.done.wait(), 30)
        pending = service.pending  # the edge forgot the request when it answered 504 ...
        held = free_frames(service)  # ... and the port keeps the frame until the slot server lets go
        slot_server.gate.set()
        await until(lambda: free_frames(service) == 2, "the frame comes back when the late result is fenced off")
        service.stop()
        return reply, pending, held, service

    reply, pending, held, service = asyncio.run(go())
    assert reply.response.status == 504
    assert pending == 0 and held == 1
    stats = service.port.delivery_stats
    assert stats.abandoned == 1 and stats.duplicates == 0 and stats.unknown == 0


def test_a_streamed_request_is_sent_as_the_tokens_arrive(paced_server: Server) -> None:
    replies, service = asyncio.run(
        serve_requests(paced_server, CharTokenizer(), 4, [generate("streamed", stream=True), generate("whole")])
    )
    streamed, whole = replies
    kinds = [kind for kind, _ in streamed.parts]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("send") >= 2  # paced: several deliveries
    data = b"".join(part for kind, part in streamed.parts if kind in ("send", "end"))  # type: ignore[misc]
    tokens = [int(line[len(b'data: {"token": ') : -1]) for line in data.split(b"\n") if line.startswith(b'data: {"t')]
    assert "".join(map(chr, tokens)) == "streamed"
    assert b'"first_token_ms"' in data and b"event: done" in data
    assert whole.response.status == 200 and b'"text":"whole"' in whole.response.body
    text = service.metrics.exposition().decode()
    assert "edgepath_time_to_first_token_seconds_count 2.0" in text
    assert free_frames(service) == 4


def test_a_client_gone_mid_stream_stops_the_handler_and_frees_everything(paced_server: Server) -> None:
    async def go() -> tuple[Recorded, EdgeService]:
        service = new_service(paced_server, CharTokenizer(), 4)
        reply = Recorded()
        ticket = service.handle(generate("z" * CAP, stream=True), reply)  # 64 tokens, 20 ms apart
        await until(lambda: any(kind == "send" for kind, _ in reply.parts), "the first event")
        ticket.cancel()
        sent = len(reply.parts)
        await until(lambda: free_frames(service) == 4, "the frame comes back once the slot is cancelled")
        await until(lambda: service.port.free_slots() == (4, 4), "every slot FREE")
        assert len(reply.parts) == sent  # nothing more went to the client that left
        service.stop()
        return reply, service

    reply, service = asyncio.run(go())
    assert not reply.done.is_set()
    assert service.port.delivery_stats.abandoned == 1
    assert paced_server.server.stats.cancelled == 1  # the handler was stopped, not run to its end


def test_the_event_loops_lag_is_measured(slot_server: Server) -> None:
    """A probe due every 50 ms records how late the loop ran it (``edgepath_event_loop_lag_seconds``): a callback
    that holds the loop 300 ms shows as one sample past the 250 ms bucket -- what /health/live waited meanwhile."""

    async def go() -> EdgeService:
        service = new_service(slot_server, CharTokenizer(), 2)
        await asyncio.sleep(0.2)  # a few probes on an idle loop
        asyncio.get_running_loop().call_soon(time.sleep, 0.3)  # something holding the loop
        await asyncio.sleep(0.2)
        service.stop()
        return service

    service = asyncio.run(go())
    registry = service.metrics.registry
    count = registry.get_sample_value("edgepath_event_loop_lag_seconds_count")
    under = registry.get_sample_value("edgepath_event_loop_lag_seconds_bucket", {"le": "0.25"})
    assert count is not None and under is not None and count >= 4 and count - under >= 1


def test_a_tenants_large_requests_wait_for_their_turn_and_a_small_one_is_answered_first(slot_server: Server) -> None:
    """Three large requests of one tenant and a small one of another arrive together: the small one is read (and, a
    /v1/tokenize, answered) at once, the large ones one per loop turn, and past LARGE_WAITING the tenant's next large
    one is 429 before it is read."""
    pad = " " * LARGE_BODY

    def request(key: str, prompt: str) -> Request:
        if key == "b":  # a small /v1/tokenize: answered as soon as it is read
            body, path = json.dumps({"prompt": prompt}).encode(), "/v1/tokenize"
        else:
            body, path = json.dumps({"prompt": prompt, "max_tokens": 2}).encode(), "/v1/generate"
        return Request("POST", path, [(b"x-api-key", key.encode())], body, lib.ep_now_ns())

    async def go() -> list[Recorded]:
        agent = Agent(LoopbackTransport(peer_keys(None)), frames=8, input_capacity=CAP, output_capacity=CAP)
        agent.attach(slot_server.address)
        core = HttpCore(Limits(1 << 20, CAP, CAP, CharTokenizer().vocab_size), ApiKeys(["a", "b"]))
        service = EdgeService(
            core, CharTokenizer(), agent, asyncio.get_running_loop(), ThreadPoolExecutor(2), workers=2
        )
        service.start()
        order: list[str] = []

        @dataclass
        class Named(Recorded):
            name: str = ""

            def respond(self, response: Response) -> None:
                order.append(self.name)
                super().respond(response)

        replies: list[Recorded] = [Named(name=name) for name in ("a1", "a2", "a3", "b")]
        for reply, (key, prompt) in zip(
            replies, [("a", "x" + pad), ("a", "y" + pad), ("a", "z" + pad), ("b", "hi")], strict=True
        ):
            service.handle(request(key, prompt), reply)
        await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in replies)), 30)
        service.stop()
        assert order[:2] == ["a3", "b"]  # the refused one, then the small one: both before any large one was read
        return replies

    replies = asyncio.run(go())
    # a1: read in its turn, too long for a slot; a2: its turn came while a1 held a's share of the tokenizer workers
    assert [r.response.status for r in replies] == [400, 429, 429, 200]
    assert b"tokenizer_busy" in replies[1].response.body and b"large_requests_waiting" in replies[2].response.body


def test_tokenizer_workers_run_at_a_lower_priority_than_the_event_loop() -> None:
    """One tenant's large prompt on a worker yields the CPUs to the event loop and the model."""
    with ThreadPoolExecutor(1, initializer=lower_priority) as pool:
        nice = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
