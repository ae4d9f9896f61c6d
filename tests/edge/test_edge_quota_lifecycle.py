"""Token quotas in the edge lifecycle (no event loop, the fake port of test_edge_lifecycle): the prompt and
``max_tokens`` are reserved before the request is written, over quota is 429 ``quota_exceeded`` at once with when
to come back, every answer carries OpenAI's rate-limit headers, and what a request did not use comes back when it
ends -- finished, stopped early, cancelled (client gone), failed, timed out or refused by the data path."""

from __future__ import annotations

import hashlib
import json

import pytest
from helpers.tokenizers import CharTokenizer
from test_edge_lifecycle import TIMEOUT, Clock, FakePort, Respond, only

from edgepath.contract import wire
from edgepath.dpu.ledger import LedgerUnavailable
from edgepath.dpu.port import Delivery
from edgepath.edge.http import Limits, Request
from edgepath.edge.lifecycle import Action, EdgeLifecycle, EndStream, StartStream
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.routes import HttpCore
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.tenancy.gate import TenantGate
from edgepath.edge.tenancy.quota import Quotas
from edgepath.edge.tenancy.tenants import Tenant
from edgepath.edge.tenancy.usage import Usage
from edgepath.native.abi import Status

INPUT, OUTPUT = 64, 64
QUOTA = 40  # tokens per minute


@pytest.fixture
def port() -> FakePort:
    return FakePort()


def lifecycle(port: FakePort, tenant: Tenant) -> EdgeLifecycle:
    tokenizer = CharTokenizer()
    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
    keys = ApiKeys.of_digests([(hashlib.sha256(b"k").digest(), tenant)])
    core = HttpCore(Limits(1 << 20, INPUT, OUTPUT, tokenizer.vocab_size), keys)
    return EdgeLifecycle(
        core,
        tokenizer,
        port,
        metrics,
        Clock(),
        workers=2,
        request_timeout_ns=TIMEOUT,
        gate=TenantGate(wall_clock=lambda: 0),
    )


def generate(max_tokens: int, stream: bool = False) -> Request:
    body = json.dumps({"prompt": "hello", "max_tokens": max_tokens, "stream": stream}).encode()  # 5 prompt tokens
    return Request("POST", "/v1/generate", [(b"x-api-key", b"k")], body, t_receive_ns=0)


