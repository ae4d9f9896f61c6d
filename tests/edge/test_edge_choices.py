"""OpenAI's ``n``: a request's choices run as n requests claimed together and come back as one answer -- driven
through the lifecycle by hand with the in-memory port double (the test plays the slot server)."""

from __future__ import annotations

import json

import pytest
from helpers.tokenizers import CharTokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from test_edge_lifecycle import INPUT, OUTPUT, TIMEOUT, Clock, FakePort, sse

from edgepath.contract.wire import Sampling
from edgepath.edge.apis.openai_answers import Usage
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes, formatter_factory
from edgepath.edge.choices import choice_sampling, merged_usage
from edgepath.edge.http import COMPLETIONS, Limits, Request
from edgepath.edge.lifecycle import (
    DEFAULT_FORMATTERS,
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
from edgepath.edge.text.tokenizer import INLINE_CHARS
from edgepath.native.abi import Status

MODEL = "m"


class GroupPort(FakePort):
    """The port double with the in-process agent's group submit (all or none)."""

    def __init__(self, frames: int = 8) -> None:
        super().__init__(frames)
        self.groups: list[list[int]] = []

    def submit_group(self, indexes: list[int]) -> Status | None:
        for index in indexes:
            assert index in self.held and index not in self.in_flight, f"submit of frame {index} not held"
        if self.refuse_with is not None:
            return self.refuse_with
        for index in indexes:
            self.frames.requests[index]["t_written_ns"] = 1
            self.in_flight.add(index)
        self.groups.append(list(indexes))
        return None


@pytest.fixture
def port() -> GroupPort:
    return GroupPort()


def lifecycle(port: GroupPort, tokenizer: CharTokenizer) -> EdgeLifecycle:
    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
    routes = OpenAIRoutes(MODEL, OUTPUT, tokenizer.vocab_size, ChatSupport(False, "none"), 0, choices=4)
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, tokenizer.vocab_size), None, routes)
    formatters = {**DEFAULT_FORMATTERS, COMPLETIONS: formatter_factory(lambda: 0.0)}
    return EdgeLifecycle(
        core, tokenizer, port, metrics, Clock(), workers=2, request_timeout_ns=TIMEOUT, formatters=formatters
    )


def completion(n: int, **fields: object) -> Request:
    body = json.dumps({"model": MODEL, "prompt": "hello", "n": n, "max_tokens": 4, "seed": 7, **fields}).encode()
    return Request("POST", COMPLETIONS, [], body, t_receive_ns=0)


def test_choice_seeds_follow_the_requests_and_wrap_as_unsigned_words() -> None:
    assert choice_sampling(Sampling(0.8, 1.0, 0, 7), 2) == Sampling(0.8, 1.0, 0, 9)
    assert choice_sampling(Sampling(seed=2**64 - 1), 1).seed == 0


def test_usage_counts_the_prompt_once_every_choices_completion_and_the_fewest_cached() -> None:
    assert merged_usage([Usage(5, 3, 4), Usage(5, 2, 0), Usage(5, 4, 4)]) == Usage(5, 9, 0)
    assert merged_usage([Usage(5, 1, None), Usage(5, 1, 4)]).cached_tokens is None


def test_n_choices_are_claimed_together_with_their_own_seeds_and_answered_as_one_body(port: GroupPort) -> None:
    tokenizer = CharTokenizer()
    edge = lifecycle(port, tokenizer)
    assert edge.receive(1, completion(3), now=0) == []
    (frames,) = port.groups
    assert len(frames) == 3 and port.submitted == []  # one group submit, no single one
    for frame in frames:
        assert tokenizer.decode(port.frames.tokens[frame, :5]) == "hello"  # the same ids in every frame
    assert [int(port.frames.requests[f]["seed"]) for f in frames] == [7, 8, 9]
    answers = {frames[0]: [104, 105], frames[1]: [111], frames[2]: [121, 111, 33]}
    out = []
    for frame in reversed(frames):  # the last choice ends first: the answer waits for all
        port.produce(frame, answers[frame])
        out += edge.deliveries([port.finish(frame, Status.STOP)], now=10)
    (action,) = out
    assert isinstance(action, Respond) and action.rid == 1 and action.response.status == 200
    doc = json.loads(action.response.body)
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert [c["text"] for c in doc["choices"]] == ["hi", "o", "yo!"]
    assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    assert port.held == set() and edge.tracked == {} and edge.by_frame == {} and len(edge.groups) == 0
    assert edge.metrics.exposition().count(b'edgepath_requests_total{route="/v1/completions",status="200"} 1') == 1


