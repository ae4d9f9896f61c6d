"""The slot server through its agents, over a transport, driven step by step from the test (no thread):
zero-copy write, doorbell, handler, result, what the server refuses and what it never lets a peer do.
The agent's own behaviour is tested in tests/dpu/test_agent.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers.datapath import roundtrip, serve_once

from edgepath.contract.pool import FrameArray
from edgepath.contract.wire import claim_word, doorbell_imm, doorbell_word
from edgepath.dpu.agent import Agent
from edgepath.native.abi import REQUEST_HEADER, RESULT_HEADER, Status
from edgepath.slots.handlers import SlotRequest, echo
from edgepath.transports.base import Access, TransportError

pytestmark = pytest.mark.transport

CAP = 64


@pytest.fixture
def agent(new_agent) -> Agent:
    return new_agent()


def test_echo_roundtrip_moves_the_tokens_once_and_frees_the_slot(agent: Agent, make_server) -> None:
    server = make_server()
    link = agent.attach(server.address)
    tokens = list(range(1000, 1040))
    index = roundtrip(agent, server, tokens, request_id=77)
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


def test_doorbell_for_a_slot_never_claimed_is_ignored(new_transport, make_server) -> None:
    server = make_server()
    rogue = new_transport()
    scratch = rogue.register("replies", 4096, Access.REMOTE_WRITE)
    conn = rogue.connect(server.address, [scratch], {"frames": 1, "input_capacity": CAP, "output_capacity": CAP})
    inbox = conn.remote["inbox"]  # from the doorbell words on
    conn.write_with_imm(scratch, 0, inbox, 0, 8, (1 << 16) | 0)
    before = server.pool.states.copy()
    assert serve_once(server) == 0
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
        index = roundtrip(agent, server, [first, 2, 3])
        assert int(agent.frames.results[index]["status"]) == status
        agent.release(index)
    assert server.pool.free_count() == 2
    assert server.stats.handler_errors == 2 and server.stats.served == 1


def test_handler_may_return_tokens_instead_of_writing_in_place(agent: Agent, make_server) -> None:
    server = make_server(handler=lambda request: [int(t) * 2 for t in request.tokens[::-1]])
    agent.attach(server.address)
    index = roundtrip(agent, server, [1, 2, 3])
    assert agent.frames.outputs[index, :3].tolist() == [6, 4, 2]


def test_a_handler_past_its_deadline_is_answered_and_its_slot_freed_when_it_returns(agent: Agent, make_server) -> None:
    release = threading.Event()

    def sticky(request: SlotRequest) -> int:
        if request.tokens[0] == 99:
            release.wait(30)  # hangs until the test lets go
        return echo(request)

    server = make_server(handler=sticky, slots=2, handler_deadline=0.2)
    agent.attach(server.address)
    hung = roundtrip(agent, server, [99, 1])
    assert int(agent.frames.results[hung]["status"]) == Status.HANDLER_ERROR
    assert server.stats.deadline_exceeded == 1 and server.stats.quarantined == 1
    assert server.pool.free_count() == 1  # the hung handler still owns its slot's memory
    for i in range(3):  # the others are unaffected
        index = roundtrip(agent, server, [i + 1, 7])
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
    states, inbox, info = conn.remote["states"], conn.remote["inbox"], conn.peer_info
    scratch = rogue.register("scratch", layout.stride, Access.NONE)
    want = claim_word(0, conn.peer_assigned_id)
    assert conn.compare_and_swap(states, 0, 0, want) == 0
    frame = FrameArray(scratch.buf, 0, 1, layout)
    req = frame.requests[0]
    req["token_count"] = CAP + 1000  # a lie: the slot holds CAP tokens
    req["generation"] = want >> 32
    req["reply_index"] = 0
    req["doorbell"] = doorbell_word(0, want >> 32)
    neighbour = server.pool.slots.raw[1].copy()
    in_inbox = int(info["doorbells_offset"])  # where the inbox starts in the pool
    conn.write(scratch, 0, inbox, int(info["slots_offset"]) - in_inbox, REQUEST_HEADER.itemsize)
    conn.write_with_imm(scratch, REQUEST_HEADER.fields["doorbell"][1], inbox, 0, 8, doorbell_imm(0, want >> 32))
    assert serve_once(server) == 1
    assert rogue.cq.wait(5.0)
    answer = replies.buf[: RESULT_HEADER.itemsize].view(RESULT_HEADER)[0]  # replies: [result][output]
    assert int(answer["status"]) == Status.BAD_REQUEST and int(answer["output_count"]) == 0
    assert server.stats.bad_requests == 1 and server.pool.free_count() == 2
    assert np.array_equal(server.pool.slots.raw[1], neighbour)
    with pytest.raises(TransportError, match="outside remote region"):  # and nothing past the pool at all
        conn.write(scratch, 0, inbox, inbox.length - 8, 64)


def test_least_privilege_an_agent_reads_what_admission_needs_and_no_slot(
    agent: Agent, make_server, transport_name: str
) -> None:
    """What a slot server gives an agent -- one with the peer secret -- is three parts of its pool: ``pool``, what
    admission READs (header, load region, state words, prefix table); ``states``, the words a claim swaps
    (ATOMIC); ``inbox``, what claiming and submitting write (doorbells, cancels, reclaims, slots: WRITE).  Nothing
    lets it READ a slot -- another tenant's prompt or answer.  Over verbs the NIC refuses such a READ itself (a
    work request posted past the transport's own check fails with a remote access error)."""
    server = make_server(slots=2)
    link = agent.attach(server.address)
    h = server.pool.header
    remote = link.conn.remote
    assert {name: (r.access, r.length) for name, r in remote.items()} == {
        "pool": (Access.REMOTE_READ, int(h["doorbells_offset"])),
        "states": (Access.REMOTE_ATOMIC, 8 * 2),
        "inbox": (Access.REMOTE_WRITE, int(h["total_size"]) - int(h["doorbells_offset"])),
    }
    scratch, first_slot = agent.link_set.scratch_mr, int(h["slots_offset"]) - int(h["doorbells_offset"])
    with pytest.raises(TransportError, match="does not grant REMOTE_READ"):
        link.conn.read(scratch, 0, remote["inbox"], first_slot, 64)
    with pytest.raises(TransportError, match="outside remote region 'pool'"):
        link.conn.read(scratch, 0, remote["pool"], int(h["slots_offset"]), 64)
    with pytest.raises(TransportError, match="does not grant REMOTE_WRITE"):
        link.conn.write(scratch, 0, remote["states"], 0, 8)  # a state word changes by CAS alone
    if transport_name == "verbs":
        from edgepath.transports.verbs_shim import lib

        addr, rkey = remote["inbox"].handle
        post = link.conn.post_wait  # type: ignore[attr-defined]  # the verbs connection's own: no check of ours
        with pytest.raises(TransportError, match="remote access error"):
            post(lib.EP_V_READ, scratch.addr, scratch.lkey, 64, addr + first_slot, rkey, 0, "read a slot")


def test_least_privilege_slot_servers_see_only_the_agents_replies(agent: Agent, make_server) -> None:
    """The agent's requests (what it sends from) are registered with no remote access and never
    exported; a slot server is given the replies region alone, and only for writing results."""
    server = make_server()
    agent.attach(server.address)
    assert agent.frames_mr.access == Access.NONE
    assert agent.replies_mr.access == Access.REMOTE_WRITE
    assert agent.link_set.scratch_mr.access == Access.NONE
    (peer,) = server.peers.values()
    assert set(peer.conn.remote) == {"replies"}
    replies = peer.conn.remote["replies"]
    assert replies.access == Access.REMOTE_WRITE and replies.length == agent.replies_mr.buf.nbytes
    with pytest.raises(TransportError, match="does not grant"):
        peer.conn.read(server.pool_mr, 0, replies, 0, 8)
    with pytest.raises(TransportError, match="outside remote region"):
        peer.conn.write(server.pool_mr, 0, replies, replies.length - 4, 8)
