"""The floor book's memory of tenants' limits (dpu/floor_book.py): configured ones hold, those learned from requests
are forgotten an hour after a request last named them -- the rule the slot server's handler follows too -- and a
tenant with a cap only is known to have no floor (its slots may be taken back)."""

from __future__ import annotations

from edgepath.contract.plan import FLOOR_MEMORY_S, FloorMemory
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.dpu.port import SlotLimits


def named(agent: Agent, tenant: int, floor: int, cap: int = 0) -> None:
    """A request of ``tenant`` naming ``floor`` and ``cap`` is decided on (its standing counted)."""
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, [1], request_id=1, max_new_tokens=1)
    agent.frames.request_headers[index].floored(tenant, floor, cap)
    agent.floors.standing(index)
    agent.release(index)


def test_learned_limits_are_forgotten_an_hour_after_a_request_last_named_them_and_configured_ones_hold(
    new_agent,
) -> None:
    now = [0.0]
    agent = new_agent(clock=lambda: now[0])
    agent.set_limits({9: SlotLimits(floor=1)})
    named(agent, 1, 2)
    named(agent, 2, 0, cap=3)  # a cap only: no floor, so above it with every slot it holds
    named(agent, 0, 2)  # a request without a tenant id names nothing to count
    assert agent.floors.table() == {1: 2, 2: 0, 9: 1}
    now[0] = FLOOR_MEMORY_S + FloorMemory.SWEEP_S
    named(agent, 3, 1)
    assert agent.floors.table() == {3: 1, 9: 1}
    named(agent, 9, 4)  # a request naming another floor for a configured tenant: the tenants file's holds
    assert agent.floors.limits(9, SlotLimits(4)) == SlotLimits(1)
