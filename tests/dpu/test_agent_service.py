"""The agent as its own process's service, and the edge's client of it, in one test process: frame ranges
per edge, refusals answered through the frame, streamed answers and cancels relayed, the status region,
an edge or the agent going away.  (tests/dpu/test_e2e_multiprocess.py runs them as separate processes.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.datapath import serve_once
from helpers.waiting import eventually

from edgepath.contract import wire
from edgepath.contract.pool import FrameLayout
from edgepath.dpu.agent import Agent
from edgepath.dpu.agent_client import AgentClient
from edgepath.dpu.agent_service import AgentService
from edgepath.dpu.frame import write_request
from edgepath.dpu.link_state import LinkState, Reason
from edgepath.dpu.port import Delivery
from edgepath.native.abi import Status
from edgepath.peer_secret import peer_keys
from edgepath.slots.handlers import PacedEcho, echo
from edgepath.slots.server import SlotServer
from edgepath.transports.base import Access, TransportError
from edgepath.transports.loopback import LoopbackTransport
from edgepath.transports.peer_auth import UNKNOWN_SECRET, PeerKeys, PeerRefused

CAP = 32
FRAMES, PER_EDGE = 8, 4


class Running:
    """An agent process's service on a thread, attached to ``slot_server``."""

    def __init__(self, address: str, slot_server: str, **options: Any) -> None:
        """``options``: more of :class:`Agent`'s keywords (``hang_timeout``)."""
        self.transport = LoopbackTransport(peer_keys(None))
        self.agent = Agent(
            self.transport,
            frames=FRAMES,
            input_capacity=CAP,
            output_capacity=CAP,
            frames_access=Access.REMOTE_WRITE,
            **options,
        )
        self.agent.attach(slot_server)
        self.service = AgentService(self.agent, self.transport, address, frames_per_edge=PER_EDGE)
        self.thread = threading.Thread(target=self.service.serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if not self.thread.is_alive():
            return  # closed already
        self.service.close()
        self.thread.join(timeout=5)
        self.transport.close()


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    made: list[Running] = []

    def start(slot_server: str, **options: Any) -> Running:
        running = Running(str(tmp_path / f"agent-{len(made)}.sock"), slot_server, **options)
        made.append(running)
        return running

    yield start
    for running in made:
        running.close()


@pytest.fixture
def clients() -> Iterator[Callable[[str], AgentClient]]:
    made: list[AgentClient] = []

    def connect(address: str) -> AgentClient:
        client = AgentClient(address, peer_keys(None))
        made.append(client)
        return client

    yield connect
    for client in made:
        client.close()


def _submit(client: AgentClient, tokens: list[int], max_new: int = CAP, stream: bool = False) -> int:
    index = client.acquire()
    assert index is not None
    flags = wire.FLAG_STREAM if stream else 0
    write_request(client.frames, index, tokens, request_id=100 + index, max_new_tokens=max_new, flags=flags)
    assert client.submit(index) is None
    return index


def _answers(client: AgentClient, index: int, timeout: float = 10.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (got and got[-1].final):
        got += [d for d in client.poll(timeout=0.2) if d.index == index]
    return got


def test_an_edge_is_served_through_the_agent_in_its_own_frames(serve, agent_process, clients) -> None:
    server = serve(echo, slots=2, cap=CAP)
    running = agent_process(server.address)
    client = clients(running.service.address)
    assert client.capacity() == FrameLayout(CAP, CAP) and client.frames.count == PER_EDGE
    for i in range(6):
        index = _submit(client, [i, i + 1, i + 2])
        got = _answers(client, index)
        assert [(d.count, d.final) for d in got] == [(3, True)]
        result = client.frames.results[index]
        assert (int(result["status"]), int(result["request_id"])) == (Status.OK, 100 + index)
        assert client.frames.outputs[index, :3].tolist() == [i, i + 1, i + 2]
        client.release(index)
    stats = client.delivery_stats
    assert (stats.delivered, stats.duplicates, stats.unknown, stats.late) == (6, 0, 0, 0)


def _refused(caplog: pytest.LogCaptureFixture, reason: str) -> bool:
    """Whether the agent process logged a refusal for ``reason`` (loopback closes the socket without one)."""
    return eventually(lambda: any(reason in r.getMessage() for r in caplog.records), 5.0)


def test_edges_get_ranges_of_their_own_and_give_them_back(
    serve, agent_process, clients, caplog: pytest.LogCaptureFixture
) -> None:
    server = serve(echo, slots=2, cap=CAP)
    running = agent_process(server.address)
    first, second = clients(running.service.address), clients(running.service.address)
    ranges = sorted(edge.base for edge in running.service.edges.values())
    assert ranges == [0, PER_EDGE]
    with pytest.raises(TransportError):
        AgentClient(running.service.address, peer_keys(None), timeout=2.0)
    assert _refused(caplog, "no free frame range for another edge")
    first.close()
    assert eventually(lambda: len(running.service.edges) == 1, 10.0), "the range of an edge that went away stays taken"
    third = clients(running.service.address)  # gets the range back
    index = _submit(third, [7])
    assert _answers(third, index)[-1].final
    assert len(running.service.edges) == 2 and second.alive()


def test_only_an_edge_may_connect_to_an_agent_process(serve, agent_process, caplog: pytest.LogCaptureFixture) -> None:
    server = serve(echo, slots=2, cap=CAP)
    running = agent_process(server.address)
    stranger = LoopbackTransport(peer_keys(None))
    try:
        region = stranger.register(wire.COMPLETIONS_REGION, 8, Access.REMOTE_WRITE)
        with pytest.raises(TransportError):
            stranger.connect(running.service.address, [region], {"frames": 1}, timeout=2.0)
        assert _refused(caplog, "only edges connect to an agent process")
        assert running.service.edges == {}
    finally:
        stranger.close()


def test_an_edge_without_the_peer_secret_is_refused_before_it_sees_a_frame(
    serve, agent_process, caplog: pytest.LogCaptureFixture
) -> None:
    server = serve(echo, slots=2, cap=CAP)
    running = agent_process(server.address)
    with pytest.raises(PeerRefused) as refused:
        AgentClient(running.service.address, PeerKeys(b"x" * 32, "a stranger's"), timeout=2.0)
    assert refused.value.reason == UNKNOWN_SECRET
    assert _refused(caplog, UNKNOWN_SECRET)
    assert running.service.edges == {} and running.service.connections.refused[UNKNOWN_SECRET] == 1


def test_a_refusal_is_answered_through_the_frame(serve, agent_process, clients) -> None:
    """No free slot: the agent writes NO_SLOT into the frame's result and answers it like a result."""
    server = serve(PacedEcho(0.05), slots=1, cap=CAP)
    running = agent_process(server.address)
    client = clients(running.service.address)
    busy = _submit(client, list(range(10)))
    refused = _submit(client, [1])
    got = _answers(client, refused)
    assert [(d.count, d.final) for d in got] == [(0, True)]
    assert int(client.frames.results[refused]["status"]) == Status.NO_SLOT
    assert int(client.frames.results[_answers(client, busy)[-1].index]["status"]) == Status.OK


def test_streamed_answers_and_a_cancel_are_relayed(serve, agent_process, clients) -> None:
    server = serve(PacedEcho(0.02), slots=1, cap=CAP, stream_window=0.0)
    running = agent_process(server.address)
    client = clients(running.service.address)
    index = _submit(client, list(range(CAP)), stream=True)
    first: list[Delivery] = []
    assert eventually(lambda: bool(first.extend(client.poll()) or first), 10.0), "no streamed answer"
    assert first[0].index == index and not first[0].final and first[0].count >= 1
    client.cancel(index)
    got = first + _answers(client, index)
    assert got[-1].final and int(client.frames.results[index]["status"]) == Status.CANCELLED
    assert 1 <= got[-1].count < CAP
    assert client.frames.outputs[index, : got[-1].count].tolist() == list(range(got[-1].count))
    assert eventually(lambda: server.stats.cancelled == 1, 10.0)


def test_an_abandoned_frame_comes_back_after_the_agents_final_answer(serve, agent_process, clients) -> None:
    server = serve(PacedEcho(0.02), slots=1, cap=CAP, stream_window=0.0)
    running = agent_process(server.address)
    client = clients(running.service.address)
    index = _submit(client, list(range(CAP)), stream=True)
    client.abandon(index)
    assert index in client.book.inflight  # the agent may still write into it
    assert eventually(lambda: not client.poll(timeout=0.05) and index not in client.book.inflight, 10.0)
    stats = client.delivery_stats
    assert stats.abandoned == 1 and stats.late >= 1 and stats.delivered == 0
    assert sorted(i for i in iter(client.acquire, None)) == list(range(PER_EDGE))  # every frame is back


def test_the_status_region_says_what_the_agent_last_saw(serve, agent_process, clients) -> None:
    server = serve(PacedEcho(0.05), slots=2, cap=CAP)
    running = agent_process(server.address)
    client = clients(running.service.address)
    assert eventually(lambda: client.free_slots() == (2, 2), 10.0)
    busy = _submit(client, list(range(10)))
    assert eventually(lambda: client.free_slots() == (1, 2), 10.0), client.free_slots()
    assert _answers(client, busy)[-1].final
    assert eventually(lambda: client.free_slots() == (2, 2), 10.0)


def test_the_agent_going_away_loses_what_was_in_flight_and_a_new_one_is_picked_up(
    serve, agent_process, clients, tmp_path: Path
) -> None:
    server: SlotServer = serve(PacedEcho(0.05), slots=2, cap=CAP)
    running = agent_process(server.address)
    client = clients(running.service.address)
    done = _submit(client, [5])
    assert _answers(client, done)[-1].final
    client.release(done)
    lost = _submit(client, list(range(20)))
    running.close()
    gone: list[int] = []
    assert eventually(lambda: bool(gone.extend(client.check_links()) or gone), 10.0), "the agent's end went unseen"
    assert gone == [lost] and not client.alive() and client.free_slots() == (0, 0)
    assert client.submit(client.acquire() or 0) == Status.UNAVAILABLE
    assert client.revive(timeout=0.2) == []  # nobody there yet
    again = Running(running.service.address, server.address)
    try:
        assert client.revive(timeout=5.0) == [running.service.address]
        index = _submit(client, [8, 9])
        assert _answers(client, index)[-1].final
        assert client.delivery_stats.delivered == 2  # counted on across the reconnect
    finally:
        again.close()


def test_a_slot_server_that_stops_turning_is_reported_to_the_edge_with_the_frames_it_holds(
    make_server, agent_process, clients
) -> None:
    """The agent process publishes its links' states and tells the edge which of its frames sit on an
    unresponsive server; new requests are refused at once; the frames stay fenced until the server lets go."""
    server = make_server(echo, slots=2, cap=CAP)  # turned by hand: while the test does not, it is frozen
    running = agent_process(server.address, hang_timeout=0.3)
    client = clients(running.service.address)
    assert [(h.address, h.state) for h in client.links_health()] == [(server.address, LinkState.UP)]
    index = _submit(client, [1, 2, 3])
    stalled: list[int] = []

    def reported() -> bool:
        assert client.poll() == []  # nothing is answered meanwhile
        stalled.extend(client.stalled())
        return bool(stalled)

    assert eventually(reported, 10.0), "the stalled frame was never reported"
    assert stalled == [index]
    (health,) = client.links_health()
    assert (health.address, health.state, health.reason) == (
        server.address,
        LinkState.UNRESPONSIVE,
        Reason.NO_HEARTBEAT,
    )
    client.abandon(index)
    refused = _submit(client, [4])
    assert [d.final for d in _answers(client, refused)] == [True]
    assert int(client.frames.results[refused]["status"]) == Status.UNAVAILABLE  # at once: nothing was claimed
    client.release(refused)
    assert server.pool.free_count() == 1  # only the request sent before the freeze holds a slot
    serve_once(server)  # it thaws: the answer comes, late, and frees the frame
    assert eventually(lambda: not client.poll() and index not in client.book.inflight, 10.0)
    assert client.delivery_stats.late == 1
    assert eventually(lambda: server.poll_once(0.0) > 0 and client.links_health()[0].state is LinkState.UP, 10.0)


def _group(client: AgentClient, n: int, tokens: list[int]) -> list[int]:
    frames = []
    for k in range(n):
        index = client.acquire()
        assert index is not None
        write_request(client.frames, index, tokens, request_id=200 + k, max_new_tokens=CAP)
        frames.append(index)
    assert client.submit_group(frames) is None  # answered through the frames
    return frames


def _finals(client: AgentClient, frames: list[int], timeout: float = 10.0) -> dict[int, Delivery]:
    """The final delivery of each of ``frames`` (a group's answers come in any order)."""
    got: dict[int, Delivery] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(got) < len(frames):
        got |= {d.index: d for d in client.poll(timeout=0.2) if d.final and d.index in frames}
    return got


def test_a_group_of_choices_is_claimed_together_by_the_agent_process(serve, agent_process, clients) -> None:
    server = serve(PacedEcho(0.05), slots=3, cap=CAP)
    running = agent_process(server.address)
    client = clients(running.service.address)
    frames = _group(client, 3, [4, 5, 6])
    assert sorted(_finals(client, frames)) == sorted(frames)
    for index in frames:
        assert int(client.frames.results[index]["status"]) == Status.OK
        assert client.frames.outputs[index, :3].tolist() == [4, 5, 6]
    assert running.agent.links[0].stats.claims == 3


def test_a_group_the_agent_process_cannot_claim_whole_is_refused_in_every_frame(serve, agent_process, clients) -> None:
    server = serve(PacedEcho(0.05), slots=3, cap=CAP)
    running = agent_process(server.address)
    client = clients(running.service.address)
    busy = _submit(client, list(range(10)))
    frames = _group(client, 3, [1, 2])
    finals = _finals(client, frames)
    assert sorted(finals) == sorted(frames) and all(d.count == 0 for d in finals.values())
    for index in frames:
        assert int(client.frames.results[index]["status"]) == Status.NO_SLOT
    link = running.agent.links[0]
    assert link.stats.unclaims == 2 and link.stats.claims == 3  # the two it got, given back
    assert _answers(client, busy)[-1].final
    assert eventually(lambda: server.pool.free_count() == 3, 5.0)
