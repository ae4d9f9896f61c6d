"""A tenant's slot cap counted across agents (docs/TENANTS.md): two agents -- two edges, or two agent processes --
claiming on the same slot server count the tenant's slots from the state words they read, so together they never
let it hold more than its cap.  A claim made on a view that missed another agent's claims is counted again on the
words read after it, and given back when over; a refusal is SLOT_CAP with when to come back."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.counting import Counting
from helpers.datapath import wait_free

from edgepath.contract import wire
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.dpu.port import SlotLimits
from edgepath.native.abi import State, Status

pytestmark = pytest.mark.transport

CAPPED, OTHER = 3, 4  # tenant ids in the state words
CAP = 2


def submit(agent: Agent, tenant: int, cap: int = 0, max_new: int = 40) -> tuple[int, Status | None]:
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, [7], request_id=index + 1, max_new_tokens=max_new, flags=wire.FLAG_STREAM)
    agent.frames.request_headers[index].floored(tenant, 0, cap)
    return index, agent.submit(index)


RUNG = (State.READY, State.RUNNING, State.DONE)


def held(states: object, tenant: int, rung: bool = False) -> int:
    """Slots ``tenant`` holds in a pool's state words (every word that is not FREE, by its tenant field); ``rung``:
    only those whose request was sent (a claim counted over the cap is given back unrung)."""
    words = [int(w) for w in list(states)]  # type: ignore[call-overload]
    kept = RUNG if rung else tuple(state for state in State if state != State.FREE)
    return sum(1 for w in words if wire.word_tenant(w) == tenant and wire.word_state(w) in kept)


def drain(agents: list[Agent], timeout: float = 20.0) -> None:
    """Poll until no agent has a frame in flight, releasing each answered frame."""
    deadline = time.monotonic() + timeout
    while any(agent.inflight for agent in agents):
        assert time.monotonic() < deadline, [list(agent.inflight) for agent in agents]
        for agent in agents:
            for d in agent.poll(timeout=0.02):
                if d.final:
                    agent.release(d.index)


def test_a_claim_on_a_view_that_missed_another_agents_claims_is_given_back_slot_cap(new_agent, serve) -> None:
    server = serve(Counting(0.05), slots=6)
    first, second = new_agent(), new_agent()
    first.attach(server.address)
    second.attach(server.address)  # its cached words, read now: every slot FREE
    for _ in range(CAP):
        assert submit(first, CAPPED, CAP)[1] is None
    index, refused = submit(first, CAPPED, CAP)
    assert refused == Status.SLOT_CAP  # its own view holds both: refused before any claim
    first.release(index)
    assert eventually_held(server, CAPPED, CAP)
    index, refused = submit(second, CAPPED, CAP)  # its view (read at attach) holds none: it claims, counts again
    assert refused == Status.SLOT_CAP
    assert second.frames.results[index]["status"] == Status.SLOT_CAP
    second.release(index)
    assert held(server.pool.states, CAPPED) == CAP  # never more than the cap, and the claim given back is FREE
    assert sum(link.stats.unclaims for link in second.links) == 1
    assert submit(second, OTHER)[1] is None  # a tenant without a cap takes the slot given back
    drain([first, second])
    assert submit(second, CAPPED, CAP)[1] is None  # once the tenant's requests ended, it is admitted again
    drain([second])
    assert wait_free(server)


def test_a_group_over_the_cap_is_refused_whole_and_a_configured_cap_counts_without_the_header(new_agent, serve) -> None:
    server = serve(Counting(0.05), slots=6)
    agent = new_agent()
    agent.attach(server.address)
    agent.set_limits({CAPPED: SlotLimits(cap=CAP)})
    frames = []
    for _ in range(CAP + 1):
        index = agent.acquire()
        assert index is not None
        write_request(agent.frames, index, [7], request_id=index + 1, max_new_tokens=4)
        agent.frames.request_headers[index].floored(CAPPED, 0, 0)  # the header names no cap: the tenants file's
        frames.append(index)
    assert agent.submit_group(frames) == Status.SLOT_CAP
    assert server.pool.free_count() == 6 and not agent.inflight  # nothing claimed, none in flight
    assert agent.submit_group(frames[:CAP]) is None
    drain([agent])
    assert wait_free(server)


def eventually_held(server: object, tenant: int, count: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if held(server.pool.states, tenant) == count:  # type: ignore[attr-defined]
            return True
        time.sleep(0.01)
    return False


def test_two_agents_racing_for_a_tenant_never_hold_more_than_its_cap(new_agent, serve) -> None:
    """Two agents, each on a thread of its own, submit the capped tenant's short requests as fast as they can
    while a watcher reads the pool's state words: never more than its cap of the tenant's requests are sent (a
    claim that a racing one pushed over the cap shows CLAIMED until it is given back, unrung), and both agents are
    admitted and refused along the way (the race is real)."""
    server = serve(Counting(0.002), slots=8)
    agents = [new_agent(frames=8), new_agent(frames=8)]
    for agent in agents:
        agent.attach(server.address)
    stop = threading.Event()
    most = [0]
    outcomes: list[dict[str, int]] = [{"admitted": 0, "capped": 0, "other": 0} for _ in agents]

    def watch() -> None:
        while not stop.is_set():
            most[0] = max(most[0], held(server.pool.states, CAPPED, rung=True))

    def hammer(number: int) -> None:
        agent, counts = agents[number], outcomes[number]
        while not stop.is_set():
            index = agent.acquire()
            if index is not None:
                write_request(agent.frames, index, [7], request_id=index + 1, max_new_tokens=3)
                agent.frames.request_headers[index].floored(CAPPED, 0, CAP)
                status = agent.submit(index)
                if status is None:
                    counts["admitted"] += 1
                else:
                    counts["capped" if status == Status.SLOT_CAP else "other"] += 1
                    agent.release(index)
            for d in agent.poll(timeout=0.0):
                if d.final:
                    agent.release(d.index)

    threads = [threading.Thread(target=watch)] + [threading.Thread(target=hammer, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    time.sleep(3.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    drain(agents)
    assert most[0] <= CAP, f"{most[0]} of the tenant's requests were sent at once, over its cap of {CAP}"
    for counts in outcomes:
        assert counts["admitted"] > 0 and counts["capped"] > 0, outcomes
    assert wait_free(server)
