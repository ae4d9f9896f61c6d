"""End to end across processes: slot server, agent and driver (this test) each in its own process."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from helpers.procs import slot_states

from edgepath.dpu.agent_client import AgentClient
from edgepath.dpu.frame import write_request
from edgepath.native.abi import State, Status
from edgepath.peer_secret import peer_keys

pytestmark = [pytest.mark.transport, pytest.mark.slow]

REQUESTS = int(os.environ.get("EDGEPATH_E2E_REQUESTS", "10000"))
SLOTS, TOKENS, WINDOW = 8, 128, 24
#: how long a child may take to print its ready line: the soft-RoCE lane's first cold start of a process in its
#: emulated VM (TCG) on a busy host took over 30 s, ~10 s when the host was quiet
STARTUP_S = 120.0


def test_every_request_is_answered_exactly_once_and_every_slot_is_free_after(
    edgepath_process, new_address, transport_name, transport_options, transport_cli_args, tmp_path
) -> None:
    server_addr = new_address("slot-server")
    agent_addr = str(tmp_path / "agent.sock")  # edges reach the agent through shared memory
    edgepath_process(
        "slot-server",
        *transport_cli_args,
        "--listen",
        server_addr,
        "--slots",
        str(SLOTS),
        "--input-capacity",
        str(TOKENS),
        "--output-capacity",
        str(TOKENS),
        timeout=STARTUP_S,
    )
    edgepath_process(
        "agent",
        *transport_cli_args,
        "--slot-server",
        server_addr,
        "--listen",
        agent_addr,
        "--frames",
        "64",
        "--frames-per-edge",
        "32",
        "--input-capacity",
        str(TOKENS),
        "--output-capacity",
        str(TOKENS),
        timeout=STARTUP_S,
    )
    client = AgentClient(agent_addr, peer_keys(None))
    rng = np.random.default_rng(1)
    payload = rng.integers(0, 131_072, size=(REQUESTS, TOKENS), dtype=np.int32)
    answers = np.zeros(REQUESTS, dtype=np.int64)
    status_of = np.full(REQUESTS, -1)
    in_flight: dict[int, int] = {}
    sent = answered = mismatches = 0
    deadline = time.monotonic() + 300
    while answered < REQUESTS and time.monotonic() < deadline:
        while sent < REQUESTS and len(in_flight) < WINDOW and (index := client.acquire()) is not None:
            write_request(client.frames, index, payload[sent], request_id=sent, max_new_tokens=TOKENS)
            assert client.submit(index) is None
            in_flight[index] = sent
            sent += 1
        for index in [d.index for d in client.poll(timeout=2.0) if d.final]:
            rid = in_flight.pop(index)
            res = client.frames.results[index]
            answers[rid] += 1
            status_of[rid] = int(res["status"])
            if status_of[rid] == Status.OK:
                assert int(res["request_id"]) == rid
                n = int(res["output_count"])
                mismatches += not np.array_equal(client.frames.outputs[index, :n], payload[rid])
            answered += 1
            client.release(index)
    stats = client.delivery_stats
    client.close()
    assert answered == REQUESTS, f"only {answered} of {REQUESTS} answered"
    assert (stats.delivered, stats.duplicates, stats.unknown, stats.late) == (REQUESTS, 0, 0, 0), stats
    assert (answers == 1).all(), "a request was answered more than once"
    assert set(np.unique(status_of)) <= {Status.OK, Status.NO_SLOT}
    assert (status_of == Status.OK).sum() > 0
    assert mismatches == 0
    states = slot_states(server_addr, SLOTS, transport_name, transport_options)
    assert all(s == State.FREE for s in states), f"slots not FREE after the run: {states}"
