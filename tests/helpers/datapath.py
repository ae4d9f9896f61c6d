"""Slot servers and agents on the chosen transport, for the slots and dpu suites.

``make_server`` builds a slot server whose loop the test turns by hand (:func:`serve_once`); ``serve``
runs the real loop on a thread.  ``new_agent`` builds agents; all are closed after the test.  A
conftest brings the fixtures into a suite with ``from helpers.datapath import ...``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from edgepath.contract import wire
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.dpu.port import Delivery
from edgepath.slots.handlers import echo
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.base import Transport
from helpers.waiting import eventually

CAP = 64  # tokens in and out, unless a test says otherwise


def _config(slots: int, cap: int, **config: Any) -> SlotServerConfig:
    return SlotServerConfig(slots=slots, input_capacity=cap, output_capacity=cap, **config)


@pytest.fixture
def make_server(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> Iterator[Callable[..., SlotServer]]:
    """Slot servers that accept agents; their loop is turned by the test (:func:`serve_once`)."""
    servers: list[SlotServer] = []

    def make(handler: Any = echo, slots: int = 2, cap: int = CAP, **config: Any) -> SlotServer:
        server = SlotServer(new_transport(), new_address("slot-server"), handler, _config(slots, cap, **config))
        server.start_connection_manager()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def serve(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> Iterator[Callable[..., SlotServer]]:
    """Slot servers running their real loop on a thread."""
    started: list[tuple[SlotServer, threading.Thread]] = []

    def start(handler: Any, slots: int = 2, cap: int = CAP, **config: Any) -> SlotServer:
        server = SlotServer(new_transport(), new_address("slot-server"), handler, _config(slots, cap, **config))
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stop()
        thread.join(timeout=5)
        server.close()


@pytest.fixture
def new_agent(new_transport: Callable[[], Transport]) -> Callable[..., Agent]:
    """Agents on the chosen transport (closed with it)."""

    def make(
        frames: int = 8, cap: int = CAP, max_servers: int = 2, max_slots_per_server: int = 64, **options: Any
    ) -> Agent:
        """``options``: more of :class:`Agent`'s keywords (``hang_timeout``, ``clock``)."""
        return Agent(
            new_transport(),
            frames=frames,
            input_capacity=cap,
            output_capacity=cap,
            max_servers=max_servers,
            max_slots_per_server=max_slots_per_server,
            **options,
        )

    return make


def serve_once(server: SlotServer, timeout: float = 5.0) -> int:
    """Start what the next completions ring, then turn the loop until those slots are answered."""
    started = server.process(server.transport.cq.wait(timeout))
    deadline = time.monotonic() + timeout
    while server.running and time.monotonic() < deadline:
        server.poll_once(0.01)
    return started


def roundtrip(agent: Agent, server: SlotServer, tokens: list[int], request_id: int = 1, cap: int = CAP) -> int:
    """One request through a hand-turned server; the frame it was answered in."""
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, tokens, request_id=request_id, max_new_tokens=cap)
    assert agent.submit(index) is None
    assert serve_once(server) == 1
    assert [d.index for d in agent.poll(timeout=5.0) if d.final] == [index]
    return index


def send(agent: Agent, tokens: list[int], max_new: int = CAP, stream: bool = True) -> int:
    """Submit one request (streamed unless ``stream`` is false); its frame."""
    index = agent.acquire()
    assert index is not None
    flags = wire.FLAG_STREAM if stream else 0
    write_request(agent.frames, index, tokens, request_id=index + 1, max_new_tokens=max_new, flags=flags)
    assert agent.submit(index) is None
    return index


def collect(agent: Agent, index: int, timeout: float = 10.0) -> list[Delivery]:
    """Deliveries for ``index`` until its final one (bounded in time)."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (got and got[-1].final):
        got += [d for d in agent.poll(timeout=0.5) if d.index == index]
    return got


def wait_free(server: SlotServer, timeout: float = 5.0) -> bool:
    """Whether every slot of ``server`` is FREE within ``timeout``."""
    return eventually(lambda: server.pool.free_count() == server.pool.slot_count, timeout)
