"""Streamed results and cancellation through the data path (agent <-> slot server over a transport, the
server's real loop on a thread): progress words, coalescing, the generation fence on cancels.  Abandon
and exactly-once accounting at the agent are in tests/dpu/test_agent.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers.datapath import collect, send, wait_free

from edgepath.contract import wire
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.dpu.port import Delivery
from edgepath.handlers import load_handler
from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, HandlerConfig, PacedEcho, SlotRequest

pytestmark = pytest.mark.transport

CAP = 64


@pytest.fixture
def agent(new_agent) -> Agent:
    return new_agent(frames=4, max_servers=1, max_slots_per_server=8)


def paced(delay: float) -> PacedEcho:
    return PacedEcho(delay)


def test_tokens_stream_back_as_they_are_produced(agent: Agent, serve) -> None:
    server = serve(paced(0.01), stream_window=0.0)
    agent.attach(server.address)
    tokens = list(range(100, 120))
    agent.frames.results[0]["t_first_ns"] = 1  # stale: left by an earlier use of the frame
    index = send(agent, tokens)
    first: list[Delivery] = []
    while not first:
        first = [d for d in agent.poll(timeout=5.0) if d.index == index]
    # the first-token time comes with the progress word, so it is this request's before its final result
    assert int(agent.frames.results[index]["t_first_ns"]) > 1 and not first[0].final
    got = first + collect(agent, index)
    assert got[-1].final and got[-1].count == 20
    progress = [d.count for d in got[:-1]]
    assert progress == sorted(progress) and len(set(progress)) == len(progress)  # strictly growing
    assert len(progress) >= 10  # one token per 10 ms with no coalescing window: many separate deliveries
    assert progress[0] >= 1
    result = agent.frames.results[index]
    assert int(result["status"]) == Status.OK and int(result["output_count"]) == 20
    assert agent.frames.outputs[index, :20].tolist() == tokens
    assert int(result["t_first_ns"]) >= int(result["t_start_ns"]) > 0
    agent.release(index)
    assert wait_free(server)


def test_a_coalescing_window_bounds_the_number_of_writes(agent: Agent, serve) -> None:
    server = serve(paced(0.001), stream_window=0.05)
    agent.attach(server.address)
    index = send(agent, list(range(40)))
    got = collect(agent, index)
    assert got[-1].final and got[-1].count == 40
    assert agent.frames.outputs[index, :40].tolist() == list(range(40))
    # the first token goes at once; the other 39 (about 40 ms of output) share a few windows of 50 ms
    assert 1 <= len(got) - 1 <= 4 and got[0].count == 1
    assert server.stats.progress_writes == len(got) - 1


def test_a_request_without_the_stream_flag_gets_only_its_final_result(agent: Agent, serve) -> None:
    server = serve(paced(0.001))
    agent.attach(server.address)
    index = send(agent, [5, 6, 7], stream=False)
    got = collect(agent, index)
    assert [(d.count, d.final) for d in got] == [(3, True)]
    assert server.stats.progress_writes == 0


def test_max_new_tokens_stops_the_stream_with_length(agent: Agent, serve) -> None:
    server = serve(paced(0.001))
    agent.attach(server.address)
    index = send(agent, list(range(30)), max_new=5)
    got = collect(agent, index)
    assert got[-1].count == 5 and int(agent.frames.results[index]["status"]) == Status.LENGTH


class Recording(PacedEcho):
    """Paced echo that records what it was asked to do (a test double of the model side)."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.sampling: list[wire.Sampling] = []
        self.cancelled: list[int] = []
        self.produced: dict[int, int] = {}

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        self.sampling.append(request.sampling)
        return super().add(request, now)

    def step(self, now: float) -> list[Emit]:
        emits = super().step(now)
        for e in emits:
            self.produced[e.slot] = e.count
        return emits

    def cancel(self, slot: int) -> bool:
        self.cancelled.append(slot)
        return super().cancel(slot)


def test_cancel_stops_the_handler_and_frees_the_slot(agent: Agent, serve) -> None:
    handler = Recording(0.02)
    server = serve(handler, stream_window=0.0)
    agent.attach(server.address)
    index = send(agent, list(range(50)))
    first = []
    deadline = time.monotonic() + 10
    while not first and time.monotonic() < deadline:
        first = agent.poll(timeout=0.5)
    assert first and not first[0].final
    agent.cancel(index)
    got = collect(agent, index)
    final = got[-1]
    assert final.final
    result = agent.frames.results[index]
    assert int(result["status"]) == Status.CANCELLED
    assert 1 <= final.count < 50 and int(result["output_count"]) == final.count
    assert handler.cancelled == [int(result["slot"])]
    produced = handler.produced[int(result["slot"])]
    time.sleep(0.1)  # five more token periods: a stopped handler produces nothing in them
    assert handler.produced[int(result["slot"])] == produced
    assert wait_free(server)
    assert server.stats.cancelled == 1


