"""The agent: claims (remote CAS, the free-slot hint across servers, 429 only when all are full), the frame
it sends, its slot servers going and coming back, abandon and exactly-once accounting -- against real
slot servers over the chosen transport."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers.datapath import collect, roundtrip, send, serve_once, wait_free

from edgepath.contract import wire
from edgepath.contract.pool import FrameLayout, SlotPool
from edgepath.dpu.agent import Agent, AgentError
from edgepath.dpu.frame import FrameError, write_request
from edgepath.dpu.link_state import LinkState, Reason
from edgepath.native.abi import ABI_VERSION, State, Status
from edgepath.slots.handlers import PacedEcho, echo
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.base import Access, TransportError

pytestmark = pytest.mark.transport

CAP = 64


@pytest.fixture
def agent(new_agent) -> Agent:
    return new_agent()


def paced(delay: float) -> PacedEcho:
    return PacedEcho(delay)


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
        served += serve_once(server)
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
    region.buf[8:12].view(np.uint32)[0] = ABI_VERSION + 1  # a slot server from a later release
    address = new_address("fake")
    listener = fake.listen(address, [region], {})
    accepted = threading.Thread(target=lambda: listener.accept(timeout=5.0))
    accepted.start()
    with pytest.raises(AgentError, match=f"ABI version {ABI_VERSION + 1}, this agent speaks {ABI_VERSION}"):
        agent.attach(address)
    accepted.join()
    listener.close()
    assert agent.links == []


def revive_settled(agent: Agent) -> list:
    """``agent.revive()`` until no try is under way (a try runs on its own thread): what came back."""
    back = agent.revive()
    deadline = time.monotonic() + 30
    while agent.link_set.reattaching and time.monotonic() < deadline:
        time.sleep(0.005)
        back += agent.revive()
    assert not agent.link_set.reattaching
    return back


def test_agent_answers_unavailable_while_its_slot_server_is_gone_and_recovers_when_it_is_back(
    new_transport, new_address
) -> None:
    """Re-attaching follows the bounded back-off: a try only when one is due (0.1 s after the loss, then
    doubling), each failed try pushing the next one further; once the server is back, the next due try
    attaches it.  The agent's clock is a fake one, so which calls try is exact (a try runs on a thread of
    its own; ``revive_settled`` takes its outcome)."""
    now = [100.0]
    agent = Agent(new_transport(), frames=8, input_capacity=CAP, output_capacity=CAP, clock=lambda: now[0])
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
    assert (link.rejoin.failures, link.rejoin.next_at) == (1, pytest.approx(100.1))
    (gone,) = agent.servers()
    assert (gone.health.address, gone.health.state, gone.health.reason, gone.health.since) == (
        address,
        LinkState.DOWN,
        Reason.DISCONNECTED,
        100.0,
    )
    assert (gone.free_slots, gone.total_slots, gone.claims, gone.reattaches) == (0, 2, 1, 0)
    write_request(agent.frames, 1, [3], request_id=2, max_new_tokens=1)
    assert agent.submit(1) == Status.UNAVAILABLE
    assert agent.revive() == [] and not agent.link_set.reattaching and link.rejoin.failures == 1  # not due yet: no try
    now[0] = 100.1
    assert revive_settled(agent) == []  # tried: nobody there yet
    assert (link.rejoin.failures, link.rejoin.next_at) == (2, pytest.approx(100.3))
    second = SlotServer(new_transport(), address, echo, config)
    second.start_connection_manager()
    try:
        now[0] = 100.29
        assert revive_settled(agent) == [] and link.rejoin.failures == 2  # back, but no try is due
        now[0] = 100.3
        (back,) = revive_settled(agent)
        assert back.alive and back.epoch == second.epoch != first.epoch and agent.links == [back]
        assert back.rejoin.failures == 0  # a fresh link: its next loss starts from the first delay again
        assert agent.submit(1) is None
        (listed,) = agent.servers()
        assert (listed.health.state, listed.health.since, listed.claims, listed.reattaches) == (
            LinkState.UP,
            100.3,
            2,  # the claims of every attach
            1,
        )
        assert serve_once(second) == 1
        assert [d.index for d in agent.poll(timeout=5.0) if d.final] == [1]
        assert agent.frames.outputs[1, :1].tolist() == [3]
    finally:
        second.close()


def test_a_link_that_fails_an_operation_loses_its_flights_at_the_next_check(new_agent, make_server) -> None:
    """An operation that fails (not a disconnect) takes the link out of admission at once; what was in
    flight there (and cannot move: migration off here, tests/dpu/test_migration.py has it on) is answered by
    the next check_links -- never left waiting for a result that cannot come."""
    agent: Agent = new_agent(migration_limit=0)
    a, b = make_server(slots=1), make_server(slots=1)
    first, second = agent.attach(a.address), agent.attach(b.address)
    write_request(agent.frames, 0, [1], request_id=1, max_new_tokens=1)
    assert agent.submit(0) is None
    on = agent.inflight[0].link
    agent.link_set.failed(on, TransportError("a failed compare-and-swap"))
    assert not on.alive and on.inflight == 0
    write_request(agent.frames, 1, [2], request_id=2, max_new_tokens=1)
    assert agent.submit(1) is None and agent.inflight[1].link is (second if on is first else first)
    assert agent.check_links() == [0] and 0 not in agent.inflight
    assert agent.check_links() == []  # collected once


def test_abandon_fences_the_frame_until_the_server_lets_go(agent: Agent, serve) -> None:
    server = serve(paced(0.02), stream_window=0.0)
    agent.attach(server.address)
    index = send(agent, list(range(50)))
    agent.abandon(index)
    assert index in agent.inflight  # not reusable yet: the slot may still write into it
    free_before = len(agent.book._free)
    deadline = time.monotonic() + 10
    finals = []
    while index in agent.inflight and time.monotonic() < deadline:
        got = [d for d in agent.poll(timeout=0.2) if d.index == index]
        assert all(d.final and d.abandoned for d in got)  # nothing for it but its final, marked abandoned
        finals += got
    # once: what the slot server computed before it stopped, for the request's bill
    assert [d.count for d in finals] == [agent.frames.result_headers[index].output_count]
    assert index not in agent.inflight
    assert len(agent.book._free) == free_before + 1  # handed back by the agent itself
    assert agent.delivery_stats.abandoned == 1 and agent.delivery_stats.late >= 1
    with pytest.raises(ValueError, match="not in flight"):
        agent.abandon(index)
    # the frame's next user gets only its own result
    again = agent.acquire()
    assert again is not None
    write_request(agent.frames, again, [9, 8, 7], request_id=99, max_new_tokens=3, flags=wire.FLAG_STREAM)
    assert agent.submit(again) is None
    got = collect(agent, again)
    assert got[-1].count == 3 and agent.frames.outputs[again, :3].tolist() == [9, 8, 7]
    assert wait_free(server)


def test_a_second_final_for_a_frame_is_counted_as_a_duplicate(agent: Agent, serve) -> None:
    server = serve(paced(0.0))
    link = agent.attach(server.address)
    index = send(agent, [1, 2])
    got = collect(agent, index)
    assert got[-1].final
    assert agent.deliver(link.conn.conn_id, wire.final_imm(index)) is None
    assert agent.delivery_stats.duplicates == 1
    assert agent.deliver(link.conn.conn_id, wire.final_imm(3)) is None  # never in flight
    assert agent.delivery_stats.unknown == 1 and agent.delivery_stats.delivered == 1


def test_a_result_that_crossed_as_its_link_went_down_is_late_not_a_second_answer(agent: Agent, make_server) -> None:
    """The agent gives up on a link (an operation on it failed: the soft-RoCE lane's wire) while a result from it
    already waits in the completion queue: the frame is lost with the link (answered 503 once) and reused; the
    result, polled afterwards, is counted late and dropped -- not as a second answer for the frame, even when its
    generation is the one the frame last answered (slots are claimed in turn, so neighbours share generations)."""
    server = make_server(slots=2)
    link = agent.attach(server.address)
    first = roundtrip(agent, server, [1, 2])  # answered on slot 0, generation 1
    answered = int(agent.frames.result_headers[first].generation)
    agent.release(first)
    again = agent.acquire()
    assert again == first  # the frame just released is the next one handed out
    write_request(agent.frames, again, [3, 4], request_id=2, max_new_tokens=2)
    assert agent.submit(again) is None
    assert agent.inflight[again].generation == answered  # slot 1's first claim: the same generation number
    assert serve_once(server) == 1  # its result and notification now wait in the agent's completion queue
    agent.link_set.failed(link, TransportError("an operation on the wire failed"))
    assert agent.check_links() == [again]
    assert agent.poll(timeout=1.0) == []
    stats = agent.delivery_stats
    assert (stats.delivered, stats.duplicates, stats.unknown, stats.late) == (1, 0, 0, 1), stats


def test_attach_returns_only_once_the_server_has_admitted_the_agent(serve, new_transport) -> None:
    """A request sent the moment attach() returns is answered (the server registered the connection first)."""
    server = serve(paced(0.0), slots=4)
    for _ in range(20):
        agent = Agent(
            new_transport(), frames=1, input_capacity=CAP, output_capacity=CAP, max_servers=1, max_slots_per_server=8
        )
        agent.attach(server.address)
        index = send(agent, [4, 2], stream=False)
        got = collect(agent, index, timeout=5.0)
        assert got and got[-1].final, server.stats
    assert server.stats.results_dropped == 0


def test_claims_follow_the_free_slot_hint_and_429_only_when_all_are_full(make_server, new_agent) -> None:
    """Each claim tries the attached servers in order of their free-slot hint (most free first); the answer
    is 429 (NO_SLOT) only when every one of them is full."""
    small, big = make_server(slots=1, cap=16), make_server(slots=3, cap=16)
    agent = new_agent(cap=16)
    agent.attach(small.address)  # attached first, but it has fewer free slots
    agent.attach(big.address)
    chosen = []
    for i in range(5):
        write_request(agent.frames, i, [i + 1, i + 2], request_id=i, max_new_tokens=2)
        status = agent.submit(i)
        chosen.append(status if status is not None else agent.inflight[i].link.address)
    # Hints (free slots) before each claim: small 1 / big 3, 1/2, 1/1 (tie: attach order), 0/1, 0/0.
    assert chosen == [big.address, big.address, small.address, big.address, Status.NO_SLOT]
    assert small.pool.free_count() == 0 and big.pool.free_count() == 0
    # Every slot that was claimed gets served and freed; then claims succeed again.
    served = 0
    for server in (small, big):
        served += server.process(server.transport.cq.wait(5.0, max_entries=256))
    assert served == 4
    done: list[int] = []
    while len(done) < 4:
        got = [d.index for d in agent.poll(timeout=5.0) if d.final]
        assert got, "results never arrived"
        done += got
    assert sorted(done) == [0, 1, 2, 3]
    assert all(int(agent.frames.results[i]["status"]) == Status.OK for i in done)
    assert small.pool.free_count() == 1 and big.pool.free_count() == 3
    write_request(agent.frames, 5, [9], request_id=5, max_new_tokens=1)
    assert agent.submit(5) is None
    assert agent.inflight[5].link.address == big.address


def test_a_send_that_fails_at_the_transport_leaves_the_frame_to_its_caller(
    agent: Agent, make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UNAVAILABLE at once, the frame not in flight (its caller releases it), the link down."""
    server = make_server()
    link = agent.attach(server.address)

    def broken(*_: object) -> None:
        raise TransportError("the link broke")

    monkeypatch.setattr(link.conn, "write_then_imm", broken)
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, [1, 2], request_id=1, max_new_tokens=2)
    assert agent.submit(index) == Status.UNAVAILABLE
    assert index not in agent.inflight and link.inflight == 0 and not link.alive
    agent.release(index)
    assert agent.delivery_stats.delivered == 0 and agent.check_links() == []


def test_capacity_is_what_the_first_slot_server_takes_in_these_frames(agent: Agent, make_server) -> None:
    assert agent.capacity() == FrameLayout(CAP, CAP)  # nothing attached: the frames
    server = make_server(cap=16)
    agent.attach(server.address)
    assert agent.capacity() == FrameLayout(16, 16)