def test_streamed_choices_carry_their_indexes_and_the_stream_ends_once_with_one_usage() -> None:
    port, tokenizer = GroupPort(), CharTokenizer()
    edge = lifecycle(port, tokenizer)
    edge.receive(3, completion(2, stream=True, stream_options={"include_usage": True}), now=0)
    a, b = port.groups[0]
    out = edge.deliveries([port.produce(b, [120])], now=5) + edge.deliveries([port.produce(a, [121])], now=6)
    out += edge.deliveries([port.finish(a, Status.LENGTH)], now=7) + edge.deliveries([port.finish(b)], now=8)
    assert [type(x) for x in out] == [StartStream, SendChunk, SendChunk, SendChunk, EndStream]
    assert {x.rid for x in out} == {3}
    data = b"".join(x.data for x in out if isinstance(x, (SendChunk, EndStream)))
    assert data.count(b"data: [DONE]") == 1 and data.endswith(b"data: [DONE]\n\n")
    events = [doc for _, doc in sse(data.replace(b"data: [DONE]\n\n", b""))]
    texts = [(c["index"], c["text"]) for e in events for c in e["choices"] if c["text"]]
    assert texts == [(1, "x"), (0, "y")]
    finishes = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finishes == {0: "length", 1: "stop"}
    usages = [e["usage"] for e in events if e.get("usage")]
    assert usages == [{"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                       "prompt_tokens_details": {"cached_tokens": 0}}]  # fmt: skip
    assert len(edge.groups) == 0 and port.held == set()


def test_a_client_that_goes_away_cancels_every_choice() -> None:
    port, tokenizer = GroupPort(), CharTokenizer()
    edge = lifecycle(port, tokenizer)
    edge.receive(4, completion(3, stream=True), now=0)
    frames = port.groups[0]
    edge.deliveries([port.produce(frames[0], [104])], now=1)
    edge.deliveries([port.finish(frames[1])], now=2)  # one choice ended already
    assert edge.client_gone(4, now=3) == []
    assert sorted(port.abandoned) == sorted([frames[0], frames[2]]) and port.in_flight == set()
    assert edge.tracked == {} and len(edge.groups) == 0 and port.held == set()


def test_a_choice_that_fails_answers_its_request_once_and_the_others_are_abandoned() -> None:
    port, tokenizer = GroupPort(), CharTokenizer()
    edge = lifecycle(port, tokenizer)
    edge.receive(5, completion(3), now=0)
    frames = port.groups[0]
    port.lost = [frames[1]]
    (action,) = edge.tick(now=1)
    assert isinstance(action, Respond) and action.rid == 5 and action.response.status == 503
    assert sorted(port.abandoned) == sorted([frames[0], frames[2]]) and port.held == set()
    assert edge.tracked == {} and len(edge.groups) == 0
    port.lost = frames[:]  # every choice lost at once: still one answer
    edge.receive(6, completion(3), now=2)
    port.lost = port.groups[1][:]
    actions = edge.tick(now=3)
    assert [(a.rid, a.response.status) for a in actions if isinstance(a, Respond)] == [(6, 503)]


def test_a_group_refused_at_claim_time_is_one_429_and_every_frame_comes_back() -> None:
    port, tokenizer = GroupPort(), CharTokenizer()
    edge = lifecycle(port, tokenizer)
    port.refuse_with = Status.NO_SLOT
    (action,) = edge.receive(7, completion(4), now=0)
    assert isinstance(action, Respond) and action.rid == 7 and action.response.status == 429
    assert port.held == set() and len(port.free) == 8 and edge.tracked == {} and len(edge.groups) == 0


def test_n_frames_or_none_a_request_that_cannot_get_them_all_is_429_and_holds_nothing() -> None:
    port, tokenizer = GroupPort(frames=3), CharTokenizer()
    edge = lifecycle(port, tokenizer)
    (action,) = edge.receive(8, completion(4), now=0)
    assert isinstance(action, Respond) and action.response.status == 429
    assert json.loads(action.response.body)["error"]["code"] == "no_slot"
    assert port.held == set() and sorted(port.free) == [0, 1, 2] and port.groups == []


def test_an_agent_process_refusing_the_group_through_its_frames_is_one_429() -> None:
    port, tokenizer = GroupPort(), CharTokenizer()
    edge = lifecycle(port, tokenizer)
    edge.receive(9, completion(3), now=0)
    frames = port.groups[0]  # accepted for now: an agent process answers through the frames
    (action,) = edge.deliveries([port.finish(frames[0], Status.NO_SLOT)], now=1)
    assert isinstance(action, Respond) and action.rid == 9 and action.response.status == 429
    assert sorted(port.abandoned) == sorted(frames[1:])  # the others' refusals come to abandoned frames
    assert edge.tracked == {} and len(edge.groups) == 0 and port.held == set()


def test_a_choice_answered_in_the_event_another_fails_in_is_not_sent() -> None:
    port, tokenizer = GroupPort(), CharTokenizer()
    edge = lifecycle(port, tokenizer)
    edge.receive(10, completion(2), now=0)
    a, b = port.groups[0]
    port.produce(a, [104])
    actions = edge.deliveries([port.finish(a, Status.STOP), port.finish(b, Status.HANDLER_ERROR)], now=1)
    assert [(x.rid, x.response.status) for x in actions if isinstance(x, Respond)] == [(10, 502)]
    assert len(actions) == 1 and edge.tracked == {} and len(edge.groups) == 0 and port.held == set()


operations = st.lists(
    st.one_of(
        st.tuples(st.just("receive"), st.integers(1, 3), st.integers(0, 3)),  # n; bit 0 streamed, bit 1 large
        st.tuples(st.just("produce"), st.integers(0, 7), st.integers(1, 3)),
        st.tuples(
            st.just("finish"),
            st.integers(0, 7),
            st.sampled_from([Status.STOP, Status.LENGTH, Status.HANDLER_ERROR, Status.NO_SLOT]),
        ),
        st.tuples(st.just("lost"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("gone"), st.integers(0, 12), st.just(0)),
        st.tuples(st.just("worker"), st.integers(0, 1), st.just(0)),
        st.tuples(st.just("tick"), st.integers(0, 2 * TIMEOUT), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_whatever_happens_each_request_of_n_choices_is_answered_once_and_every_frame_comes_back(
    ops: list[tuple],
) -> None:
    port, tokenizer = GroupPort(), CharTokenizer()
    edge = lifecycle(port, tokenizer)
    answers: dict[int, list[str]] = {}
    gone: set[int] = set()
    workers: list[Tokenize] = []
    now = 0

    def record(actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Tokenize):
                workers.append(action)
                continue
            assert action.rid >= 0, f"a choice's own action reached the client: {action}"
            seen = answers.setdefault(action.rid, [])
            assert action.rid not in gone, f"{action} after the client went away"
            assert not seen or seen[-1] not in ("respond", "end"), f"{action} after the answer was complete"
            kind = {Respond: "respond", StartStream: "start", SendChunk: "chunk", EndStream: "end"}[type(action)]
            assert kind in ("respond", "start") or (seen and seen[-1] in ("start", "chunk")), f"{kind} before start"
            assert kind != "start" or not seen, "a second start"
            seen.append(kind)

    rids = 0
    for op, a, b in ops:
        now += 1000
        if op == "receive":
            prompt = "p" * (INLINE_CHARS + 1) if b & 2 else "hello"
            record(edge.receive(rids, completion(a, prompt=prompt, stream=bool(b & 1)), now))
            answers.setdefault(rids, [])
            rids += 1
        elif op == "produce" and a in port.in_flight:
            record(edge.deliveries([port.produce(a, list(range(100, 100 + b)))], now))
        elif op == "finish" and a in port.in_flight:
            record(edge.deliveries([port.finish(a, b)], now))
        elif op == "lost" and a in port.in_flight:
            port.lost = [a]
            record(edge.tick(now))
        elif op == "gone" and a < rids:
            gone.add(a)
            record(edge.client_gone(a, now))
        elif op == "worker" and a < len(workers):
            work = workers.pop(a)
            if work.out is not None:
                work.out[:2] = [104, 105]
            record(edge.tokenized(work.rid, 2, now))
        elif op == "tick":
            now += a
            record(edge.tick(now))
    for work in workers:  # the end: workers finish, the slot server answers what is in flight
        record(edge.tokenized(work.rid, 2, now))
    for index in sorted(port.in_flight):
        record(edge.deliveries([port.finish(index)], now))
    for rid, seen in answers.items():
        if rid not in gone:
            assert seen and seen[-1] in ("respond", "end"), f"request {rid} unanswered: {seen}"
            assert seen.count("respond") + seen.count("end") == 1
    assert port.held == set() and port.in_flight == set() and edge.tracked == {} and edge.by_frame == {}
    assert len(edge.groups) == 0 and edge.tokenizing.busy == 0 and edge.unmatched == 0 and edge.broken == 0
