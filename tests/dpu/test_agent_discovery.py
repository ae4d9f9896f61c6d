"""An agent that follows a source of slot servers (``--slot-servers-from``): one that appears is attached and
claimed, one that vanishes is drained -- nothing new claimed there, what it runs finishes there, or moves to
another after the drain timeout -- and then let go of.

The source is a resolver the test controls (a set of addresses), the slot servers are real ones on the chosen
transport turned by hand (``make_server``), and the agent's clock is the test's: each step is decided by the
test, never by a sleep."""

from __future__ import annotations

import pytest
from helpers.datapath import collect, send, serve_once
from helpers.waiting import wait_for

from edgepath.dpu.agent import Agent
from edgepath.dpu.discovery import Membership, Source
from edgepath.dpu.frame import write_request
from edgepath.dpu.link_state import LinkState, Reason
from edgepath.dpu.resolvers import Follower
from edgepath.native.abi import Status

pytestmark = pytest.mark.transport

INTERVAL = 1.0
DRAIN = 10.0
HANG = 100.0  # hand-turned servers beat only when turned: the drain, not the heartbeat, decides here


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Source_:
    """The addresses the source names: the test changes them."""

    def __init__(self, *addresses: str) -> None:
        self.names = set(addresses)

    def __call__(self, source: Source) -> set[str]:
        return set(self.names)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def following(new_agent, clock: Clock, names: Source_, **options) -> Agent:
    agent = new_agent(clock=clock, drain_timeout=DRAIN, hang_timeout=HANG, **options)
    agent.follow(Follower(Source("dir", "/test"), Membership(INTERVAL), names, clock))
    return agent


def addresses(agent: Agent) -> list[str]:
    return [link.address for link in agent.links]


def finals(agent: Agent) -> set[int]:
    """The frames whose final result arrives, until none is in flight (bounded in time)."""
    done: set[int] = set()
    wait_for(
        lambda: not done.update(d.index for d in agent.poll(timeout=0.1) if d.final) and not agent.inflight,
        10.0,
        "finals",
    )
    return done


def next_resolution(agent: Agent, clock: Clock, done) -> None:
    """Let a resolve interval pass and turn the agent's housekeeping (what the edge does at every tick) until
    ``done()``: the resolution and the attaches it starts run on threads of their own."""
    clock.now += INTERVAL
    wait_for(lambda: bool(agent.revive()) or done(), 10.0, "the agent to follow its source")


def test_the_slot_servers_named_at_start_are_attached_at_once(new_agent, make_server, clock: Clock) -> None:
    a, b = make_server(), make_server()
    agent = following(new_agent, clock, Source_(a.address, b.address))
    assert sorted(addresses(agent)) == sorted([a.address, b.address])
    assert all(link.up for link in agent.links)


def test_a_slot_server_that_appears_is_attached_and_claimed(new_agent, make_server, clock: Clock) -> None:
    a, b = make_server(slots=1), make_server(slots=1)
    names = Source_(a.address)
    agent = following(new_agent, clock, names)
    first = send(agent, [1, 2])
    assert agent.inflight[first].link.address == a.address
    names.names.add(b.address)
    next_resolution(agent, clock, lambda: b.address in addresses(agent))
    second = send(agent, [3, 4])  # a's one slot is taken: the new server takes it
    assert agent.inflight[second].link.address == b.address
    assert serve_once(a) == 1 and serve_once(b) == 1
    assert finals(agent) == {first, second}


def test_a_slot_server_that_vanishes_is_drained_its_request_finishes_there_then_it_is_let_go_of(
    new_agent, make_server, clock: Clock
) -> None:
    a, b = make_server(slots=2), make_server(slots=2)
    names = Source_(a.address, b.address)
    agent = following(new_agent, clock, names)
    index = send(agent, [1, 2, 3], max_new=3)
    held = agent.inflight[index].link
    server, other = (a, b) if held.address == a.address else (b, a)
    names.names.discard(server.address)
    next_resolution(agent, clock, lambda: held.draining)
    health = held.tracker.health()
    assert (health.state, health.reason) == (LinkState.DRAINING, Reason.DRAINED) and held.alive and not held.up
    claims = held.stats.claims
    for _ in range(2):  # nothing new is claimed there, though it has a free slot
        assert agent.inflight[send(agent, [7])].link.address == other.address
    assert held.stats.claims == claims
    agent.revive()
    assert held in agent.links  # kept while its request runs
    assert serve_once(server) == 1
    got = collect(agent, index)
    assert got[-1].final and agent.frames.outputs[index, :3].tolist() == [1, 2, 3]
    agent.revive()
    assert addresses(agent) == [other.address] and held.conn.conn_id in agent.link_set.retired
    stats = agent.delivery_stats
    assert (stats.migrated, stats.duplicates, stats.unknown, stats.late) == (0, 0, 0, 0)


