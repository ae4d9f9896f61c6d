"""One agent attached to several slot servers: each claim tries them in order of their free-slot
hint (most free first), and the answer is 429 (NO_SLOT) only when every one of them is full."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from edgepath.dma.handlers import echo
from edgepath.dma.slot_server import SlotServer, SlotServerConfig
from edgepath.dma.transport import Transport
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.native.abi import Status

pytestmark = pytest.mark.transport

CAP = 16


@pytest.fixture
def servers(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> Iterator[Callable[[int], SlotServer]]:
    made: list[SlotServer] = []

    def make(slots: int) -> SlotServer:
        cfg = SlotServerConfig(slots=slots, input_capacity=CAP, output_capacity=CAP)
        server = SlotServer(new_transport(), new_address("slot-server"), echo, cfg)
        server.start_connection_manager()
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def test_claims_follow_the_free_slot_hint_and_429_only_when_all_are_full(
    new_transport: Callable[[], Transport], servers: Callable[[int], SlotServer]
) -> None:
    small, big = servers(1), servers(3)
    agent = Agent(new_transport(), frames=8, input_capacity=CAP, output_capacity=CAP, max_servers=2)
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
