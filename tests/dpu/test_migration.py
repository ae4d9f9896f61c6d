"""Streams that survive a lost slot server: the agent claims the request again on another server -- prompt and
answer so far as the new prompt, what is left to produce, the same sampling -- and the new server places its
output after the answer so far, so the caller sees one stream: no token repeated or skipped.  Over the chosen
transport, with a handler whose answer is a function of its prompt (helpers/counting.py), so "the same as an
uninterrupted run" is exact."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers.counting import Counting
from helpers.datapath import collect, send
from helpers.waiting import eventually

from edgepath.dpu.agent import Agent
from edgepath.dpu.link_state import LinkState, Reason
from edgepath.dpu.port import Delivery
from edgepath.native.abi import Status

pytestmark = pytest.mark.transport

PROMPT = [100, 101, 102, 103, 104]
MAX_NEW = 40
WHOLE = list(range(105, 105 + MAX_NEW))  # what an uninterrupted run answers


def until_count(agent: Agent, index: int, count: int, timeout: float = 10.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (got and got[-1].count >= count):
        got += [d for d in agent.poll(timeout=0.2) if d.index == index]
    assert got and got[-1].count >= count, f"frame {index} reached {got[-1].count if got else 0} of {count} tokens"
    return got


def test_a_stream_whose_server_dies_moves_and_finishes_exactly_once(new_agent, serve) -> None:
    first, second = serve(Counting(0.01), slots=2), serve(Counting(0.01), slots=2)
    agent: Agent = new_agent()
    on = agent.attach(first.address)
    agent.attach(second.address)
    index = send(agent, PROMPT, max_new=MAX_NEW)
    assert agent.inflight[index].link is on
    before = until_count(agent, index, 5)
    first.stop()
    first.close()  # the server is gone: its connection ends
    assert eventually(lambda: (agent.check_links() == []) and agent.inflight[index].link is not on, 10.0)
    assert agent.delivery_stats.migrated == 1 and not on.alive
    after = collect(agent, index)
    assert after[-1].final and after[-1].count == MAX_NEW
    counts = [d.count for d in before + after]
    assert counts == sorted(counts)  # one stream: the count only grows
    result = agent.frames.result_headers[index]
    assert result.status == Status.LENGTH and result.output_count == MAX_NEW
    assert agent.frames.outputs[index, :MAX_NEW].tolist() == WHOLE  # nothing repeated, nothing skipped
    stats = agent.delivery_stats
    assert (stats.duplicates, stats.unknown, stats.delivered) == (0, 0, 1)


def test_a_stream_whose_server_freezes_moves_and_the_thawed_server_writes_nothing(
    new_agent, make_server, serve
) -> None:
    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    frozen = make_server(Counting(0.0), slots=2, step_budget=0.05)  # its loop turns only when the test says
    other = serve(Counting(0.01), slots=2)
    agent: Agent = new_agent(hang_timeout=1.0, clock=clock)
    on = agent.attach(frozen.address)
    agent.attach(other.address)
    index = send(agent, PROMPT, max_new=MAX_NEW)
    assert agent.inflight[index].link is on
    deadline = time.monotonic() + 10
    while agent.inflight[index].count < 3 and time.monotonic() < deadline:
        frozen.poll_once(0.01)  # a few tokens come from the server before it freezes
        agent.poll(timeout=0.01)
    assert agent.inflight[index].count >= 3
    for _ in range(30):  # the frozen server's heartbeat stands still past the hang timeout; the other's moves
        clock.now += 0.1
        time.sleep(0.02)
        agent.check_links()
        if on.tracker.state is not LinkState.UP:
            break
    assert on.tracker.state is LinkState.DOWN and on.tracker.health().reason is Reason.DROPPED
    assert agent.inflight[index].link is not on and agent.delivery_stats.migrated == 1
    assert agent.stalled() == []  # moved: nothing to answer 504
    after = collect(agent, index)
    assert after[-1].final and after[-1].count == MAX_NEW
    assert agent.frames.outputs[index, :MAX_NEW].tolist() == WHOLE
    time.sleep(0.1)  # the frozen server's loop stood still past its step budget ...
    snapshot = np.array(agent.frames.outputs[index, :MAX_NEW])
    for _ in range(5):
        frozen.poll_once(0.01)  # ... it thaws: it finds its agent gone and writes nothing more
    assert frozen.stats.cancelled == 1 and not frozen.running
    assert agent.frames.outputs[index, :MAX_NEW].tolist() == snapshot.tolist() == WHOLE
    stats = agent.delivery_stats
    assert (stats.duplicates, stats.unknown) == (0, 0)


def test_a_request_that_cannot_move_is_lost_as_before(new_agent, serve) -> None:
    only = serve(Counting(0.01), slots=1)
    full = serve(Counting(1.0), slots=1)  # its one slot stays busy
    agent: Agent = new_agent()
    on = agent.attach(only.address)
    agent.attach(full.address)
    index = send(agent, PROMPT, max_new=MAX_NEW)
    assert agent.inflight[index].link is on
    busy = send(agent, [1, 2, 3], max_new=MAX_NEW)  # takes the other server's slot
    assert agent.inflight[busy].link is not on
    until_count(agent, index, 2)
    only.stop()
    only.close()
    lost: list[int] = []
    assert eventually(lambda: bool(lost.extend(agent.check_links()) or lost), 10.0)
    assert lost == [index] and agent.delivery_stats.migrated == 0  # answered 503 by the caller, as before


def test_a_request_moves_at_most_its_limit(new_agent, serve) -> None:
    servers = [serve(Counting(0.01), slots=2) for _ in range(3)]
    agent: Agent = new_agent(max_servers=3, migration_limit=1)
    links = [agent.attach(s.address) for s in servers]
    index = send(agent, PROMPT, max_new=MAX_NEW)
    until_count(agent, index, 3)
    first = links.index(agent.inflight[index].link)
    servers[first].stop()
    servers[first].close()
    assert eventually(lambda: agent.check_links() == [] and agent.inflight[index].link is not links[first], 10.0)
    second = links.index(agent.inflight[index].link)
    until_count(agent, index, agent.inflight[index].count + 2)
    servers[second].stop()
    servers[second].close()
    lost: list[int] = []
    assert eventually(lambda: bool(lost.extend(agent.check_links()) or lost), 10.0)
    assert lost == [index] and agent.delivery_stats.migrated == 1
