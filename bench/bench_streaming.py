"""Return-path microbenchmarks on the loopback transport: streamed tokens and cancellation.

Run with ``make bench`` (pytest-benchmark; table in docs/PERFORMANCE.md).  The slot server runs in another
process with the paced echo (one token per ``token_delay``, the first at once), so the agent and the
server do not share a GIL; times come from the CLOCK_MONOTONIC stamps both processes write.

- first_token: claim -> write -> doorbell -> the handler's first token -> streamed back (WRITE of the
  token + progress word) -> the agent's delivery; ``extra_info`` has the return leg alone
  (handler produced the token -> agent delivered it, from ``t_first_ns``).
- cancel: with a request streaming, the agent writes the cancel word and rings it -> the slot server
  stops the handler and answers CANCELLED -> the agent delivers the final result.  ``extra_info``
  has the one-way leg: cancel posted -> handler told to stop (``t_done_ns`` is stamped right after
  the handler's ``cancel`` returns).  Target: one-way p50 <= 1 ms.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from edgepath.contract import wire
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.native.abi import Status, lib
from edgepath.peer_secret import peer_keys
from edgepath.transports.loopback import LoopbackTransport

TOKENS = 16
ROUNDS = 2000


@pytest.fixture
def streaming_agent(slot_server_process) -> Iterator[Agent]:
    address = slot_server_process(
        "--slots", "4", "--input-capacity", "64", "--output-capacity", "64",
        "--handler", "paced-echo", "--handler-option", "token_delay=0.5", "--stream-window-ms", "0",
    )  # fmt: skip
    agent = Agent(
        LoopbackTransport(peer_keys(None)),
        frames=4,
        input_capacity=64,
        output_capacity=64,
        max_servers=1,
        max_slots_per_server=4,
    )
    agent.attach(address)
    yield agent
    agent.transport.close()


def _start(agent: Agent) -> int:
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, np.arange(TOKENS), request_id=1, max_new_tokens=TOKENS, flags=wire.FLAG_STREAM)
    assert agent.submit(index) is None
    return index


def _until(agent: Agent, index: int, final: bool) -> int:
    """Poll until a delivery for ``index`` (the final one if ``final``); when it was delivered (ns)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        for d in agent.poll(timeout=0.0):
            if d.index == index and d.final >= final:
                return int(lib.ep_now_ns())
    raise AssertionError(f"no {'final ' if final else ''}delivery for frame {index} within 5 s")


def test_first_token(benchmark, streaming_agent: Agent) -> None:
    agent = streaming_agent
    legs: list[int] = []

    def first_token() -> None:
        index = _start(agent)
        seen = _until(agent, index, final=False)
        legs.append(seen - int(agent.frames.results[index]["t_first_ns"]))
        agent.cancel(index)
        _until(agent, index, final=True)
        agent.release(index)

    benchmark.pedantic(first_token, rounds=ROUNDS, iterations=1, warmup_rounds=20)
    legs_us = np.array(legs[-ROUNDS:]) / 1e3
    benchmark.extra_info["token_to_agent_us_p50"] = float(np.percentile(legs_us, 50))
    benchmark.extra_info["token_to_agent_us_p99"] = float(np.percentile(legs_us, 99))


def test_cancel(benchmark, streaming_agent: Agent) -> None:
    agent = streaming_agent
    legs: list[int] = []
    posted: list[int] = []

    def setup() -> tuple[tuple[int], dict[str, object]]:
        index = _start(agent)
        _until(agent, index, final=False)  # streaming: the handler has produced its first token
        return (index,), {}

    def cancel(index: int) -> None:
        posted.append(int(lib.ep_now_ns()))
        agent.cancel(index)
        _until(agent, index, final=True)
        result = agent.frames.results[index]
        assert int(result["status"]) == Status.CANCELLED
        legs.append(int(result["t_done_ns"]) - posted[-1])
        agent.release(index)

    benchmark.pedantic(cancel, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=20)
    legs_us = np.array(legs[-ROUNDS:]) / 1e3
    benchmark.extra_info["cancel_to_handler_us_p50"] = float(np.percentile(legs_us, 50))
    benchmark.extra_info["cancel_to_handler_us_p99"] = float(np.percentile(legs_us, 99))
