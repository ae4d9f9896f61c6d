"""Data-path microbenchmarks on the loopback transport, 128-token requests.

Run: ``make bench`` (pytest-benchmark; JSON in out/bench.json, table in docs/PERFORMANCE.md).
In ``make test`` they run once each as smoke tests (benchmarking disabled).

- frame: validate a tokenized request and write its ids into the registered frame (the one write);
- claim: one remote CAS FREE -> CLAIMED through the agent's claim logic;
- write_doorbell: RDMA WRITE of header + 128 tokens, then the 8-byte doorbell WRITE_WITH_IMM;
- roundtrip: claim -> write -> doorbell -> spinning slot server (another process) runs echo ->
  result back in the frame -> agent sees it.  Its ``extra_info`` also records, from the
  CLOCK_MONOTONIC stamps in the headers, doorbell -> poller-sees-READY (t_ready - t_written).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from edgepath.contract.wire import SlotWord
from edgepath.dpu.agent import Agent, ServerLink
from edgepath.dpu.frame import write_request
from edgepath.native.abi import State
from edgepath.peer_secret import peer_keys
from edgepath.slots.handlers import echo
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.loopback import LoopbackTransport

TOKENS = 128
ROUNDS = 5000


@pytest.fixture
def local_pair(tmp_path) -> Iterator[tuple[Agent, ServerLink, SlotServer]]:
    """An agent attached to an in-process slot server that the benchmark drives by hand."""
    server = SlotServer(
        LoopbackTransport(peer_keys(None)),
        str(tmp_path / "s.sock"),
        echo,
        SlotServerConfig(slots=4, input_capacity=TOKENS, output_capacity=TOKENS),
    )
    server.start_connection_manager()
    agent = Agent(
        LoopbackTransport(peer_keys(None)),
        frames=4,
        input_capacity=TOKENS,
        output_capacity=TOKENS,
        max_servers=1,
        max_slots_per_server=4,
    )
    link = agent.attach(server.address)
    yield agent, link, server
    server.close()
    agent.transport.close()
    server.transport.close()


def _free_all(server: SlotServer, link: ServerLink) -> None:
    for slot in range(server.pool.slot_count):
        gen = server.pool.slot_word(slot).generation
        server.pool.states[slot] = SlotWord(gen, State.FREE, 0).pack()
        link.words[slot] = server.pool.states[slot]


def test_frame(benchmark, local_pair) -> None:
    agent, _, _ = local_pair
    ids = list(range(TOKENS))  # what a tokenizer returns: a Python list of ints

    def frame() -> int:
        return write_request(agent.frames, 0, ids, request_id=1, max_new_tokens=TOKENS)

    assert benchmark.pedantic(frame, rounds=ROUNDS, iterations=1) == TOKENS
    assert agent.frames.tokens[0, :TOKENS].tolist() == ids


def test_claim(benchmark, local_pair) -> None:
    agent, link, server = local_pair

    def setup() -> None:
        _free_all(server, link)

    result = benchmark.pedantic(agent.claims.claim, args=(link,), setup=setup, rounds=ROUNDS, iterations=1)
    assert result is not None


def test_write_doorbell(benchmark, local_pair) -> None:
    agent, link, server = local_pair
    write_request(agent.frames, 0, np.arange(TOKENS, dtype=np.int32), request_id=1, max_new_tokens=TOKENS)
    cq = server.transport.cq

    def setup() -> tuple[tuple, dict]:
        cq.poll(256)  # keep the server's completion queue from filling; nothing else runs
        return (link, 0, 0, 1, TOKENS), {}

    benchmark.pedantic(agent.claims.send, setup=setup, rounds=ROUNDS, iterations=1)
    agent.inflight.clear()
    assert link.conn.counters.bytes_written >= 64 + 4 * TOKENS + 8


@pytest.mark.parametrize("spin", [True, False], ids=["spin", "sleep"])
def test_roundtrip(benchmark, slot_server_process, spin: bool) -> None:
    spin_args = ["--spin-us", "1000000"] if spin else []
    address = slot_server_process(
        "--slots", "4", "--input-capacity", str(TOKENS), "--output-capacity", str(TOKENS), *spin_args
    )
    agent = Agent(
        LoopbackTransport(peer_keys(None)),
        frames=1,
        input_capacity=TOKENS,
        output_capacity=TOKENS,
        max_servers=1,
        max_slots_per_server=4,
    )
    agent.attach(address)
    tokens = np.arange(TOKENS, dtype=np.int32)
    write_request(agent.frames, 0, tokens, request_id=1, max_new_tokens=TOKENS)
    poll_spin = 0.01 if spin else 0.0
    detect: list[int] = []
    req, res = agent.frames.requests[0], agent.frames.results[0]

    def roundtrip() -> None:
        assert agent.submit(0) is None
        while not [d.index for d in agent.poll(timeout=1.0, spin=poll_spin) if d.final]:
            pass
        detect.append(int(res["t_ready_ns"]) - int(req["t_written_ns"]))

    benchmark.pedantic(roundtrip, rounds=ROUNDS if benchmark.enabled else 20, iterations=1, warmup_rounds=1)
    assert agent.frames.outputs[0, :TOKENS].tolist() == tokens.tolist()
    p50, p99 = np.percentile(np.array(detect) / 1000.0, [50, 99])
    benchmark.extra_info["doorbell_to_ready_us_p50"] = round(float(p50), 2)
    benchmark.extra_info["doorbell_to_ready_us_p99"] = round(float(p99), 2)
    agent.transport.close()
