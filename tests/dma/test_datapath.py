"""Agent <-> slot server over a transport, with the server driven step by step from the test
(no thread): claim, zero-copy write, doorbell, handler, result, refusals and bad input."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from edgepath.dma.handlers import BatchHandler, HandlerConfig, HandlerError, SlotRequest, echo, load_handler
from edgepath.dma.pool import FrameArray, SlotPool
from edgepath.dma.slot_server import SlotServer, SlotServerConfig
from edgepath.dma.transport import Access, Transport, TransportError
from edgepath.dma.wire import claim_word, doorbell_imm, doorbell_word
from edgepath.dpu.agent import Agent, AgentError
from edgepath.dpu.frame import FrameError, write_request
from edgepath.native.abi import REQUEST_HEADER, RESULT_HEADER, State, Status

pytestmark = pytest.mark.transport

CAP = 64


@pytest.fixture
def make_server(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> Iterator[Callable[..., SlotServer]]:
    servers: list[SlotServer] = []

    def make(handler=echo, slots: int = 2, **config: object) -> SlotServer:
        cfg = SlotServerConfig(slots=slots, input_capacity=CAP, output_capacity=CAP, **config)
        server = SlotServer(new_transport(), new_address("slot-server"), handler, cfg)
        server.start_connection_manager()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def agent(new_transport: Callable[[], Transport]) -> Agent:
    return Agent(
        new_transport(), frames=8, input_capacity=CAP, output_capacity=CAP, max_servers=2, max_slots_per_server=64
    )


def _serve_once(server: SlotServer, timeout: float = 5.0) -> int:
    """Start what the next completions ring, then turn the loop until those slots are answered."""
    started = server.process(server.transport.cq.wait(timeout))
    deadline = time.monotonic() + timeout
    while server.running and time.monotonic() < deadline:
        server.poll_once(0.01)
    return started


def _roundtrip(agent: Agent, server: SlotServer, tokens: list[int], request_id: int = 1) -> int:
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, tokens, request_id=request_id, max_new_tokens=CAP)
    assert agent.submit(index) is None
    assert _serve_once(server) == 1
    assert [d.index for d in agent.poll(timeout=5.0) if d.final] == [index]
    return index


def test_echo_roundtrip_moves_the_tokens_once_and_frees_the_slot(agent: Agent, make_server) -> None:
    server = make_server()
    link = agent.attach(server.address)
    tokens = list(range(1000, 1040))
    index = _roundtrip(agent, server, tokens, request_id=77)
    res = agent.frames.results[index]
    assert (int(res["status"]), int(res["output_count"]), int(res["request_id"])) == (Status.OK, 40, 77)
    assert agent.frames.outputs[index, :40].tolist() == tokens
    assert server.pool.free_count() == 2
    # Zero copy: the edge's token view *is* the registered memory the agent sends from,
    # and exactly one WRITE carried header + tokens, one WRITE_WITH_IMM the 8-byte doorbell.
    assert np.shares_memory(agent.frames.tokens[index], agent.frames_mr.buf)
    assert (link.conn.counters.writes, link.conn.counters.bytes_written) == (2, REQUEST_HEADER.itemsize + 4 * 40 + 8)
    assert link.conn.counters.cas == 1
    # The server answered from the slot itself: one WRITE of result header + output, one notification.
    peer = next(iter(server.peers.values()))
    assert (peer.conn.counters.writes, peer.conn.counters.bytes_written) == (2, RESULT_HEADER.itemsize + 4 * 40)


def test_no_free_slot_is_refused_at_once_and_deterministically(agent: Agent, make_server) -> None:
    server = make_server(slots=2)
    link = agent.attach(server.address)
    held = []
    for _ in range(2):
        i = agent.acquire()
        write_request(agent.frames, i, [1, 2, 3], request_id=i, max_new_tokens=3)
        assert agent.submit(i) is None
        held.append(i)
    i = agent.acquire()
    write_request(agent.frames, i, [4], request_id=9, max_new_tokens=1)
    cas_before = link.stats.cas_attempts
    assert agent.submit(i) == Status.NO_SLOT
    # No CAS was even tried: the cached words say busy, and one refresh READ confirmed it.
    assert link.stats.cas_attempts == cas_before
    assert [server.pool.slot_word(s).state for s in range(2)] == [State.CLAIMED, State.CLAIMED]
    served = 0
    while served < 2:
        served += _serve_once(server)
    answered = [d.index for d in agent.poll(timeout=5.0) + agent.poll(timeout=0.5) if d.final]
    assert sorted(answered) == sorted(held)
    assert agent.submit(i) is None  # a slot is free again: admitted


@pytest.mark.parametrize(
    ("tokens", "max_new", "message"),
    [
        ([], 4, "at least 1 token"),
        (list(range(CAP + 1)), 4, f"{CAP + 1} tokens; a slot holds at most {CAP}"),
        ([1, 2], -1, "max_new_tokens must be between 0 and"),
        ([1, 2], CAP + 1, "max_new_tokens must be between 0 and"),
        ([[1, 2]], 4, "flat sequence"),
        ([1.5], 4, "must be integers"),
        ([2**40], 4, "fit in int32"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_written(agent: Agent, tokens, max_new: int, message: str) -> None:
    before = agent.frames.raw[0].copy()
    with pytest.raises(FrameError, match=message):
        write_request(agent.frames, 0, tokens, request_id=1, max_new_tokens=max_new)
    assert np.array_equal(agent.frames.raw[0], before)


def test_frame_with_bad_counts_is_not_sent(agent: Agent, make_server) -> None:
    server = make_server()
    link = agent.attach(server.address)
    agent.frames.requests[0]["token_count"] = CAP + 1
    assert agent.check_frame(0) == f"request has {CAP + 1} tokens; a slot holds at most {CAP}"
    assert agent.submit(0) == Status.BAD_REQUEST
    agent.frames.requests[0]["token_count"] = 0
    assert agent.submit(0) == Status.BAD_REQUEST
    assert link.stats.cas_attempts == 0 and server.pool.free_count() == 2


def test_doorbell_for_a_slot_never_claimed_is_ignored(new_transport, make_server) -> None:
    server = make_server()
    rogue = new_transport()
    scratch = rogue.register("replies", 4096, Access.REMOTE_WRITE)
    conn = rogue.connect(server.address, [scratch], {"frames": 1, "input_capacity": CAP, "output_capacity": CAP})
    pool = conn.remote["pool"]
    conn.write_with_imm(scratch, 0, pool, int(conn.peer_info["doorbells_offset"]), 8, (1 << 16) | 0)
    before = server.pool.states.copy()
    assert _serve_once(server) == 0
    assert server.stats.rejected_doorbells == 1
    assert np.array_equal(server.pool.states, before)


def test_handler_failure_answers_that_request_and_frees_the_slot(agent: Agent, make_server) -> None:
    def picky(request: SlotRequest) -> int:
        if request.tokens[0] == 13:
            raise RuntimeError("unlucky")
        if request.tokens[0] == 14:
            return len(request.output) + 1  # claims more output than fits
        return echo(request)

    server = make_server(handler=picky)
    agent.attach(server.address)
    for first, status in ((13, Status.HANDLER_ERROR), (14, Status.HANDLER_ERROR), (1, Status.OK)):
        index = _roundtrip(agent, server, [first, 2, 3])
        assert int(agent.frames.results[index]["status"]) == status
        agent.release(index)
    assert server.pool.free_count() == 2
    assert server.stats.handler_errors == 2 and server.stats.served == 1


def test_handler_may_return_tokens_instead_of_writing_in_place(agent: Agent, make_server) -> None:
    server = make_server(handler=lambda request: [int(t) * 2 for t in request.tokens[::-1]])
    agent.attach(server.address)
    index = _roundtrip(agent, server, [1, 2, 3])
    assert agent.frames.outputs[index, :3].tolist() == [6, 4, 2]


def test_claims_spill_to_the_next_server_and_429_only_when_all_are_full(agent: Agent, make_server) -> None:
    a, b = make_server(slots=1), make_server(slots=1)
    agent.attach(a.address)
    agent.attach(b.address)
    statuses = []
    for i in range(3):
        write_request(agent.frames, i, [i + 1], request_id=i, max_new_tokens=1)
        statuses.append(agent.submit(i))
    assert statuses == [None, None, Status.NO_SLOT]
    assert a.pool.free_count() == 0 and b.pool.free_count() == 0


def test_attach_refuses_a_pool_with_the_wrong_abi(agent: Agent, new_transport, new_address) -> None:
    fake = new_transport()
    region = fake.register("pool", 4096, Access.REMOTE_WRITE | Access.REMOTE_ATOMIC | Access.REMOTE_READ)
    SlotPool.create(region.buf, 2, CAP, CAP, 10**9, 1)
    region.buf[8:12].view(np.uint32)[0] = 4  # a slot server from a release with ABI version 4
    address = new_address("fake")
    listener = fake.listen(address, [region], {})
    accepted = threading.Thread(target=lambda: listener.accept(timeout=5.0))
    accepted.start()
    with pytest.raises(AgentError, match="ABI version 4, this agent speaks 3"):
        agent.attach(address)
    accepted.join()
    listener.close()
    assert agent.links == []


def test_unknown_handlers_are_clear_errors() -> None:
    config = HandlerConfig(2, CAP, CAP)
    assert isinstance(load_handler("echo", config), BatchHandler)
    with pytest.raises(HandlerError, match="use a built-in"):
        load_handler("nope", config)
    with pytest.raises(HandlerError, match="cannot import module 'no_such_module'"):
        load_handler("no_such_module:f", config)
    with pytest.raises(HandlerError, match="has no attribute 'nothing'"):
        load_handler("json:nothing", config)
    with pytest.raises(HandlerError, match="is not a handler"):
        load_handler("math:pi", config)
    with pytest.raises(HandlerError, match="token_delay"):
        load_handler("paced-echo", HandlerConfig(2, CAP, CAP, {"delay": "1"}))


def test_agent_answers_unavailable_while_its_slot_server_is_gone_and_recovers_when_it_is_back(
    agent: Agent, new_transport, new_address
) -> None:
    address = new_address("slot-server")
    config = SlotServerConfig(slots=2, input_capacity=CAP, output_capacity=CAP)
    first = SlotServer(new_transport(), address, echo, config)
    first.start_connection_manager()
    link = agent.attach(address)
    write_request(agent.frames, 0, [1, 2], request_id=1, max_new_tokens=2)
    assert agent.submit(0) is None  # in flight when the server goes away
    first.close()
    lost: list[int] = []
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        lost = agent.check_links()
    assert lost == [0] and not link.alive
    write_request(agent.frames, 1, [3], request_id=2, max_new_tokens=1)
    assert agent.submit(1) == Status.UNAVAILABLE
    assert agent.revive(timeout=0.5) == []  # nobody there yet
    second = SlotServer(new_transport(), address, echo, config)
    second.start_connection_manager()
    try:
        (back,) = agent.revive(timeout=5.0)
        assert back.alive and back.epoch == second.epoch != first.epoch
        assert agent.submit(1) is None
        assert _serve_once(second) == 1
        assert [d.index for d in agent.poll(timeout=5.0) if d.final] == [1]
        assert agent.frames.outputs[1, :1].tolist() == [3]
    finally:
        second.close()


def test_a_handler_past_its_deadline_is_answered_and_its_slot_freed_when_it_returns(agent: Agent, make_server) -> None:
    release = threading.Event()

    def sticky(request: SlotRequest) -> int:
        if request.tokens[0] == 99:
            release.wait(30)  # hangs until the test lets go
        return echo(request)

    server = make_server(handler=sticky, slots=2, handler_deadline=0.2)
    agent.attach(server.address)
    hung = _roundtrip(agent, server, [99, 1])
    assert int(agent.frames.results[hung]["status"]) == Status.HANDLER_ERROR
    assert server.stats.deadline_exceeded == 1 and server.stats.quarantined == 1
    assert server.pool.free_count() == 1  # the hung handler still owns its slot's memory
    for i in range(3):  # the others are unaffected
        index = _roundtrip(agent, server, [i + 1, 7])
        assert agent.frames.outputs[index, :2].tolist() == [i + 1, 7]
        agent.release(index)
    release.set()
    deadline = time.monotonic() + 10
    while server.stats.quarantined and time.monotonic() < deadline:
        server.poll_once(0.01)
    assert server.stats.quarantined == 0 and server.pool.free_count() == 2


def test_a_frame_that_lies_about_its_size_is_refused_by_the_server_and_touches_no_other_slot(
    new_transport, make_server
) -> None:
    """A peer that bypasses the agent's checks: it claims a slot properly, then writes a header that
    claims more tokens than a slot holds and rings. The server refuses it (BAD_REQUEST), frees the
    slot, and the neighbouring slot is byte-for-byte unchanged."""
    server = make_server(slots=2)
    rogue = new_transport()
    layout = server.pool.layout
    replies = rogue.register("replies", layout.stride, Access.REMOTE_WRITE)
    conn = rogue.connect(server.address, [replies], {"frames": 1, "input_capacity": CAP, "output_capacity": CAP})
    pool, info = conn.remote["pool"], conn.peer_info
    scratch = rogue.register("scratch", layout.stride, Access.NONE)
    states = int(info["states_offset"])
    want = claim_word(0, conn.peer_assigned_id)
    assert conn.compare_and_swap(pool, states, 0, want) == 0
    frame = FrameArray(scratch.buf, 0, 1, layout)
    req = frame.requests[0]
    req["token_count"] = CAP + 1000  # a lie: the slot holds CAP tokens
    req["generation"] = want >> 32
    req["reply_index"] = 0
    req["doorbell"] = doorbell_word(0, want >> 32)
    neighbour = server.pool.slots.raw[1].copy()
    conn.write(scratch, 0, pool, int(info["slots_offset"]), REQUEST_HEADER.itemsize)
    conn.write_with_imm(
        scratch,
        REQUEST_HEADER.fields["doorbell"][1],
        pool,
        int(info["doorbells_offset"]),
        8,
        doorbell_imm(0, want >> 32),
    )
    assert _serve_once(server) == 1
    assert rogue.cq.wait(5.0)
    answer = replies.buf[: RESULT_HEADER.itemsize].view(RESULT_HEADER)[0]  # replies: [result][output]
    assert int(answer["status"]) == Status.BAD_REQUEST and int(answer["output_count"]) == 0
    assert server.stats.bad_requests == 1 and server.pool.free_count() == 2
    assert np.array_equal(server.pool.slots.raw[1], neighbour)
    with pytest.raises(TransportError, match="outside remote region"):  # and nothing past the pool at all
        conn.write(scratch, 0, pool, pool.length - 8, 64)


def test_least_privilege_slot_servers_see_only_the_agents_replies(agent: Agent, make_server) -> None:
    """The agent's requests (what it sends from) are registered with no remote access and never
    exported; a slot server is given the replies region alone, and only for writing results."""
    server = make_server()
    agent.attach(server.address)
    assert agent.frames_mr.access == Access.NONE
    assert agent.replies_mr.access == Access.REMOTE_WRITE
    assert agent.scratch_mr.access == Access.NONE
    (peer,) = server.peers.values()
    assert set(peer.conn.remote) == {"replies"}
    replies = peer.conn.remote["replies"]
    assert replies.access == Access.REMOTE_WRITE and replies.length == agent.replies_mr.buf.nbytes
    with pytest.raises(TransportError, match="does not grant"):
        peer.conn.read(server.pool_mr, 0, replies, 0, 8)
    with pytest.raises(TransportError, match="outside remote region"):
        peer.conn.write(server.pool_mr, 0, replies, replies.length - 4, 8)
