"""Claimers that vanish or stall after CLAIMED: the slot comes back, late doorbells are ignored."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from helpers.procs import start_claimer

from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.native.abi import State, Status
from edgepath.slots.handlers import echo
from edgepath.slots.server import SlotServer, SlotServerConfig

pytestmark = [pytest.mark.transport, pytest.mark.slow]


@pytest.fixture
def server(new_transport, new_address) -> Iterator[SlotServer]:
    srv = SlotServer(
        new_transport(),
        new_address("slot-server"),
        echo,
        SlotServerConfig(slots=1, input_capacity=16, output_capacity=16, lease=0.3, scan_interval=0.02),
    )
    worker = threading.Thread(target=srv.serve, daemon=True)
    worker.start()
    yield srv
    srv.close()
    worker.join(timeout=5)


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return False


def _claimer(server: SlotServer, transport_name: str, options: dict) -> tuple[object, dict]:
    proc = start_claimer(
        "stale",
        {"transport": transport_name, "options": options, "address": server.address, "tokens": 16, "wait": 1.0},
        stdin=True,
    )
    claim = json.loads(proc.stdout.readline())
    assert server.pool.slot_word(claim["slot"]).state == State.CLAIMED
    return proc, claim


def test_a_stalled_writer_loses_its_slot_at_lease_end_and_its_late_doorbell_is_ignored(
    server: SlotServer, new_transport, transport_name, transport_options
) -> None:
    proc, claim = _claimer(server, transport_name, transport_options)
    assert _wait_for(lambda: server.pool.slot_word(0).state == State.FREE), "lease never expired"
    assert server.stats.expired_leases == 1
    # The slot serves someone else in a newer generation.
    agent = Agent(
        new_transport(), frames=1, input_capacity=16, output_capacity=16, max_servers=1, max_slots_per_server=1
    )
    agent.attach(server.address)
    write_request(agent.frames, 0, [1, 2, 3, 4], request_id=9, max_new_tokens=4)
    assert agent.submit(0) is None
    assert [d.index for d in agent.poll(timeout=5.0) if d.final] == [0]
    assert agent.frames.outputs[0, :4].tolist() == [1, 2, 3, 4]
    assert int(agent.frames.results[0]["generation"]) == claim["generation"] + 1
    # Now the stale writer wakes up, writes and rings: ignored, unanswered, nothing stuck.
    proc.stdin.write("ring\n")
    proc.stdin.flush()
    late = json.loads(proc.stdout.readline())
    proc.wait(timeout=10)
    assert late == {"rang": True, "answered": []}
    assert server.stats.rejected_doorbells == 1
    assert server.pool.slot_word(0).state == State.FREE
    agent.release(0)
    write_request(agent.frames, 0, [7], request_id=10, max_new_tokens=1)
    assert agent.submit(0) is None
    assert [d.index for d in agent.poll(timeout=5.0) if d.final] == [0]
    assert int(agent.frames.results[0]["status"]) == Status.OK


def test_a_killed_claimer_frees_its_slot_without_waiting_for_the_lease(
    server: SlotServer, transport_name, transport_options
) -> None:
    server.pool.header["lease_ns"] = int(600e9)  # so only the disconnect can free it within the test
    proc, _ = _claimer(server, transport_name, transport_options)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert _wait_for(lambda: server.pool.slot_word(0).state == State.FREE), "slot of a dead claimer stuck"
    _wait_for(lambda: server.stats.expired_leases > 0)  # counted at the lease scan after the reclaim
    assert server.stats.expired_leases == 1
