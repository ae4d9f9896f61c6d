"""A request's n choices (``submit_group``): n slots of one slot server claimed all or none -- a group that
cannot be had is NO_SLOT at once with nothing left claimed -- against real slot servers over the chosen
transport."""

from __future__ import annotations

import pytest
from helpers.datapath import serve_once

from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.native.abi import State, Status

pytestmark = pytest.mark.transport


@pytest.fixture
def agent(new_agent) -> Agent:
    return new_agent()


def _frames(agent: Agent, n: int, prompt: list[int]) -> list[int]:
    frames = []
    for k in range(n):
        index = agent.acquire()
        assert index is not None
        write_request(agent.frames, index, prompt, request_id=100 + k, max_new_tokens=len(prompt))
        frames.append(index)
    return frames


def test_a_group_is_claimed_on_one_server_and_each_choice_answered(agent: Agent, make_server) -> None:
    server = make_server(slots=4)
    link = agent.attach(server.address)
    frames = _frames(agent, 3, [5, 6, 7])
    assert agent.submit_group(frames) is None
    assert sorted(agent.inflight) == sorted(frames) and {agent.inflight[f].link for f in frames} == {link}
    assert len({agent.inflight[f].slot for f in frames}) == 3 and server.pool.free_count() == 1
    served = 0
    while served < 3:
        served += serve_once(server)
    finals = set()
    while len(finals) < 3:
        finals |= {d.index for d in agent.poll(timeout=5.0) if d.final}
    assert finals == set(frames)
    assert all(agent.frames.outputs[f, :3].tolist() == [5, 6, 7] for f in frames)


def test_a_group_that_cannot_be_had_whole_is_refused_at_once_and_leaves_nothing_claimed(
    agent: Agent, make_server
) -> None:
    server = make_server(slots=4)
    link = agent.attach(server.address)
    busy = _frames(agent, 2, [1])
    for index in busy:
        assert agent.submit(index) is None  # two of four slots taken
    frames = _frames(agent, 3, [2, 3])
    assert agent.submit_group(frames) == Status.NO_SLOT
    assert link.stats.unclaims == 2  # the two it got are given back, by CAS
    states = [server.pool.slot_word(s).state for s in range(4)]
    assert states.count(State.CLAIMED) == 2 and states.count(State.FREE) == 2  # only the two single requests
    assert not set(frames) & set(agent.inflight)
    # the given-back slots are claimable at once (no lease to wait for): a group of two fits now
    two = frames[:2]
    assert agent.submit_group(two) is None
    assert server.pool.free_count() == 0


def test_a_group_larger_than_any_server_is_a_bad_request(agent: Agent, make_server) -> None:
    server = make_server(slots=2)
    link = agent.attach(server.address)
    frames = _frames(agent, 3, [4])
    assert agent.submit_group(frames) == Status.BAD_REQUEST
    assert link.stats.cas_attempts == 0 and server.pool.free_count() == 2


def test_a_group_goes_where_all_its_choices_fit(agent: Agent, make_server) -> None:
    small, large = make_server(slots=2), make_server(slots=4)
    agent.attach(small.address)
    big = agent.attach(large.address)
    frames = _frames(agent, 3, [8, 9])
    assert agent.submit_group(frames) is None
    assert {agent.inflight[f].link for f in frames} == {big}
    assert small.pool.free_count() == 2 and large.pool.free_count() == 1