def test_a_cancel_for_someone_elses_slot_is_ignored(agent: Agent, serve, new_transport) -> None:
    server = serve(paced(0.02), stream_window=0.0)
    agent.attach(server.address)
    other = Agent(
        new_transport(), frames=2, input_capacity=CAP, output_capacity=CAP, max_servers=1, max_slots_per_server=8
    )
    other.attach(server.address)
    index = send(agent, list(range(10)))
    flight = agent.inflight[index]
    # the other agent forges a cancel for our slot, in our generation
    other.link_set.send_cancel(other.links[0], flight.slot, flight.generation)
    got = collect(agent, index)
    assert int(agent.frames.results[index]["status"]) == Status.OK and got[-1].count == 10
    assert server.stats.cancels_ignored == 1


def test_sampling_parameters_reach_the_model_side(agent: Agent, serve) -> None:
    handler = Recording(0.0)
    server = serve(handler)
    agent.attach(server.address)
    index = agent.acquire()
    assert index is not None
    sampling = wire.Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=12345)
    write_request(agent.frames, index, [1, 2, 3], request_id=1, max_new_tokens=3, sampling=sampling)
    assert agent.submit(index) is None
    collect(agent, index)
    (seen,) = handler.sampling
    assert seen.top_k == 40 and seen.seed == 12345
    assert seen.temperature == pytest.approx(0.7) and seen.top_p == pytest.approx(0.9)


def test_a_generator_handler_streams_what_it_yields(agent: Agent, serve) -> None:
    def countdown(request: SlotRequest) -> Iterator[int]:
        yield from range(int(request.tokens[0]), 0, -1)

    server = serve(countdown, stream_window=0.0)
    agent.attach(server.address)
    index = send(agent, [6])
    got = collect(agent, index)
    assert got[-1].count == 6 and agent.frames.outputs[index, :6].tolist() == [6, 5, 4, 3, 2, 1]
    assert len(got) > 1


def test_paced_echo_is_a_batch_handler_with_a_clear_option_error() -> None:
    handler = load_handler("paced-echo", HandlerConfig(1, 8, 8, {"token_delay": "0.5"}))
    tokens = np.arange(3, dtype=np.int32)
    out = np.zeros(3, dtype=np.int32)
    assert handler.add(SlotRequest(0, 1, 3, 0, tokens, out), now=10.0) == []
    assert handler.wake_in(10.0) == 0.0
    assert handler.step(10.0) == [Emit(0, 1)]
    assert handler.wake_in(10.1) == pytest.approx(0.4)
    assert handler.step(10.2) == []
    assert handler.step(11.0) == [Emit(0, 2)]
    assert handler.step(11.5) == [Emit(0, 3, Status.LENGTH)]
    assert out.tolist() == [0, 1, 2] and handler.wake_in(12.0) is None


class ReportsCached:
    """Three reports, one each time the test releases it: 1 token (nothing said about a cache), 2 tokens with 7
    prompt tokens taken from a cache, then the final result of 4 tokens."""

    STAGES = ((1, None, 0), (2, None, 7), (4, Status.OK, 7))

    def __init__(self) -> None:
        self.released = 0  # reports the test allowed (it only ever increments this)
        self.made = 0
        self.running: dict[int, tuple[SlotRequest, int]] = {}

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        self.running[request.slot] = (request, 0)
        return []

    def step(self, now: float) -> list[Emit]:
        out = []
        for slot, (request, stage) in list(self.running.items()):
            if self.made == self.released:
                continue
            self.made += 1
            count, status, cached = self.STAGES[stage]
            request.output[:count] = request.tokens[:count]
            if status is None:
                self.running[slot] = (request, stage + 1)
            else:
                del self.running[slot]
            out.append(Emit(slot, count, status, cached_tokens=cached))
        return out

    def cancel(self, slot: int) -> bool:
        self.running.pop(slot, None)
        return True

    def wake_in(self, now: float) -> float | None:
        if not self.running:
            return None
        return 0.0 if self.made < self.released else 0.001  # the slot server steps a handler when it is due

    def close(self) -> None:
        self.running.clear()


def test_cached_prompt_tokens_come_with_progress_and_the_result(agent: Agent, serve) -> None:
    handler = ReportsCached()
    server = serve(handler, stream_window=0.0)
    agent.attach(server.address)
    agent.frames.results[0]["cached_tokens"] = 99  # stale: left by an earlier use of the frame
    index = send(agent, list(range(100, 110)))

    def next_delivery() -> Delivery:
        handler.released += 1
        got: list[Delivery] = []
        while not got:
            got = [d for d in agent.poll(timeout=5.0) if d.index == index]
        return got[-1]

    first = next_delivery()
    assert (first.count, first.final) == (1, False)
    assert int(agent.frames.results[index]["cached_tokens"]) == 0  # reset when the slot started
    second = next_delivery()
    assert (second.count, second.final) == (2, False)
    assert int(agent.frames.results[index]["cached_tokens"]) == 7  # placed with the progress word
    final = next_delivery()
    assert final.final and final.count == 4 and int(agent.frames.results[index]["cached_tokens"]) == 7
    agent.release(index)
    assert wait_free(server)
