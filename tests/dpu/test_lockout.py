"""No lock-out, by construction (issue 34): a closed loop that never backs off floods a slot server whose model steps
are starved (fault-injected: 15x their calibrated cost) and whose clients go away mid-prompt; when the flood stops
the server is idle, and the next request is admitted within one heartbeat -- never refused on work the server no
longer has, nor on a cost model pulled up by the starved steps.

The handler is a stand-in for a model that runs the real step planner and cost model (``contract/plan.py``) and
sleeps for what each step is planned to cost: the unit here is the loop publish -> read -> decide, on the real
data path and slot-server loop."""

from __future__ import annotations

import random
import time

import pytest

from edgepath.contract.plan import Costs, Load, PolicyOptions, Prompt, StepPolicy
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.model.cost import CostModel
from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, SlotRequest

pytestmark = pytest.mark.transport

CALIBRATED = Costs(overhead_ms=1.0, prompt_ms=0.05, decode_ms=0.2)
OPTIONS = PolicyOptions(stall_ms=20.0, min_prefill=4, batch=256)


class Starved:
    """Prompts and decoding streams planned by the real policy; each step sleeps what it costs, times ``slowdown``
    (the fault); the cost model follows the steps as they run."""

    def __init__(self) -> None:
        self.cost = CostModel(CALIBRATED)
        self.policy = StepPolicy(OPTIONS)
        self.slowdown = 1.0
        self.running: dict[int, list[int]] = {}  # slot -> [prompt, computed, decoded, max_new]

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        self.running[request.slot] = [len(request.tokens), 0, 0, len(request.output)]
        return []

    def step(self, now: float) -> list[Emit]:
        load = self.load()
        takes = self.policy.plan(load.costs, load.decoding, load.longest, list(load.waiting), load.runs)
        waiting = [slot for slot, r in self.running.items() if r[1] < r[0]]
        decoding = [slot for slot, r in self.running.items() if r[1] == r[0]]
        step = load.planned_step(takes)
        ms = load.costs.step_ms(step) * self.slowdown
        time.sleep(ms / 1e3)
        self.cost.observe(step, ms, time.monotonic())
        out = []
        for slot in decoding:
            r = self.running[slot]
            r[2] += 1
            if r[2] >= r[3]:
                del self.running[slot]
                out.append(Emit(slot, r[2], Status.LENGTH))
            else:
                out.append(Emit(slot, r[2]))
        for slot, take in zip(waiting, takes, strict=True):
            r = self.running[slot]
            r[1] += take
            if r[1] == r[0]:
                r[2] = 1
                out.append(Emit(slot, 1))
        return out

    def cancel(self, slot: int) -> bool:
        self.running.pop(slot, None)
        return True

    def wake_in(self, now: float) -> float | None:
        return 0.0 if self.running else None

    def close(self) -> None:
        self.running.clear()

    def load(self) -> Load:
        self.cost.forget(time.monotonic())
        waiting = tuple(Prompt(r[1], r[0] - r[1]) for r in self.running.values() if r[1] < r[0])
        decoding = [r for r in self.running.values() if r[1] == r[0]]
        longest = max((r[0] + r[2] - 1 for r in decoding), default=0)
        return Load(self.cost.costs(), OPTIONS, len(decoding), longest, waiting, runs=1 if decoding else 0)


def test_a_starved_flood_that_never_backs_off_leaves_an_idle_server_that_admits_at_once(serve, new_agent) -> None:
    handler = Starved()
    server = serve(handler, slots=4, cap=256)
    agent: Agent = new_agent(frames=16, cap=256, max_wait=0.002)
    link = agent.attach(server.address)
    rng = random.Random(34)
    handler.slowdown = 15.0  # every step starved by a neighbour, for the whole flood
    counts = {"admitted": 0, "refused": 0, "cancelled": 0}
    flying: set[int] = set()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # a closed loop that never backs off: every refusal is sent again at once
        index = agent.acquire()
        if index is not None:
            write_request(
                agent.frames, index, list(range(1, rng.randint(40, 200))), request_id=index + 1, max_new_tokens=64
            )
            status = agent.submit(index)
            if status is None:
                counts["admitted"] += 1
                flying.add(index)
                if rng.random() < 0.5:  # the client goes away while its prompt waits (its frame comes back itself)
                    agent.abandon(index)
                    flying.discard(index)
                    counts["cancelled"] += 1
            else:
                assert status in (Status.OVER_BOUND, Status.NO_SLOT)
                counts["refused"] += 1
                agent.release(index)
        for delivery in agent.poll(timeout=0.0):
            if delivery.final and delivery.index in flying:
                flying.discard(delivery.index)
                agent.release(delivery.index)
    assert counts["refused"] > 10 * counts["admitted"] > 0 and counts["cancelled"] > 0, counts
    for index in list(flying):  # the clients that stayed go away too
        agent.abandon(index)
    quiet = time.monotonic() + 10.0
    while (server.running or handler.running) and time.monotonic() < quiet:
        agent.poll(timeout=0.05)
    assert not server.running and not handler.running  # idle: nothing running, nothing pending
    assert handler.cost.factor <= handler.cost.bounds[1]  # the starved steps moved it, within its bound
    handler.slowdown = 1.0
    time.sleep(agent.link_set.probe_interval)  # one heartbeat: the agent's view of the flood is that old now
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, list(range(1, 200)), request_id=9999, max_new_tokens=64)
    assert agent.submit(index) is None, link.load  # admitted at once: the first request after the flood
