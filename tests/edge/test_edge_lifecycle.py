"""The edge lifecycle driven by hand: no event loop, no thread, no agent, no network.

Events go in with an explicit ``now``; the actions that come out are checked.  The agent port is
an in-memory double that keeps the AgentPort contract strictly (a frame is released only when it is
held and not in flight, abandoned only when in flight) and lets a test play the slot server's part:
write output into a frame's reply entry and hand out deliveries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from helpers.tokenizers import CharTokenizer, CharVocabulary
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.contract import wire
from edgepath.contract.pool import AgentFrames, FrameLayout
from edgepath.dpu.link_state import LinkHealth, LinkState, LinkTracker, Reason
from edgepath.dpu.port import Delivery, DeliveryStats, SlotServerStatus
from edgepath.edge.apis.generate import GenerateFormatter
from edgepath.edge.apis.limits import MESSAGE_CHARS
from edgepath.edge.apis.llama_utils import LlamaUtilRoutes
from edgepath.edge.http import HttpError, Limits, Outcome, Request, Response
from edgepath.edge.lifecycle import (
    Action,
    EdgeLifecycle,
    EndStream,
    Respond,
    SendChunk,
    StartStream,
    Tokenize,
)
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.routes import HttpCore
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.text.tokenizer import INLINE_CHARS
from edgepath.edge.tokenizing import chat_size
from edgepath.native.abi import Status

INPUT, OUTPUT = 64, 64
SECOND = 1_000_000_000
TIMEOUT = 5 * SECOND


class FakePort:
    """An AgentPort double over real frame memory; the test plays the slot server."""

    def __init__(self, frames: int = 4) -> None:
        self.layout = FrameLayout(INPUT, OUTPUT)
        req_bytes, rep_bytes = AgentFrames.sizes(frames, self.layout)
        self.frames = AgentFrames(np.zeros(req_bytes, np.uint8), np.zeros(rep_bytes, np.uint8), frames, self.layout)
        self.delivery_stats = DeliveryStats()
        self.free = list(range(frames))
        self.held: set[int] = set()
        self.in_flight: set[int] = set()
        self.abandoned: list[int] = []
        self.submitted: list[int] = []
        self.refuse_with: Status | None = None
        self.unclaimable = False  # early_refusal's answer: no slot for any prompt now
        self.asked: list[tuple[int, int, int]] = []  # early_refusal's (tenant, floor, slots), in order
        self.lost: list[int] = []
        self.stall: list[int] = []  # frames whose slot server the test has made unresponsive
        self.state = LinkState.UP
        self.revived = 0
        self.listing: list[SlotServerStatus] = []

    @property
    def up(self) -> bool:
        return self.state is LinkState.UP

    @up.setter
    def up(self, up: bool) -> None:
        self.state = LinkState.UP if up else LinkState.DOWN

    def fileno(self) -> int:
        raise AssertionError("the lifecycle never waits on the port")

    def arm(self) -> bool:
        raise AssertionError("the lifecycle never waits on the port")

    def acquire(self) -> int | None:
        if not self.free:
            return None
        index = self.free.pop(0)
        self.held.add(index)
        return index

    def early_refusal(self, index: int, tenant: int, floor: int, slots: int = 1) -> Status | None:
        assert index in self.held and index not in self.in_flight, f"early_refusal of frame {index} not held"
        self.asked.append((tenant, floor, slots))
        if not self.unclaimable:
            return None
        self.frames.result_headers[index].no_slot(1500.0)
        return Status.NO_SLOT

    def submit(self, index: int) -> Status | None:
        assert index in self.held and index not in self.in_flight, f"submit of frame {index} not held"
        if self.refuse_with is not None:
            return self.refuse_with
        self.frames.requests[index]["t_written_ns"] = 1
        self.in_flight.add(index)
        self.submitted.append(index)
        return None

    def poll(self) -> list[Delivery]:
        raise AssertionError("the driver polls, not the lifecycle")

    def cancel(self, index: int) -> None:
        raise AssertionError("not used by the edge lifecycle")

    def abandon(self, index: int) -> None:
        assert index in self.in_flight, f"abandon of frame {index} not in flight"
        self.in_flight.discard(index)
        self.held.discard(index)
        self.abandoned.append(index)
        self.delivery_stats.abandoned += 1
        self.free.append(index)  # the real port waits for the slot server to let go; same outcome here

    def release(self, index: int) -> None:
        assert index in self.held and index not in self.in_flight, f"release of frame {index} in flight or not held"
        self.held.discard(index)
        self.free.append(index)

    def check_links(self) -> list[int]:
        lost, self.lost = self.lost, []
        for index in lost:
            self.in_flight.discard(index)
        return lost

    def revive(self) -> None:
        if not self.up:
            self.revived += 1

    def stalled(self) -> list[int]:
        stalled, self.stall = self.stall, []
        return stalled

    def links_health(self) -> list[LinkHealth]:
        reason = {LinkState.UP: Reason.NONE, LinkState.UNRESPONSIVE: Reason.NO_HEARTBEAT}.get(self.state)
        return [LinkHealth("pool", self.state, reason or Reason.DISCONNECTED, 0.0, 0.0, 3.0)]

    def alive(self) -> bool:
        return self.state is not LinkState.DOWN

    def free_slots(self) -> tuple[int, int]:
        return 3, 8

    def servers(self) -> list[SlotServerStatus]:
        return self.listing or [SlotServerStatus(health, 3, 8, 0, 0) for health in self.links_health()]

    # -- the slot server's part ------------------------------------------------------------------
    def produce(self, index: int, tokens: list[int]) -> Delivery:
        """Append output tokens to frame ``index`` (as streamed WRITEs would) and say so."""
        assert index in self.in_flight
        result = self.frames.results[index]
        count = int(result["output_count"])
        self.frames.outputs[index, count : count + len(tokens)] = tokens
        result["output_count"] = count + len(tokens)
        return Delivery(index, count + len(tokens), False)

    def finish(self, index: int, status: Status = Status.OK, t_first_ns: int = 0) -> Delivery:
        assert index in self.in_flight
        result = self.frames.results[index]
        result["status"] = int(status)
        result["t_ready_ns"] = int(self.frames.requests[index]["t_receive_ns"]) + 1000
        result["t_first_ns"] = t_first_ns
        self.in_flight.discard(index)
        self.delivery_stats.delivered += 1
        return Delivery(index, int(result["output_count"]), True)


class Clock:
    """A fake monotonic clock: every read advances it by one microsecond."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        self.ns += 1000
        return self.ns


