"""The agent's view of a slot server's heartbeat: a server whose loop does not turn is UNRESPONSIVE at the
hang timeout, nothing is claimed on it, what it holds is reported once and stays fenced until it lets go;
a heartbeat that moves again brings it back; a link that breaks gives back what was in flight on it.

The slot servers here are turned by hand (``make_server``): a server the test does not turn is exactly a
frozen one (its memory answers reads and CAS, its loop does nothing), and the agent's clock is the test's,
so every verdict is exact -- no sleeps, no timing."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
from helpers.datapath import send, serve_once
from helpers.waiting import wait_for

from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.dpu.link_state import LinkState, Reason
from edgepath.dpu.port import Delivery
from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, Heartbeat, SlotRequest

pytestmark = pytest.mark.transport

HANG = 2.0


class Clock:
    """The agent's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def agent(new_agent, clock: Clock) -> Agent:
    return new_agent(hang_timeout=HANG, clock=clock)


def go_still(agent: Agent, clock: Clock) -> None:
    """Let the hang timeout pass with the agent looking at its links (two probes)."""
    for _ in range(2):
        clock.advance(HANG / 2)
        agent.check_links()


def test_the_heartbeat_comes_with_the_state_words_in_one_read(agent: Agent, make_server) -> None:
    server = make_server()
    link = agent.attach(server.address)
    server.poll_once(0.0)
    reads = link.stats.refreshes
    agent.free_slots()
    assert link.stats.refreshes == reads + 1
    assert int(link.beat[0]) == int(server.pool.header["heartbeat"]) == server.memory.beats > 0


def test_a_server_whose_loop_stands_still_is_unresponsive_at_the_hang_timeout_and_nothing_is_claimed_there(
    agent: Agent, make_server, clock: Clock
) -> None:
    server = make_server(slots=2)
    link = agent.attach(server.address)
    clock.advance(HANG / 2)
    assert agent.check_links() == [] and link.up
    clock.advance(HANG / 2)
    agent.check_links()
    health = agent.links_health()[0]
    assert (health.address, health.state, health.reason) == (
        server.address,
        LinkState.UNRESPONSIVE,
        Reason.NO_HEARTBEAT,
    )
    assert health.since == clock.now and link.alive
    write_request(agent.frames, 0, [1, 2], request_id=1, max_new_tokens=2)
    attempts = link.stats.cas_attempts
    assert agent.submit(0) == Status.UNAVAILABLE
    assert link.stats.cas_attempts == attempts and server.pool.free_count() == 2
    assert agent.free_slots() == (0, 2)  # its free slots cannot be had


def test_a_server_that_turns_keeps_its_link_up(agent: Agent, make_server, clock: Clock) -> None:
    server = make_server()
    link = agent.attach(server.address)
    for _ in range(5):
        server.poll_once(0.0)
        clock.advance(HANG / 2)
        agent.check_links()
    assert link.up


def test_frames_in_flight_there_are_reported_once_and_stay_fenced_until_the_server_lets_go(
    agent: Agent, make_server, clock: Clock
) -> None:
    server = make_server(slots=2)
    link = agent.attach(server.address)
    index = send(agent, [1, 2, 3], max_new=3)
    assert agent.stalled() == []  # still up
    go_still(agent, clock)
    assert agent.stalled() == [index]
    assert agent.stalled() == []  # once
    agent.abandon(index)
    assert index in agent.inflight  # fenced: the server may still write into it
    assert serve_once(server) == 1  # it thaws and answers, late
    deadline = time.monotonic() + 10
    got = []
    while index in agent.inflight and time.monotonic() < deadline:
        got += agent.poll(timeout=0.5)
    # nothing for it but its late final, marked abandoned: what was computed, for its bill
    assert got == [Delivery(index, 3, True, abandoned=True)]
    assert index not in agent.inflight and agent.delivery_stats.late == 1
    server.poll_once(0.0)
    clock.advance(agent.link_set.probe_interval)
    agent.check_links()
    assert link.up and agent.links_health()[0].since == clock.now


def test_a_heartbeat_that_moves_again_lets_claims_resume_at_once(agent: Agent, make_server, clock: Clock) -> None:
    server = make_server(slots=2)
    link = agent.attach(server.address)
    go_still(agent, clock)
    write_request(agent.frames, 0, [1], request_id=1, max_new_tokens=1)
    assert agent.submit(0) == Status.UNAVAILABLE
    server.poll_once(0.0)
    clock.advance(agent.link_set.probe_interval)
    assert agent.submit(0) is None  # the submit itself looked again
    assert link.up and server.pool.free_count() == 1


def test_with_several_servers_claims_go_to_those_that_are_up(agent: Agent, make_server, clock: Clock) -> None:
    frozen, live = make_server(slots=1), make_server(slots=1)
    stuck = agent.attach(frozen.address)
    moving = agent.attach(live.address)
    for _ in range(2):
        live.poll_once(0.0)
        clock.advance(HANG / 2)
        agent.check_links()
    assert [stuck.tracker.state, moving.tracker.state] == [LinkState.UNRESPONSIVE, LinkState.UP]
    assert agent.free_slots() == (1, 2)
    statuses = []
    for i in range(2):
        write_request(agent.frames, i, [i + 1], request_id=i, max_new_tokens=1)
        statuses.append(agent.submit(i))
    assert statuses == [None, Status.NO_SLOT]  # the live one is full; the frozen one is not tried
    assert frozen.pool.free_count() == 1 and live.pool.free_count() == 0