def limits_of(headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    h = dict(headers)
    return int(h[b"x-ratelimit-limit-tokens"]), int(h[b"x-ratelimit-remaining-tokens"])


ACME = Tenant("acme", b"tenant:acme", tokens_per_minute=QUOTA)


def test_over_quota_is_a_429_at_once_before_any_work_and_says_when(port: FakePort) -> None:
    edge = lifecycle(port, ACME)
    assert edge.receive(1, generate(30), now=0) == []  # 5 + 30 reserved of 40
    (frame,) = port.submitted
    (refused,) = edge.receive(2, generate(10), now=0)  # 15 more do not fit the 5 left
    assert isinstance(refused, Respond) and refused.response.status == 429
    error = json.loads(refused.response.body)["error"]
    assert error["type"] == "quota_exceeded" and "15 tokens" in error["message"]
    headers = dict(refused.response.headers)
    assert int(headers[b"retry-after-ms"]) == 15_000  # 10 more tokens at 40 a minute
    assert limits_of(refused.response.headers) == (QUOTA, 5)
    assert port.submitted == [frame] and len(port.held) == 1  # nothing written for it, its frame is back
    # The first one ends having produced 2 tokens: 28 come back, and the same request is admitted.
    port.produce(frame, [104, 105])
    (answer,) = edge.deliveries([port.finish(frame)], now=1)
    assert answer.response.status == 200 and limits_of(answer.response.headers) == (QUOTA, 5)
    assert edge.receive(3, generate(10), now=2) == []
    assert remaining(edge) == 40 - 7 - 15


def test_a_request_larger_than_the_whole_quota_never_fits(port: FakePort) -> None:
    (refused,) = lifecycle(port, ACME).receive(1, generate(36), now=0)
    assert isinstance(refused, Respond) and refused.response.status == 429
    assert b"retry-after-ms" not in dict(refused.response.headers)
    assert "more than the whole 40-token quota" in json.loads(refused.response.body)["error"]["message"]


def remaining(edge: EdgeLifecycle, tenant: Tenant = ACME, unit: str = "tokens") -> int:
    got = edge.gate.quotas.limits(tenant, 0)
    assert isinstance(got, dict), got
    return got[unit].remaining


@pytest.mark.parametrize("end", ["stopped", "client_gone", "failed", "timeout", "refused", "never_written"])
def test_every_end_refunds_what_was_not_used(port: FakePort, end: str) -> None:
    edge = lifecycle(port, ACME)
    actions: list[Action] = edge.receive(1, generate(30, stream=True), now=0)
    if end == "never_written":
        port.refuse_with = Status.NO_SLOT
        edge = lifecycle(port, ACME)
        (answer,) = edge.receive(1, generate(30, stream=True), now=0)
        assert answer.response.status == 429  # type: ignore[union-attr]
        assert remaining(edge) == QUOTA  # refused by the data path: nothing charged
        return
    (frame,) = port.submitted
    assert remaining(edge) == QUOTA - 35
    started = only(edge.deliveries([port.produce(frame, [104, 105, 106])], now=1), StartStream)
    assert started and limits_of(started[0].headers) == (QUOTA, 5)
    if end == "stopped":
        port.produce(frame, [107])
        actions = edge.deliveries([port.finish(frame, Status.STOP)], now=2)
        assert only(actions, EndStream)
        expect = 5 + 4
    elif end == "client_gone":  # charged what the slot server computed, which it says when it has stopped
        edge.client_gone(1, now=2)
        assert remaining(edge) == QUOTA - 35  # still reserved: what was computed is not known yet
        edge.deliveries([Delivery(frame, 6, True, abandoned=True)], now=3)
        expect = 5 + 6
    elif end == "failed":
        actions = edge.deliveries([port.finish(frame, Status.HANDLER_ERROR)], now=2)
        assert only(actions, EndStream)
        expect = 5 + 3
    elif end == "timeout":  # the slot server never says what it computed: charged what the edge saw, in time
        edge.tick(now=TIMEOUT * 3)
        edge.tick(now=TIMEOUT * 4)
        assert remaining(edge) == QUOTA - 35
        edge.tick(now=TIMEOUT * 5 + 1)
        expect = 5 + 3
    else:  # an agent process answers a refusal through the port after the submit
        port.frames.results[frame]["output_count"] = 0
        edge.deliveries([port.finish(frame, Status.NO_SLOT)], now=2)
        expect = 0
    assert edge.tracked == {}
    assert remaining(edge) == QUOTA - expect


def test_a_tenant_without_quota_gets_no_rate_limit_headers(port: FakePort) -> None:
    edge = lifecycle(port, Tenant("free", b"tenant:free"))
    edge.receive(1, generate(30), now=0)
    (frame,) = port.submitted
    (answer,) = edge.deliveries([port.finish(frame)], now=1)
    assert answer.response.status == 200
    assert not any(name.startswith(b"x-ratelimit") for name, _ in answer.response.headers)


def test_a_tenant_at_its_slot_cap_is_refused_at_once_until_one_of_its_requests_ends(port: FakePort) -> None:
    capped = Tenant("capped", b"tenant:capped", slot_cap=2)
    edge = lifecycle(port, capped)
    assert edge.receive(1, generate(3), now=0) == [] and edge.receive(2, generate(3), now=0) == []
    (refused,) = edge.receive(3, generate(3), now=0)
    assert isinstance(refused, Respond) and refused.response.status == 429
    assert json.loads(refused.response.body)["error"]["type"] == "slot_cap"
    assert len(port.submitted) == 2
    edge.client_gone(1, now=1)  # one ends (any way): a place is free again
    assert edge.receive(4, generate(3), now=2) == [] and len(port.submitted) == 3
    assert edge.gate.in_flight["capped"] == 2


def test_a_tenant_at_its_slot_cap_across_every_edge_is_a_429_slot_cap_from_the_agent(port: FakePort) -> None:
    """The edge's own count is the early refusal; the agent counts the tenant's slots across every edge and refuses
    SLOT_CAP: the same answer, saying where it was counted and when to come back, and the edge's count given back."""
    capped = Tenant("capped", b"tenant:capped", slot_cap=5, floor_id=7)
    edge = lifecycle(port, capped)
    for index in range(port.frames.count):
        port.frames.result_headers[index].capped(1200.0)
    port.refuse_with = Status.SLOT_CAP
    (refused,) = edge.receive(1, generate(3), now=0)
    assert isinstance(refused, Respond) and refused.response.status == 429
    error = json.loads(refused.response.body)["error"]
    assert error["type"] == "slot_cap" and "5 slots across every edge" in error["message"]
    assert dict(refused.response.headers)[b"retry-after-ms"] == b"1200"
    assert edge.gate.in_flight["capped"] == 0  # nothing held for it at this edge
    assert 'edgepath_refusals_total{reason="slot_cap"} 1.0' in edge.metrics.exposition().decode()


def test_each_request_that_ran_is_one_usage_record_equal_to_its_answer_and_counted_per_tenant(port: FakePort) -> None:
    edge = lifecycle(port, ACME)
    records: list[Usage] = []
    edge.gate.usage = records.append
    edge.receive(1, generate(3), now=0)
    (frame,) = port.submitted
    port.produce(frame, [104, 105])
    port.frames.results[frame]["cached_tokens"] = 2
    (answer,) = edge.deliveries([port.finish(frame, Status.STOP)], now=1)
    doc = json.loads(answer.response.body)  # type: ignore[union-attr]
    edge.receive(2, generate(3, stream=True), now=2)  # goes away after one token
    second = port.submitted[-1]
    edge.deliveries([port.produce(second, [110])], now=3)
    edge.client_gone(2, now=4)
    assert len(records) == 1  # what the slot server computed for it is not known yet
    edge.deliveries([Delivery(second, 3, True, abandoned=True)], now=5)  # it computed 3 before it stopped
    port.refuse_with = Status.NO_SLOT
    edge.receive(3, generate(3), now=6)  # refused by the data path: no record
    assert [(r.tenant, r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.finish) for r in records] == [
        ("acme", doc["input_count"], doc["cached_tokens"], doc["output_count"], "stop"),
        ("acme", 5, 0, 3, "cancelled"),
    ]
    assert records[0].ttft_ms is not None and records[1].request_id != records[0].request_id
    text = edge.metrics.exposition().decode()
    assert 'edgepath_tenant_tokens_total{kind="completion",tenant="acme"} 5.0' in text
    assert 'edgepath_tenant_tokens_total{kind="prompt",tenant="acme"} 10.0' in text
    assert 'edgepath_tenant_requests_total{finish="cancelled",tenant="acme"} 1.0' in text


def test_a_request_quota_refuses_at_once_says_when_and_a_request_that_never_ran_is_given_back(port: FakePort) -> None:
    tenant = Tenant("rpm", b"tenant:rpm", requests_per_minute=2)
    edge = lifecycle(port, tenant)
    assert edge.receive(1, generate(3), now=0) == []
    (frame,) = port.submitted
    (answer,) = edge.deliveries([port.finish(frame)], now=1)
    h = dict(answer.response.headers)
    assert (h[b"x-ratelimit-limit-requests"], h[b"x-ratelimit-remaining-requests"]) == (b"2", b"1")
    assert h[b"x-ratelimit-reset-requests"] == b"30s" and b"x-ratelimit-limit-tokens" not in h
    port.refuse_with = Status.NO_SLOT  # refused by the data path: its request is given back
    (refused,) = edge.receive(2, generate(3), now=2)
    assert refused.response.status == 429 and remaining(edge, tenant, "requests") == 1  # type: ignore[union-attr]
    port.refuse_with = None
    assert edge.receive(3, generate(3), now=3) == []
    (over,) = edge.receive(4, generate(3), now=4)
    assert isinstance(over, Respond) and over.response.status == 429
    error = json.loads(over.response.body)["error"]
    assert (
        error["type"] == "quota_exceeded"
        and "1 request; 0 of the 2-request quota per minute are left" in error["message"]
    )
    assert int(dict(over.response.headers)[b"retry-after-ms"]) == 30_000
    assert len(port.submitted) == 2  # nothing written for the refused ones


def test_a_ledger_out_of_reach_fails_closed_for_tenants_with_a_quota_only(port: FakePort) -> None:
    class Gone:
        entries = 16

        def cas(self, word: int, expected: int, desired: int) -> int:
            raise LedgerUnavailable("ledger /run/q.sock: its home has gone")

    edge = lifecycle(port, ACME)
    edge.gate.quotas = Quotas(Gone())
    (refused,) = edge.receive(1, generate(3), now=0)
    assert isinstance(refused, Respond) and refused.response.status == 503
    error = json.loads(refused.response.body)["error"]
    assert error["type"] == "quota_unavailable" and "its home has gone" in error["message"]
    assert port.submitted == [] and not port.held  # nothing claimed, the frame back
    free = lifecycle(port, Tenant("free", b"tenant:free"))
    free.gate.quotas = Quotas(Gone())
    assert free.receive(2, generate(3), now=0) == [] and len(port.submitted) == 1  # no quota: served as ever


def test_a_reader_of_the_shared_prefix_says_so_in_its_header_and_writes_its_own_salt(port: FakePort) -> None:
    reader = Tenant("reader", b"tenant:reader", read_shared_prefix=True)
    lifecycle(port, reader).receive(1, generate(3), now=0)
    lifecycle(port, Tenant("plain", b"tenant:plain")).receive(2, generate(3), now=0)
    first, second = (port.frames.request_headers[f] for f in port.submitted)
    assert first.flags & wire.FLAG_READ_PUBLIC and not second.flags & wire.FLAG_READ_PUBLIC
    assert first.cache_salt == reader.salt(None) != wire.PUBLIC_SALT
    assert wire.readable_salts(first.cache_salt, first.flags) == (reader.salt(None), wire.PUBLIC_SALT)