@pytest.fixture
def port() -> FakePort:
    return FakePort()


@pytest.fixture
def tokenizer() -> CharTokenizer:
    return CharTokenizer()


def lifecycle(port: FakePort, tokenizer: CharTokenizer, workers: int = 2, keys: ApiKeys | None = None) -> EdgeLifecycle:
    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, tokenizer.vocab_size), keys)
    return EdgeLifecycle(core, tokenizer, port, metrics, Clock(), workers=workers, request_timeout_ns=TIMEOUT)


def generate(now: int = 0, key: str | None = None, **fields: object) -> Request:
    body = json.dumps({"prompt": "hello", **fields}).encode()
    headers = [] if key is None else [(b"x-api-key", key.encode())]
    return Request("POST", "/v1/generate", headers, body, t_receive_ns=now)


def only(actions: list[Action], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def body(action: Action) -> dict:
    assert isinstance(action, Respond), action
    return json.loads(action.response.body)


def sse(data: bytes) -> Iterator[tuple[str, dict]]:
    """(event name, data document) of each server-sent event in ``data``."""
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        yield lines.get("event", "message"), json.loads(lines["data"])


def test_a_generate_request_is_written_into_its_frame_and_answered_from_the_final_delivery(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    assert edge.receive(1, generate(max_tokens=3), now=100) == []  # in flight: nothing to send yet
    (frame,) = port.submitted
    req = port.frames.requests[frame]
    assert int(req["token_count"]) == 5 and int(req["max_new_tokens"]) == 3
    assert int(req["flags"]) == 0  # not streamed
    assert tokenizer.decode(port.frames.tokens[frame, :5]) == "hello"
    port.produce(frame, [104, 105, 33, 33])  # a handler that wrote more than max_tokens
    (action,) = edge.deliveries([port.finish(frame)], now=200)
    doc = body(action)
    assert action.rid == 1 and action.response.status == 200
    assert doc["tokens"] == [104, 105, 33] and doc["text"] == "hi!"  # cut at max_tokens
    assert (doc["input_count"], doc["output_count"]) == (5, 3)
    assert dict(action.response.headers)[b"server-timing"].startswith(b"queue;dur=")
    assert port.held == set() and edge.tracked == {} and edge.by_frame == {}


class TakingBack(FakePort):
    """A port whose agent takes a slot back for each request (docs/TENANTS.md): submit returns at once, and the
    request is sent -- its header stamped -- only at the hand-over, which the test plays."""

    def submit(self, index: int) -> Status | None:
        stamp = int(self.frames.requests[index]["t_written_ns"])
        self.in_flight.add(index)
        self.submitted.append(index)
        assert stamp == 0  # the edge cleared it: nothing sent yet
        return None


def test_a_request_that_takes_a_slot_back_times_its_claim_to_the_hand_over(tokenizer) -> None:
    """Not the frame's previous request's stamp: the claim runs from the submit to the hand-over, and the doorbell
    is not timed (the agent rings it with the request it sends at the hand-over)."""
    port = TakingBack()
    port.frames.requests[0]["t_written_ns"] = 17  # a stamp left by the frame's earlier use
    edge = lifecycle(port, tokenizer)
    edge.receive(7, generate(now=1000, stream=True), now=1000)
    (frame,) = port.submitted
    submitted = edge.tracked[7].handover_from
    assert submitted > 0
    port.frames.requests[frame]["t_written_ns"] = submitted + 250_000  # handed over 0.25 ms later: sent
    start, _ = edge.deliveries([port.produce(frame, [10])], now=900_000)
    timing = dict(part.split(";dur=") for part in dict(start.headers)[b"server-timing"].decode().split(", "))
    assert timing["claim"] == "0.250" and "doorbell" not in timing


def test_a_moved_stream_reports_the_cached_tokens_of_its_first_placement(port, tokenizer) -> None:
    """A stream that moved (its slot taken back, its server gone) was sent again with its answer so far after its
    prompt, and that placement's cached count is over both -- its own KV reused, more than its prompt.  Its usage
    says its first placement's count.  (Before, OpenAI's usage refused a count over the prompt: the moved answer
    never ended, and the other answers of the same batch of deliveries were lost with it; bench tenants found it.)"""
    from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes, formatter_factory
    from edgepath.edge.http import COMPLETIONS
    from edgepath.edge.lifecycle import DEFAULT_FORMATTERS

    routes = OpenAIRoutes("m", OUTPUT, tokenizer.vocab_size, ChatSupport(False, "none"), 0)
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, tokenizer.vocab_size), None, routes)
    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
    formatters = {**DEFAULT_FORMATTERS, COMPLETIONS: formatter_factory(lambda: 0.0)}
    edge = EdgeLifecycle(core, tokenizer, port, metrics, Clock(), workers=1, request_timeout_ns=TIMEOUT,
                         formatters=formatters)  # fmt: skip
    doc = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    edge.receive(1, Request("POST", COMPLETIONS, [], json.dumps(doc).encode(), t_receive_ns=0), now=0)
    (frame,) = port.submitted
    port.frames.results[frame]["cached_tokens"] = 2
    edge.deliveries([port.produce(frame, [104, 105])], now=10)
    port.frames.requests[frame]["migrations"] = 1  # moved: sent again as "hello" + "hi", 6 of those 7 reused
    port.frames.results[frame]["cached_tokens"] = 6
    port.produce(frame, [33])
    end = edge.deliveries([port.finish(frame, Status.STOP)], now=20)[-1]
    assert isinstance(end, EndStream)
    (usage,) = [event["usage"] for _, event in sse(end.data.replace(b"data: [DONE]\n\n", b"")) if event.get("usage")]
    assert usage["prompt_tokens"] == 5 and usage["completion_tokens"] == 3
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2}


