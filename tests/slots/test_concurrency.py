"""Several claimers in separate processes racing on a small pool never double-claim a slot."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers.procs import result_of, start_claimer

from edgepath.contract.wire import SlotWord
from edgepath.native.abi import State
from edgepath.slots.handlers import echo
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.base import Access

pytestmark = [pytest.mark.transport, pytest.mark.slow]

CLAIMERS = 3


def test_remote_cas_gives_mutual_exclusion_across_processes(
    new_transport, new_address, transport_name, transport_options
) -> None:
    slots = 2
    owners_offset = 64
    host = new_transport()
    pool = host.register("pool", 4096, Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)
    address = new_address("pool")
    listener = host.listen(address, [pool], {})
    conns = []
    acceptor = threading.Thread(target=lambda: conns.extend(listener.accept(timeout=30) for _ in range(CLAIMERS)))
    acceptor.start()
    start_at = time.time() + 3.0  # past every claimer's interpreter start-up, so they really race
    procs = [
        start_claimer(
            "cas",
            {
                "transport": transport_name,
                "options": transport_options,
                "address": address,
                "claimant": k + 1,
                "slots": slots,
                "owners_offset": owners_offset,
                "iterations": 10000,
                "seconds": 60,
                "start_at": start_at,
            },
        )
        for k in range(CLAIMERS)
    ]
    results = [result_of(p, timeout=120) for p in procs]
    acceptor.join()
    listener.close()
    assert sum(r["violations"] for r in results) == 0, results
    assert all(r["wins"] > 0 for r in results), results
    assert sum(r["attempts"] for r in results) > sum(r["wins"] for r in results), "claimers never collided"
    words = pool.buf[: 8 * slots].view(np.uint64)
    assert ((words & 0xFF) == 0).all()
    assert int((words >> 32).sum()) == sum(r["wins"] for r in results)  # one generation per claim


def test_agents_racing_on_a_two_slot_pool_never_mix_up_requests(
    new_transport, new_address, transport_name, transport_options
) -> None:
    server = SlotServer(
        new_transport(),
        new_address("slot-server"),
        echo,
        SlotServerConfig(slots=2, input_capacity=32, output_capacity=32),
    )
    worker = threading.Thread(target=server.serve, daemon=True)
    worker.start()
    try:
        procs = [
            start_claimer(
                "agent",
                {
                    "transport": transport_name,
                    "options": transport_options,
                    "address": server.address,
                    "claimant": k + 1,
                    "requests": 1500,
                    "tokens": 32,
                    "window": 4,
                    "seconds": 90,
                },
            )
            for k in range(CLAIMERS)
        ]
        results = [result_of(p, timeout=150) for p in procs]
        # Every slot returns to FREE while the server still runs: a claim the agents left unrung when they
        # exited is reclaimed through their disconnect or at lease end (bounded wait on the state, 10 s).
        deadline = time.monotonic() + 10
        while server.pool.free_count() != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        words = [SlotWord.unpack(int(w)) for w in server.pool.states]
    finally:
        server.close()
        worker.join(timeout=5)
    for r in results:
        assert r["answered"] == 1500, results
        assert r["mismatch"] == 0 and r["other"] == 0, results
        assert r["ok"] > 0, results
    assert server.stats.served == sum(r["ok"] for r in results)
    assert all(w.state == State.FREE for w in words), (words, server.stats)
