"""Admission within a bound on waiting, against real slot servers over the chosen transport: the slot server
publishes its handler's load in the pool header (read with the heartbeat), and the agent claims where the
predicted wait fits the request's bound, or refuses OVER_BOUND at once.  The handler here reports a load the
test sets (a stand-in for a model: the unit is the data path's words and the agent's decision)."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np
import pytest
from helpers.datapath import send, serve_once
from helpers.loaded import PACE, Loaded, published

from edgepath.contract import wire
from edgepath.contract.plan import Load, Prompt, Step, own_ms, predict
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.native.abi import State, Status
from edgepath.slots.handlers import ReportsLoad

pytestmark = pytest.mark.transport

BUSY = Load(waiting=(Prompt(0, 1000), Prompt(0, 1000)), **PACE)  # about 6 s of prompts ahead (4 slots: not full)
IDLE = Load(**PACE)


def submit(agent: Agent, tokens: int, max_wait_ms: int = 0) -> tuple[int, Status | None]:
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, list(range(1, tokens + 1)), request_id=index + 1, max_new_tokens=4)
    agent.frames.request_headers[index].bound(max_wait_ms)
    return index, agent.submit(index)


def test_the_pool_header_carries_the_handlers_load_to_the_agent(make_server, new_agent) -> None:
    assert isinstance(Loaded(IDLE), ReportsLoad)
    server = make_server(Loaded(BUSY), slots=3)
    link = new_agent().attach(server.address)
    assert published(server.pool) == BUSY
    # read with the heartbeat when it attached, with the pool's slots from its header (objective 9's full house)
    assert link.load == replace(BUSY, slots=3)


def test_a_request_is_refused_at_once_when_every_server_would_make_it_wait_past_its_bound(
    make_server, new_agent
) -> None:
    server = make_server(Loaded(BUSY), slots=4)
    agent: Agent = new_agent(max_wait=2.0)
    agent.attach(server.address)
    index, status = submit(agent, 40)
    assert status is Status.OVER_BOUND
    expected = predict(BUSY, Prompt(0, 40)).wait_ms
    assert agent.frames.result_headers[index].refusal_wait_us == int(expected * 1e3)
    assert server.pool.count(State.CLAIMED) == 0  # nothing claimed, nothing written
    agent.release(index)


def test_an_idle_server_admits_a_long_prompt_whatever_the_bound(make_server, new_agent) -> None:
    server = make_server(Loaded(IDLE), cap=64)
    agent: Agent = new_agent(max_wait=0.001)
    agent.attach(server.address)
    index, status = submit(agent, 60)
    assert status is None
    req = agent.frames.request_headers[index]
    assert req.predicted_ttft_us == int(own_ms(IDLE, Prompt(0, 60)) * 1e3) and req.predicted_wait_us == 0
    assert serve_once(server) == 1


def test_a_request_may_ask_for_less_never_for_more(make_server, new_agent) -> None:
    load = Load(decoding=8, **PACE)  # a short wait: about half a step beside 8 streams
    server = make_server(Loaded(load), slots=4)
    wait = predict(load, Prompt(0, 20)).wait_ms
    assert 1 < wait < 100
    agent: Agent = new_agent(max_wait=1.0)
    agent.attach(server.address)
    assert submit(agent, 20)[1] is None  # within the server's bound
    assert submit(agent, 20, max_wait_ms=int(wait / 2))[1] is Status.OVER_BOUND  # asks for less than it would wait
    # more than the server allows is the server's bound: the busy server refuses it all the same
    busy = make_server(Loaded(BUSY), slots=4)
    other: Agent = new_agent(max_wait=1.0)
    other.attach(busy.address)
    assert submit(other, 20, max_wait_ms=600_000)[1] is Status.OVER_BOUND


def test_the_claim_goes_to_the_server_with_the_lowest_predicted_first_token(make_server, new_agent) -> None:
    busy = make_server(Loaded(Load(decoding=12, **PACE)), slots=4)
    calm = make_server(Loaded(Load(decoding=1, **PACE)), slots=1)
    agent: Agent = new_agent()
    agent.attach(busy.address)
    agent.attach(calm.address)
    send(agent, list(range(1, 30)))
    assert (busy.pool.count(State.CLAIMED), calm.pool.count(State.CLAIMED)) == (0, 1)  # fewer free slots, sooner


def test_a_server_that_publishes_no_load_is_never_refused_over_a_bound(make_server, new_agent) -> None:
    from edgepath.slots.handlers import echo

    server = make_server(echo)
    agent: Agent = new_agent(max_wait=0.001)
    link = agent.attach(server.address)
    assert not link.load.published and published(server.pool) == Load()
    assert submit(agent, 30)[1] is None


class Prefilling(Loaded):
    """Holds every request in prefill until it is cancelled (a model whose prompt steps have not run yet):
    its load counts the prompts it holds."""

    def __init__(self) -> None:
        super().__init__(IDLE)
        self.held: dict[int, int] = {}

    def add(self, request, now):  # type: ignore[no-untyped-def]
        self.held[request.slot] = len(request.tokens)
        return []

    def cancel(self, slot: int) -> bool:
        self.held.pop(slot, None)
        return True

    def load(self) -> Load:
        return Load(waiting=tuple(Prompt(0, n) for n in self.held.values()), **PACE)


def test_a_cancelled_prompt_leaves_no_load_behind(make_server, new_agent) -> None:
    """The lock-out of issue 34: a request cancelled while its prompt waited left its tokens in the published
    load, the idle server then stepped no more (nothing ran), so the stale load stood for good."""
    handler = Prefilling()
    server = make_server(handler)
    agent: Agent = new_agent()
    link = agent.attach(server.address)
    index, status = submit(agent, 40)
    assert status is None and serve_once(server, timeout=0.5) == 1
    assert published(server.pool).pending_tokens == 40  # type: ignore[union-attr]
    agent.abandon(index)
    server.poll_once(0.5)
    assert not handler.held and not server.running
    assert published(server.pool) == IDLE
    agent.link_set.refresh(link)
    assert link.load == replace(IDLE, slots=link.slot_count)


def test_a_refusal_never_rests_on_a_view_older_than_a_heartbeat(make_server, new_agent) -> None:
    handler = Loaded(BUSY)
    server = make_server(handler)
    now = [0.0]
    agent: Agent = new_agent(max_wait=2.0, clock=lambda: now[0])
    agent.attach(server.address)
    handler.current = IDLE
    server.poll_once(0.01)  # the server is idle now; the agent's view (read at attach) is not
    index, status = submit(agent, 40)
    assert status is Status.OVER_BOUND  # a view younger than a heartbeat is what it decides on
    agent.release(index)
    now[0] += agent.link_set.probe_interval
    index, status = submit(agent, 40)
    assert status is None  # older: read again before refusing, and admitted


def test_claims_the_model_side_has_not_taken_count_as_the_prompts_written_there(make_server, new_agent) -> None:
    """Two requests claimed before the server's loop took either: the second is predicted behind the first's own
    prompt (300 tokens), not behind one as long as itself (it was counted so until issue 34's serving runs showed
    a short prompt predicted behind a long one at a third of its wait)."""
    server = make_server(Loaded(IDLE), cap=512)
    agent: Agent = new_agent(cap=512)
    link = agent.attach(server.address)
    _, status = submit(agent, 300)
    assert status is None
    # claimed and rung, not taken yet: the server's loop has not run
    assert [claim.prompt for claim in link.unseen] == [Prompt(0, 300)]
    second, status = submit(agent, 20)
    assert status is None
    predicted = agent.frames.request_headers[second].predicted_ttft_us / 1e3
    behind_the_first = predict(IDLE, Prompt(0, 20), [Prompt(0, 300)]).ttft_ms
    assert predicted == pytest.approx(behind_the_first, abs=1e-3)
    assert behind_the_first > predict(IDLE, Prompt(0, 20), [Prompt(0, 20)]).ttft_ms + 500  # not its own length
    assert serve_once(server, timeout=0.5) == 2


class Decoding(Prefilling):
    """Holds every request as a decoding stream (it never ends on its own)."""

    def load(self) -> Load:
        return Load(decoding=len(self.held), longest=max(self.held.values(), default=0), runs=1, **PACE)


def test_a_refusal_says_when_a_retry_is_predicted_to_be_admitted(make_server, new_agent) -> None:
    """NO_SLOT: when the soonest request there reaches its max_tokens at the server's decode step; OVER_BOUND: when
    the predicted wait is back within the bound; each client refused after another is told to come after it (booked
    for the work it brings), stretched by up to a quarter of that work at random (no lockstep)."""
    now = [100.0]
    server = make_server(Decoding(), slots=1)
    agent: Agent = new_agent(seed=7, clock=lambda: now[0])
    agent.attach(server.address)
    _, status = submit(agent, 10)  # 4 tokens to go, one 9 ms decode step each (6 ms + 3 ms per stream)
    assert status is None and serve_once(server, timeout=0.5) == 1
    agent.link_set.refresh(agent.links[0])
    retries = []
    for _ in range(5):
        index, status = submit(agent, 10)
        assert status is Status.NO_SLOT
        retries.append(agent.frames.result_headers[index].retry_after_ms)
        agent.release(index)
    frees = 4 * PACE["costs"].step_ms(Step(0, 1, 11))  # one flight: the soonest free, and the spacing
    assert frees <= retries[0] <= 1.25 * frees + 1
    assert all(frees - 1 <= b - a <= 1.25 * frees + 1 for a, b in itertools.pairwise(retries)), retries
    busy = make_server(Loaded(BUSY), slots=4)
    other: Agent = new_agent(seed=7, clock=lambda: now[0])
    other.attach(busy.address)
    index, status = submit(other, 40)
    assert status is Status.OVER_BOUND
    result = other.frames.result_headers[index]
    excess = result.refusal_wait_us / 1e3 - other.max_wait_ms
    work = predict(BUSY, Prompt(0, 40)).ttft_ms - predict(BUSY, Prompt(0, 40)).wait_ms
    assert result.refusal_bound_ms == 2000 and excess <= result.retry_after_ms <= excess + 0.25 * work + 1
    other.release(index)
    index, status = submit(other, 40)  # the next client refused: after the first, and the work it brings
    assert status is Status.OVER_BOUND
    second = other.frames.result_headers[index].retry_after_ms
    assert excess + work - 1 <= second <= excess + 1.5 * work + 1


def test_the_agent_knows_how_long_the_servers_step_under_way_has_run_from_its_clock(make_server, new_agent) -> None:
    """ABI 11: the server's heartbeat and its load's version are its CLOCK_MONOTONIC when stored, read in one READ;
    their difference, plus the time since that READ on the agent's own clock, is how long the step the load plans
    first has run -- and the prediction counts what is left of that step, not half of it."""
    server = make_server(Loaded(BUSY), slots=4)
    now = [100.0]
    agent: Agent = new_agent(max_wait=60.0, clock=lambda: now[0])
    link = agent.attach(server.address)
    published_ns = int(server.pool.buf[wire.LOAD_OFFSET : wire.LOAD_OFFSET + 8].view(np.uint64)[0])
    server.memory.beat(0.0)  # the server's loop turns, after it published
    beat_ns = time.monotonic_ns()
    agent.link_set.refresh(link)
    ran = link.under_way_ms(now[0])
    assert ran is not None and 0.0 < ran <= (beat_ns - published_ns) / 1e6
    now[0] += 0.2  # 200 ms later on the agent's clock, nothing read since
    assert link.under_way_ms(now[0]) == pytest.approx(ran + 200.0)
    index, status = submit(agent, 40)
    assert status is None
    expected = predict(BUSY, Prompt(0, 40), under_way_ms=ran + 200.0)
    # within a microsecond: the agent's 200 ms is its clock's difference, a float a rounding away from 200.0
    assert agent.frames.request_headers[index].predicted_ttft_us == pytest.approx(expected.ttft_ms * 1e3, abs=1)
    assert expected.ttft_ms <= predict(BUSY, Prompt(0, 40), under_way_ms=0.0).ttft_ms - 200.0