def test_a_drained_slot_server_whose_request_outlasts_the_drain_timeout_hands_it_over(
    new_agent, make_server, clock: Clock
) -> None:
    a, b = make_server(slots=2), make_server(slots=2)
    names = Source_(a.address, b.address)
    agent = following(new_agent, clock, names)
    index = send(agent, [5, 6, 7, 8], max_new=4)
    held = agent.inflight[index].link
    server, other = (a, b) if held.address == a.address else (b, a)
    names.names.discard(server.address)
    next_resolution(agent, clock, lambda: held.draining)
    clock.now += DRAIN / 2
    agent.revive()
    assert agent.inflight[index].link is held  # within the drain: it stays
    clock.now += DRAIN / 2
    agent.revive()  # past it: the link is let go of and the request claimed again on the other server
    assert agent.inflight[index].link.address == other.address
    assert held.tracker.health().reason is Reason.DRAINED and not held.alive
    assert serve_once(other) == 1
    got = collect(agent, index)
    assert got[-1].final and agent.frames.outputs[index, :4].tolist() == [5, 6, 7, 8]
    agent.revive()
    assert addresses(agent) == [other.address]
    stats = agent.delivery_stats
    assert (stats.migrated, stats.duplicates, stats.unknown) == (1, 0, 0)


def test_a_slot_server_named_again_while_draining_is_claimed_again(new_agent, make_server, clock: Clock) -> None:
    a = make_server(slots=2)
    names = Source_(a.address)
    agent = following(new_agent, clock, names)
    index = send(agent, [1])
    link = agent.links[0]
    names.names.clear()
    next_resolution(agent, clock, lambda: link.draining)
    write = agent.acquire()
    assert write is not None
    write_request(agent.frames, write, [2], request_id=9, max_new_tokens=1)
    assert agent.submit(write) == Status.UNAVAILABLE  # its only server drains: nothing to claim
    names.names.add(a.address)
    next_resolution(agent, clock, lambda: link.up)
    assert agent.submit(write) is None and agent.links == [link]
    assert serve_once(a) == 2
    assert finals(agent) == {index, write}


def test_a_named_slot_server_that_does_not_answer_is_tried_with_back_off_and_its_place_reused(
    new_agent, make_server, new_address, clock: Clock
) -> None:
    a, b = make_server(), make_server()
    nobody = new_address("nobody")
    names = Source_(a.address, nobody)
    agent = following(new_agent, clock, names, max_servers=2)
    link_set = agent.link_set
    assert addresses(agent) == [a.address] and set(link_set.joining) == {nobody}
    assert link_set.joining[nobody].failures == 1
    agent.revive()
    assert not link_set.reattaching  # its first retry is 0.1 s after the failure
    clock.now += 0.1
    agent.revive()
    assert link_set.reattaching
    wait_for(lambda: bool(agent.revive()) or link_set.joining[nobody].failures == 2, 10.0, "the retry to fail")
    assert link_set.joining[nobody].next_at == pytest.approx(clock.now + 0.2)
    names.names = {b.address}  # a leaves, the one that never answered is forgotten, b comes
    position = agent.links[0].position
    next_resolution(agent, clock, lambda: b.address in addresses(agent))
    assert addresses(agent) == [b.address] and not link_set.joining
    assert agent.links[0].position == position  # a's place in the scratch region, freed and taken again


def test_a_slot_server_that_says_it_drains_is_claimed_no_more_and_finishes_what_it_holds(
    new_agent, make_server, clock: Clock
) -> None:
    a, b = make_server(slots=2), make_server(slots=2)
    agent = new_agent(clock=clock, drain_timeout=DRAIN, hang_timeout=HANG)
    for server in (a, b):
        agent.attach(server.address)
    index = send(agent, [1, 2, 3], max_new=3)
    held = agent.inflight[index].link
    server, other = (a, b) if held.address == a.address else (b, a)
    server.memory.drain()  # what SIGTERM makes it say (slots/server.py: drain)
    clock.now += agent.link_set.probe_interval
    agent.check_links()  # the next link check reads the word with the heartbeat
    health = held.tracker.health()
    assert (health.state, health.detail) == (LinkState.DRAINING, "the slot server is stopping")
    for _ in range(2):
        assert agent.inflight[send(agent, [7])].link.address == other.address
    assert serve_once(server) == 1
    assert collect(agent, index)[-1].final and agent.frames.outputs[index, :3].tolist() == [1, 2, 3]
    agent.revive()
    assert held in agent.links  # not left the source: once it is gone, it is re-attached when it is back