class EndRaises(GenerateFormatter):
    """A route whose answer cannot be shaped at its end (an edge bug)."""

    def end(self, outcome: Outcome) -> bytes:
        raise ValueError("cannot shape this answer")


def test_an_answer_that_raises_loses_no_other_answer_of_its_batch(port, tokenizer) -> None:
    made: list[GenerateFormatter] = []

    def formatter(work: object, tok: CharTokenizer) -> GenerateFormatter:
        made.append((EndRaises if not made else GenerateFormatter)(tok.decode))
        return made[-1]

    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, tokenizer.vocab_size))
    edge = EdgeLifecycle(core, tokenizer, port, metrics, Clock(), workers=2, request_timeout_ns=TIMEOUT,
                         formatters={"/v1/generate": formatter})  # fmt: skip
    edge.receive(1, generate(stream=True), now=0)
    edge.receive(2, generate(stream=True), now=0)
    first, second = port.submitted
    edge.deliveries([port.produce(first, [10]), port.produce(second, [11])], now=10)
    port.produce(first, [12])
    port.produce(second, [13])
    actions = edge.deliveries([port.finish(first), port.finish(second)], now=20)  # the first one's end raises
    (end,) = actions
    assert isinstance(end, EndStream) and end.rid == 2 and ("message", {"token": 13}) in list(sse(end.data))
    assert edge.broken == 1