def test_a_link_that_breaks_under_an_operation_gives_back_what_was_in_flight(agent: Agent, make_server) -> None:
    server = make_server(slots=2)
    link = agent.attach(server.address)
    index = send(agent, [1, 2])
    link.conn.close()  # what a queue pair in the error state looks like to the agent
    write_request(agent.frames, 1, [3], request_id=2, max_new_tokens=1)
    assert agent.submit(1) == Status.UNAVAILABLE
    health = agent.links_health()[0]
    assert (health.state, health.reason) == (LinkState.DOWN, Reason.FAILED) and "closed" in health.detail
    assert agent.check_links() == [index]  # answered 503 by the edge, never stranded
    assert agent.check_links() == []


def test_a_client_gone_after_its_link_broke_and_before_the_edge_heard_frees_its_frame_once(
    agent: Agent, make_server
) -> None:
    """Issue 37: a link taken down under another operation (a claim, a probe for /metrics) between two ticks holds
    a frame the edge still streams; a client that resets then abandons a frame no longer in flight -- which raised
    ``frame N is not in flight`` out of the edge's reset handler.  Now the frame is freed there, once, and the next
    check reports nothing for it (the request ends once: as the client's reset)."""
    server = make_server(slots=2)
    link = agent.attach(server.address)
    index = send(agent, [1, 2])
    link.conn.close()
    other = agent.acquire()
    assert other is not None
    write_request(agent.frames, other, [3], request_id=2, max_new_tokens=1)
    assert agent.submit(other) == Status.UNAVAILABLE  # the link is down: the frame is lost, not yet reported
    agent.release(other)
    agent.abandon(index)  # the client went away first
    assert agent.check_links() == []  # never answered a second time (503) nor released by the edge
    assert sorted(i for i in iter(agent.acquire, None)) == list(range(agent.frames.count))  # each frame once
    with pytest.raises(ValueError, match=f"frame {index} is not in flight nor lost"):
        agent.abandon(index)  # a frame the caller holds (a bug of the caller's) is still an error


class Blocking:
    """A batch handler whose step blocks until the test releases it: a model step that does not end (a stuck
    kernel).  The server's real loop runs it on a thread, so its heartbeat really stops."""

    def __init__(self) -> None:
        self.running: dict[int, SlotRequest] = {}
        self.blocked = threading.Event()
        self.go = threading.Event()

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        self.running[request.slot] = request
        return []

    def step(self, now: float) -> list[Emit]:
        self.blocked.set()
        self.go.wait(30.0)
        done = [Emit(slot, 0, Status.OK) for slot in self.running]
        self.running.clear()
        return done

    def cancel(self, slot: int) -> bool:
        self.running.pop(slot, None)
        return True

    def wake_in(self, now: float) -> float | None:
        return 0.0 if self.running else None

    def close(self) -> None:
        self.go.set()


def test_a_model_step_that_blocks_stops_the_heartbeat_and_one_that_ends_brings_it_back(serve, new_agent) -> None:
    handler = Blocking()
    server = serve(handler, slots=2, step_budget=0.05)
    agent = new_agent(hang_timeout=0.5)  # the real clock: the server's loop is really stuck
    link = agent.attach(server.address)
    index = send(agent, [1, 2, 3], max_new=3)
    assert handler.blocked.wait(10.0)
    wait_for(
        lambda: not agent.check_links() and link.tracker.state is LinkState.UNRESPONSIVE, 20.0, "the link to go still"
    )
    assert agent.stalled() == [index]
    agent.abandon(index)
    write_request(agent.frames, 1, [4], request_id=2, max_new_tokens=1)
    assert agent.submit(1) == Status.UNAVAILABLE
    handler.go.set()  # the step ends: the late answer frees the frame, the heartbeat moves again
    wait_for(lambda: not agent.poll(timeout=0.05) and index not in agent.inflight, 20.0, "the late answer")
    wait_for(lambda: not agent.check_links() and link.up, 20.0, "the link to come back")
    assert agent.delivery_stats.late == 1 and agent.delivery_stats.duplicates == 0
    assert server.stats.slow_steps >= 1 and server.stats.longest_step > server.config.step_budget  # reported


class LongStep(Blocking):
    """A long step that makes progress and says so through the heartbeat hook, from C, as llama.cpp's graph
    computation does (``ctypes`` calls the hook's C function on this thread, every 10 ms)."""

    ticks = 0

    def beat_within_steps(self, heartbeat: Heartbeat) -> None:
        tick = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)(heartbeat.function)
        self.tick = lambda: tick(ctypes.c_void_p(heartbeat.word))

    def step(self, now: float) -> list[Emit]:
        self.blocked.set()
        while not self.go.wait(0.01):
            assert self.tick() is False  # never asks the step to stop
            self.ticks += 1
        done = [Emit(slot, 0, Status.OK) for slot in self.running]
        self.running.clear()
        return done


def test_a_long_step_that_beats_from_within_keeps_its_link_up(serve, new_agent) -> None:
    handler = LongStep()
    server = serve(handler, slots=2)
    agent = new_agent(hang_timeout=0.5)
    link = agent.attach(server.address)
    index = send(agent, [1, 2, 3], max_new=3)
    assert handler.blocked.wait(10.0)
    seen = set()

    def long_enough() -> bool:  # one step over at least three hang timeouts, watched throughout
        agent.check_links()
        seen.add(link.tracker.state)
        return handler.ticks >= 150

    wait_for(long_enough, 20.0, "a step of 150 beats")
    handler.go.set()
    got: list[Delivery] = []
    wait_for(lambda: bool(got.extend(d for d in agent.poll(timeout=0.05) if d.final) or got), 20.0, "the answer")
    assert seen == {LinkState.UP} and [d.index for d in got] == [index] and agent.stalled() == []