def test_a_streamed_request_starts_at_its_first_output_and_sends_only_the_new_tokens(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(7, generate(now=1000, stream=True), now=1000)
    (frame,) = port.submitted
    assert int(port.frames.requests[frame]["flags"]) == wire.FLAG_STREAM
    first = edge.deliveries([port.produce(frame, [10, 11])], now=5000)
    assert [type(a) for a in first] == [StartStream, SendChunk]
    start, chunk = first
    assert start.status == 200 and (b"content-type", b"text/event-stream") in start.headers
    assert b"first_token;dur=0.004" in dict(start.headers)[b"server-timing"]  # when the first tokens left
    assert list(sse(chunk.data)) == [("message", {"token": 10}), ("message", {"token": 11})]
    assert edge.deliveries([Delivery(frame, 2, False)], now=6000) == []  # nothing new: nothing sent
    (second,) = edge.deliveries([port.produce(frame, [12])], now=7000)
    assert list(sse(second.data)) == [("message", {"token": 12})]
    port.produce(frame, [13])  # arrives together with the final result
    (end,) = edge.deliveries([port.finish(frame)], now=9000)
    assert isinstance(end, EndStream) and end.rid == 7
    events = list(sse(end.data))
    assert events[0] == ("message", {"token": 13})
    name, done = events[1]
    assert name == "done" and done["output_count"] == 4 and done["text"] == "".join(map(chr, [10, 11, 12, 13]))
    assert done["first_token_ms"] == 0.004  # receive at 1000 ns, first tokens seen at 5000 ns
    assert port.held == set() and edge.tracked == {}


def test_time_to_first_token_and_inter_token_latency_reach_the_metrics(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(1, generate(stream=True), now=0)
    (frame,) = port.submitted
    edge.deliveries([port.produce(frame, [1])], now=2 * SECOND // 1000)
    edge.deliveries([port.produce(frame, [2, 3])], now=6 * SECOND // 1000)
    edge.deliveries([port.finish(frame)], now=7 * SECOND // 1000)
    text = edge.metrics.exposition().decode()
    assert "edgepath_time_to_first_token_seconds_count 1.0" in text
    assert 'edgepath_time_to_first_token_seconds_bucket{le="0.0025"} 1.0' in text
    assert "edgepath_inter_token_latency_seconds_count 2.0" in text  # 2 tokens, 4 ms apart -> 2 ms each
    assert 'edgepath_inter_token_latency_seconds_bucket{le="0.001"} 0.0' in text
    assert 'edgepath_inter_token_latency_seconds_bucket{le="0.0025"} 2.0' in text


def test_cached_prompt_tokens_reach_the_answer_and_the_metrics(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    for rid, cached in ((1, 4), (2, 0)):
        edge.receive(rid, generate(), now=100)
        frame = port.submitted[-1]
        port.produce(frame, [104])
        port.frames.results[frame]["cached_tokens"] = cached  # the slot server's count, in the result header
        (action,) = edge.deliveries([port.finish(frame)], now=200)
        assert body(action)["cached_tokens"] == cached
    text = edge.metrics.exposition().decode()
    assert 'edgepath_prefix_cache_requests_total{result="hit"} 1.0' in text
    assert 'edgepath_prefix_cache_requests_total{result="miss"} 1.0' in text
    assert "edgepath_prefix_cache_tokens_total 4.0" in text
    assert "edgepath_prompt_tokens_total 10.0" in text


def test_non_streamed_answers_carry_the_first_token_time_in_server_timing(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(1, generate(now=1000), now=1000)
    (frame,) = port.submitted
    port.produce(frame, [5])
    (action,) = edge.deliveries([port.finish(frame, t_first_ns=3_001_000)], now=9_000_000)
    assert b"first_token;dur=3.000" in dict(action.response.headers)[b"server-timing"]


def test_no_free_frame_is_429_before_tokenizing(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    for rid in range(4):
        assert edge.receive(rid, generate(), now=0) == []
    (refused,) = edge.receive(9, generate(), now=0)
    assert refused.response.status == 429 and (b"retry-after", b"1") in refused.response.headers
    assert tokenizer.calls == 4


def test_a_burst_of_large_prompts_gets_the_free_workers_and_429_for_the_rest(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer, workers=3)  # one tenant's share: all workers but one
    big = "x" * (INLINE_CHARS + 1)
    actions = [a for rid in range(4) for a in edge.receive(rid, generate(prompt=big), now=0)]
    work = only(actions, Tokenize)
    refused = only(actions, Respond)
    assert [w.rid for w in work] == [0, 1] and all(w.out is not None for w in work)
    assert [body(r)["error"]["type"] for r in refused] == ["tokenizer_busy", "tokenizer_busy"]
    assert all(r.response.status == 429 for r in refused)
    assert len(port.held) == 2  # the refused ones hold no frame: nothing waits in line
    assert tokenizer.calls == 0  # the lifecycle never tokenizes a large prompt on the caller's thread
    # a worker finishes (here: a prompt too long for the slot): its frame comes back, a worker is free again
    n = tokenizer.encode_into(big, work[0].out)
    (too_long,) = edge.tokenized(0, n, now=10)
    assert too_long.response.status == 400 and port.submitted == [] and len(port.held) == 1
    (again,) = edge.receive(5, generate(prompt=big), now=20)
    assert isinstance(again, Tokenize) and again.rid == 5


def test_one_tenants_large_prompts_leave_a_worker_to_the_others(port, tokenizer) -> None:
    """A tenant holds at most its share of the workers (all but one): its further large prompts are 429 while
    another tenant's still find a worker -- it waits behind its own requests, never behind another's."""
    edge = lifecycle(port, tokenizer, workers=2, keys=ApiKeys(["a", "b"]))
    big = "x" * (INLINE_CHARS + 1)
    (first,) = edge.receive(1, generate(prompt=big, key="a"), now=0)
    (second,) = edge.receive(2, generate(prompt=big, key="a"), now=0)
    assert isinstance(first, Tokenize) and body(second)["error"]["type"] == "tokenizer_busy"
    (other,) = edge.receive(3, generate(prompt=big, key="b"), now=0)
    assert isinstance(other, Tokenize)
    (third,) = edge.receive(4, generate(prompt=big, key="b"), now=0)
    assert body(third)["error"]["type"] == "tokenizer_busy"  # every worker busy now
    edge.tokenized(1, tokenizer.encode_into(big, first.out), now=1)  # a's worker is back: a may use one again
    (again,) = edge.receive(5, generate(prompt=big, key="a"), now=2)
    assert isinstance(again, Tokenize)


def test_a_chats_messages_count_towards_the_work_that_leaves_the_event_loop() -> None:
    """30,000 empty messages held the loop 2.9 s when only their contents were counted: each message now costs its
    template MESSAGE_CHARS, so a chat of many short messages is templated on a worker."""
    few = [{"role": "user", "content": ""}] * (INLINE_CHARS // MESSAGE_CHARS)
    assert chat_size(few, None) <= INLINE_CHARS < chat_size([*few, {"role": "user", "content": ""}], None)


def test_large_prompt_tokenized_on_a_worker_is_submitted(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer, workers=1)
    big = "y" * (INLINE_CHARS + 1)
    (work,) = edge.receive(1, generate(prompt=big), now=0)
    assert isinstance(work, Tokenize)
    work.out[:3] = [1, 2, 3]  # a worker wrote 3 ids (a tokenizer that compresses well)
    assert edge.tokenized(1, 3, now=50) == []
    (frame,) = port.submitted
    assert int(port.frames.requests[frame]["token_count"]) == 3
    assert port.frames.tokens[frame, :3].tolist() == [1, 2, 3]


def test_a_deadline_answers_504_and_abandons_the_frame(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(1, generate(), now=0)
    (frame,) = port.submitted
    assert edge.tick(now=TIMEOUT) == []  # not yet past
    (action,) = edge.tick(now=TIMEOUT + 1)
    assert action.response.status == 504 and body(action)["error"]["type"] == "timeout"
    assert port.abandoned == [frame] and edge.tracked == {} and edge.by_frame == {}
    assert edge.tick(now=2 * TIMEOUT) == []  # answered once


def test_a_stream_that_keeps_producing_is_not_timed_out_and_one_that_stalls_ends_with_an_error_event(
    port, tokenizer
) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(1, generate(stream=True), now=0)
    (frame,) = port.submitted
    edge.deliveries([port.produce(frame, [1])], now=TIMEOUT - 1)
    assert edge.tick(now=TIMEOUT + 1) == []
    (end,) = edge.tick(now=2 * TIMEOUT)
    assert isinstance(end, EndStream)
    assert list(sse(end.data)) == [
        ("error", {"error": {"type": "timeout", "message": "no result from the slot server in time"}})
    ]
    assert port.abandoned == [frame]


def test_a_client_gone_in_flight_abandons_its_frame_and_gets_nothing(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(1, generate(stream=True), now=0)
    (frame,) = port.submitted
    edge.deliveries([port.produce(frame, [1])], now=10)
    assert edge.client_gone(1, now=20) == []
    assert port.abandoned == [frame] and edge.tracked == {}
    assert edge.client_gone(1, now=30) == []  # a second notice changes nothing
    assert edge.tick(now=2 * TIMEOUT) == []
    assert "edgepath_streams_reset_total 1.0" in edge.metrics.exposition().decode()


def test_a_client_gone_while_a_worker_writes_into_the_frame_releases_it_after_the_worker(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer, workers=1)
    (work,) = edge.receive(1, generate(prompt="z" * (INLINE_CHARS + 1)), now=0)
    assert isinstance(work, Tokenize)
    assert edge.client_gone(1, now=5) == []
    assert len(port.held) == 1  # the worker may still be writing into it
    assert edge.tokenized(1, 3, now=10) == []
    assert port.held == set() and port.submitted == [] and edge.tracked == {}
    assert edge.tokenizing.busy == 0


def test_frames_lost_with_the_slot_server_are_503_and_a_dead_server_is_revived(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(1, generate(), now=0)
    (frame,) = port.submitted
    port.lost = [frame]
    port.up = False
    (action,) = edge.tick(now=10)
    assert action.response.status == 503 and port.revived == 1
    assert port.held == set() and edge.tracked == {}


def test_frames_on_a_slot_server_that_became_unresponsive_end_504_at_once_and_stay_fenced(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(1, generate(), now=0)
    edge.receive(2, generate(stream=True), now=0)
    whole, streamed = port.submitted
    edge.deliveries([port.produce(streamed, [1])], now=10)
    port.state = LinkState.UNRESPONSIVE
    port.stall = [whole, streamed]
    whole_end, stream_end = edge.tick(now=4 * SECOND)  # long before the request timeout
    assert whole_end.response.status == 504
    assert body(whole_end)["error"] == {
        "type": "unresponsive",
        "message": "no result: slot server pool: no heartbeat for 4.0 s (hang timeout 3 s)",
    }
    assert isinstance(stream_end, EndStream)
    assert [event for event, _ in sse(stream_end.data)] == ["error"]
    assert port.abandoned == [whole, streamed]  # fenced by the port until the server lets go
    assert edge.tracked == {} and edge.tick(now=2 * TIMEOUT) == []


def test_health_names_an_unresponsive_slot_server_and_the_probes_split_live_from_ready(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    probes = {path: Request("GET", path, [], b"", 0) for path in ("/health", "/health/live", "/health/ready")}
    answers = {path: edge.receive(i, request, now=0)[0].response for i, (path, request) in enumerate(probes.items())}
    assert {path: (r.status, json.loads(r.body)["status"]) for path, r in answers.items()} == {
        "/health": (200, "ok"),
        "/health/live": (200, "ok"),
        "/health/ready": (200, "ok"),
    }
    port.state = LinkState.UNRESPONSIVE
    answers = {
        path: edge.receive(i, request, now=5 * SECOND)[0].response for i, (path, request) in enumerate(probes.items())
    }
    reason = "slot server pool: no heartbeat for 5.0 s (hang timeout 3 s)"
    assert json.loads(answers["/health"].body) == {
        "status": "unresponsive",
        "free_slots": 3,
        "total_slots": 8,
        "reason": reason,
        "slot_servers": [
            {"address": "pool", "state": "unresponsive", "link": "up", "reason": reason.split(": ", 1)[1],
             "for_s": 5.0, "free_slots": 3, "total_slots": 8, "claims": 0, "reattaches": 0},
        ],
    }  # fmt: skip
    assert json.loads(answers["/health/ready"].body) == {"status": "unresponsive", "reason": reason}
    assert [answers[path].status for path in probes] == [503, 200, 503]


def test_a_request_no_slot_can_take_now_is_refused_before_its_prompt_is_tokenized(port, tokenizer) -> None:
    """A flood that never backs off costs the edge a parse per attempt, not a tokenization (docs/TENANTS.md)."""
    edge = lifecycle(port, tokenizer)
    port.unclaimable = True
    (action,) = edge.receive(1, generate(prompt="a prompt that is never tokenized"), now=0)
    assert action.response.status == 429 and body(action)["error"]["type"] == "no_slot"
    assert dict(action.response.headers)[b"retry-after-ms"] == b"1500"  # the agent's advice, as at submit
    assert tokenizer.calls == 0 and port.submitted == [] and port.held == set() and edge.tracked == {}
    assert port.asked == [(0, 0, 1)]  # no tenant, no floor, one slot
    assert 'edgepath_refusals_total{reason="no_slot"} 1.0' in edge.metrics.exposition().decode()
    port.unclaimable = False
    edge.receive(2, generate(), now=0)
    assert tokenizer.calls == 1 and len(port.submitted) == 1


@pytest.mark.parametrize(
    ("status", "code"), [(Status.NO_SLOT, 429), (Status.UNAVAILABLE, 503), (Status.BAD_REQUEST, 400)]
)
def test_refusals_at_submit_and_through_the_port_release_the_frame(port, tokenizer, status, code) -> None:
    edge = lifecycle(port, tokenizer)
    port.refuse_with = status
    (action,) = edge.receive(1, generate(), now=0)
    assert action.response.status == code and port.held == set()
    port.refuse_with = None
    edge.receive(2, generate(), now=0)
    (frame,) = port.submitted
    (action,) = edge.deliveries([port.finish(frame, status)], now=10)  # an agent process refuses later
    assert action.response.status == code and port.held == set()


def test_a_handler_error_is_502_and_mid_stream_an_error_event(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    edge.receive(1, generate(), now=0)
    edge.receive(2, generate(stream=True), now=0)
    plain, streamed = port.submitted
    (action,) = edge.deliveries([port.finish(plain, Status.HANDLER_ERROR)], now=10)
    assert action.response.status == 502 and "HANDLER_ERROR" in body(action)["error"]["message"]
    edge.deliveries([port.produce(streamed, [1])], now=10)
    (end,) = edge.deliveries([port.finish(streamed, Status.HANDLER_ERROR)], now=20)
    assert isinstance(end, EndStream) and next(sse(end.data))[0] == "error"
    assert port.held == set()


def test_tokenizer_failure_and_too_long_prompts_give_the_frame_back(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    (long,) = edge.receive(1, generate(prompt="y" * (INPUT + 1)), now=0)
    assert long.response.status == 400 and f"{INPUT + 1} tokens" in body(long)["error"]["message"]
    tokenizer.fail = True
    (failed,) = edge.receive(2, generate(), now=0)
    assert failed.response.status == 500 and "tokenizer exploded" in body(failed)["error"]["message"]
    (work,) = edge.receive(3, generate(prompt="w" * (INLINE_CHARS + 1)), now=0)
    assert isinstance(work, Tokenize)
    (failed_on_worker,) = edge.tokenized(3, ValueError("worker exploded"), now=5)
    assert failed_on_worker.response.status == 500
    assert port.held == set() and edge.tokenizing.busy == 0


def test_token_input_is_copied_into_the_frame_without_the_tokenizer(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    request = Request("POST", "/v1/generate", [], b'{"tokens": [7, 8, 9]}', t_receive_ns=0)
    assert edge.receive(1, request, now=0) == []
    (frame,) = port.submitted
    assert port.frames.tokens[frame, :3].tolist() == [7, 8, 9] and tokenizer.calls == 0


def test_tokenize_route_inline_and_on_a_worker(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer, workers=1)
    tok = Request("POST", "/v1/tokenize", [], b'{"prompt": "ab"}', t_receive_ns=0)
    (inline,) = edge.receive(1, tok, now=0)
    assert body(inline) == {"tokens": [97, 98], "count": 2}
    big = Request("POST", "/v1/tokenize", [], json.dumps({"prompt": "c" * (INLINE_CHARS + 1)}).encode(), 0)
    (work,) = edge.receive(2, big, now=0)
    assert isinstance(work, Tokenize) and work.out is None
    (busy,) = edge.receive(3, big, now=0)
    assert busy.response.status == 429
    (done,) = edge.tokenized(2, np.array([1, 2], np.int32), now=5)
    assert body(done) == {"tokens": [1, 2], "count": 2}
    assert port.held == set()


def test_llama_servers_tokenize_route_inline_and_on_a_worker_with_its_own_switches(port) -> None:
    """``/tokenize`` (llama-server's shape) takes the lifecycle's tokenize path -- a large text on a worker -- with
    its own encoding (add_special, parse_special) and answer."""
    vocabulary = CharVocabulary()
    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, 1000), shapes={"llama": LlamaUtilRoutes(vocabulary)})
    edge = EdgeLifecycle(core, vocabulary, port, metrics, Clock(), workers=1, request_timeout_ns=TIMEOUT)
    small = Request("POST", "/tokenize", [], b'{"content": "ab", "add_special": true}', t_receive_ns=0)
    (inline,) = edge.receive(1, small, now=0)
    assert body(inline) == {"tokens": [CharVocabulary.BOS, 97, 98]}
    text = "c" * (INLINE_CHARS + 1)
    big = Request("POST", "/tokenize", [], json.dumps({"content": text, "with_pieces": True}).encode(), 0)
    (work,) = edge.receive(2, big, now=0)
    assert isinstance(work, Tokenize) and work.out is None and work.encode is not None
    assert work.encode(text).tolist() == [99] * len(text)  # what the driver runs on the worker
    (busy,) = edge.receive(3, big, now=0)  # the one worker is busy: 429, in llama-server's error shape
    assert busy.response.status == 429 and body(busy)["error"]["type"] == "unavailable_error"
    (done,) = edge.tokenized(2, np.array([99, 100], np.int32), now=5)
    assert body(done) == {"tokens": [{"id": 99, "piece": "c"}, {"id": 100, "piece": "d"}]}
    (again,) = edge.receive(4, big, now=6)
    assert isinstance(again, Tokenize)
    (failed,) = edge.tokenized(4, RuntimeError("worker exploded"), now=7)
    assert failed.response.status == 500 and body(failed)["error"]["code"] == 500
    assert edge.tokenizing.busy == 0 and port.held == set()


def test_health_and_metrics_read_live_state_including_the_ports_delivery_stats(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    (health,) = edge.receive(1, Request("GET", "/health?latency=99", [], b"", 0), now=0)
    doc = body(health)
    assert (doc["status"], doc["free_slots"], doc["total_slots"]) == ("ok", 3, 8) and "latency" in doc
    port.up = False
    (down,) = edge.receive(2, Request("GET", "/health", [], b"", 0), now=0)
    assert down.response.status == 503
    port.delivery_stats.duplicates = 2
    port.delivery_stats.late = 5
    (metrics,) = edge.receive(3, Request("GET", "/metrics", [], b"", 0), now=0)
    text = metrics.response.body.decode()
    assert "edgepath_port_duplicates_total 2.0" in text and "edgepath_port_late_total 5.0" in text
    assert "edgepath_port_unknown_total 0.0" in text


def test_health_lists_every_slot_server_with_its_state_for_how_long_and_its_claims(port, tokenizer) -> None:
    """The port's clock is the edge's (monotonic): ``for_s`` is how long each link has been in its state."""
    up = LinkTracker("/a.sock", 5.0, 10.0)
    up.attached(0, 10.0)
    down = LinkTracker("10.0.0.2:7471", 5.0, 10.0)
    down.attached(0, 10.0)
    down.lost(Reason.DISCONNECTED, 40.0)
    port.listing = [SlotServerStatus(up.health(), 3, 4, 120, 0), SlotServerStatus(down.health(), 0, 4, 35, 2)]
    port.free_slots = lambda: (99, 99)  # type: ignore[method-assign]  # not read: the listing has the totals
    edge = lifecycle(port, tokenizer)
    (health,) = edge.receive(1, Request("GET", "/health", [], b"", 0), now=42 * SECOND)
    doc = body(health)
    assert health.response.status == 200 and (doc["free_slots"], doc["total_slots"]) == (3, 8)  # the listing's sums
    assert doc["slot_servers"] == [
        {"address": "/a.sock", "state": "up", "link": "up", "reason": "", "for_s": 32.0, "free_slots": 3,
         "total_slots": 4, "claims": 120, "reattaches": 0},
        {"address": "10.0.0.2:7471", "state": "down", "link": "down",
         "reason": "the connection to the slot server ended", "for_s": 2.0, "free_slots": 0, "total_slots": 4,
         "claims": 35, "reattaches": 2},
    ]  # fmt: skip


def test_early_refusals_are_answered_and_counted(port, tokenizer) -> None:
    edge = lifecycle(port, tokenizer)
    (action,) = edge.refuse(1, generate(), Response(408, [], b"{}"))
    assert action.response.status == 408
    assert 'edgepath_requests_total{route="/v1/generate",status="408"} 1.0' in edge.metrics.exposition().decode()


def test_bad_construction_is_refused_with_what_is_allowed(port, tokenizer) -> None:
    metrics = EdgeMetrics(lambda: 0, lambda: port.delivery_stats)
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, 1000))
    with pytest.raises(ValueError, match="at least 1"):
        EdgeLifecycle(core, tokenizer, port, metrics, Clock(), workers=0, request_timeout_ns=1)
    with pytest.raises(ValueError, match="must be positive"):
        EdgeLifecycle(core, tokenizer, port, metrics, Clock(), workers=1, request_timeout_ns=0)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("receive"), st.booleans(), st.booleans()),  # streamed?, large prompt?
        st.tuples(st.just("produce"), st.integers(0, 3), st.integers(1, 3)),
        st.tuples(
            st.just("finish"), st.integers(0, 3), st.sampled_from([Status.OK, Status.LENGTH, Status.HANDLER_ERROR])
        ),
        st.tuples(st.just("gone"), st.integers(0, 12), st.just(0)),
        st.tuples(st.just("worker"), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("tick"), st.integers(0, 2 * TIMEOUT), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_whatever_happens_every_request_is_answered_once_and_every_frame_comes_back(ops: list[tuple]) -> None:
    port, tokenizer = FakePort(), CharTokenizer()
    edge = lifecycle(port, tokenizer, workers=2)
    answers: dict[int, list[str]] = {}
    gone: set[int] = set()
    workers: list[Tokenize] = []
    now = 0

    def record(actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Tokenize):
                workers.append(action)
                continue
            seen = answers.setdefault(action.rid, [])
            assert action.rid not in gone, f"{action} after the client went away"
            assert not seen or seen[-1] not in ("respond", "end"), f"{action} after the answer was complete"
            kind = {Respond: "respond", StartStream: "start", SendChunk: "chunk", EndStream: "end"}[type(action)]
            assert kind in ("respond", "start") or (seen and seen[-1] in ("start", "chunk")), f"{kind} before start"
            seen.append(kind)

    rids = 0
    for op, a, b in ops:
        now += 1000
        if op == "receive":
            prompt = "p" * (INLINE_CHARS + 1) if b else "prompt"
            record(edge.receive(rids, generate(now, prompt=prompt, stream=a), now))
            answers.setdefault(rids, [])
            rids += 1
        elif op == "produce" and a in port.in_flight:
            record(edge.deliveries([port.produce(a, list(range(1, b + 1)))], now))
        elif op == "finish" and a in port.in_flight:
            record(edge.deliveries([port.finish(a, b)], now))
        elif op == "gone" and a < rids:
            gone.add(a)
            record(edge.client_gone(a, now))
        elif op == "worker" and a < len(workers):
            work = workers.pop(a)
            if work.out is not None:
                work.out[:2] = [1, 2]
            record(edge.tokenized(work.rid, 2, now))
        elif op == "tick":
            now += a
            record(edge.tick(now))
    # the end: workers finish, the slot server answers what is in flight
    for work in workers:
        record(edge.tokenized(work.rid, 2, now))
    for index in sorted(port.in_flight):
        record(edge.deliveries([port.finish(index)], now))
    for rid, seen in answers.items():
        if rid not in gone:
            assert seen and seen[-1] in ("respond", "end"), f"request {rid} unanswered: {seen}"
            assert seen.count("respond") + seen.count("end") == 1
    assert port.held == set() and port.in_flight == set() and edge.tracked == {} and edge.by_frame == {}
    assert edge.tokenizing.busy == 0 and edge.unmatched == 0 and edge.broken == 0


class StopAt(GenerateFormatter):
    """A route whose answer ends at a given token (as a stop string would), watching whole answers too."""

    def __init__(self, stop: int, tokenizer: CharTokenizer) -> None:
        super().__init__(tokenizer.decode)
        self.stop = stop
        self.watch = True
        self.seen: list[int] = []

    def tokens(self, ids: np.ndarray) -> bytes:
        for t in ids.tolist():
            if not self.done:
                self.seen.append(t)
                self.done = t == self.stop
        return super().tokens(ids)


@pytest.mark.parametrize("stream", [True, False])
def test_a_formatter_that_sees_the_end_answers_at_once_and_cancels_the_slot(port, tokenizer, stream) -> None:
    formatters = {"/v1/generate": lambda work, tok: StopAt(33, tok)}
    metrics = EdgeMetrics(lambda: 0, lambda: port.delivery_stats)
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, tokenizer.vocab_size))
    edge = EdgeLifecycle(
        core, tokenizer, port, metrics, Clock(), workers=1, request_timeout_ns=TIMEOUT, formatters=formatters
    )
    edge.receive(1, generate(stream=stream), now=0)
    (frame,) = port.submitted
    assert int(port.frames.requests[frame]["flags"]) == wire.FLAG_STREAM  # watched: output comes as it is made
    port.frames.results[frame]["cached_tokens"] = 3  # placed with the progress word by the slot server
    first = edge.deliveries([port.produce(frame, [104, 105])], now=10)
    assert not any(isinstance(a, (Respond, EndStream)) for a in first)
    actions = edge.deliveries([port.produce(frame, [33, 120])], now=20)  # the stop token, and one past it
    assert port.abandoned == [frame] and edge.tracked == {}  # the slot is cancelled, the edge holds nothing
    if stream:
        assert isinstance(actions[-1], EndStream)
        name, done = list(sse(actions[-1].data))[-1]
        assert name == "done" and done["output_count"] == 4 and done["cached_tokens"] == 3
    else:
        (answer,) = actions
        assert body(answer)["tokens"] == [104, 105, 33, 120] and body(answer)["cached_tokens"] == 3
    assert "edgepath_prefix_cache_tokens_total 3.0" in metrics.exposition().decode()


class OtherShape(GenerateFormatter):
    """A route with its own error shape (as OpenAI's routes have)."""

    @staticmethod
    def failure(error: HttpError) -> Response:
        return Response(error.status, error.headers, json.dumps({"other": error.type}).encode())


def test_errors_of_a_route_come_in_its_formatters_shape(port, tokenizer) -> None:
    formatters = {"/v1/generate": lambda work, tok: OtherShape(tok.decode)}
    metrics = EdgeMetrics(lambda: 0, lambda: port.delivery_stats)
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, tokenizer.vocab_size))
    edge = EdgeLifecycle(
        core, tokenizer, port, metrics, Clock(), workers=1, request_timeout_ns=TIMEOUT, formatters=formatters
    )
    (too_long,) = edge.receive(1, generate(prompt="y" * (INPUT + 1)), now=0)
    assert body(too_long) == {"other": "prompt_too_long"}
    for rid in range(2, 6):
        edge.receive(rid, generate(), now=0)
    (no_frame,) = edge.receive(9, generate(), now=0)
    assert body(no_frame) == {"other": "no_slot"} and (b"retry-after", b"1") in no_frame.response.headers
    (timeout, *_) = edge.tick(now=2 * TIMEOUT)
    assert body(timeout) == {"other": "timeout"}
