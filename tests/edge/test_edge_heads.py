"""Refusals from a request's head alone (issue 52: refusals that cost almost nothing): what the headers and a word or
two of load state decide -- a path, method or key refused; the edge stopping; the tenant at its slot_cap, out of
quota or past its budget of body bytes; no slot to be had now -- is answered before the body is read (the lifecycle
driven by hand, the fake port of test_edge_lifecycle), and a head that passes holds nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.tokenizers import CharTokenizer
from test_edge_lifecycle import TIMEOUT, Clock, FakePort, Respond
from test_edge_service import Recorded, Server, start_server

from edgepath.dpu.agent import Agent
from edgepath.edge.body_budget import BodyBudget, Dropping
from edgepath.edge.http import Limits, Request
from edgepath.edge.lifecycle import EdgeLifecycle
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.routes import HttpCore
from edgepath.edge.service import EdgeService
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.tenancy.gate import TenantGate
from edgepath.edge.tenancy.tenants import Tenant
from edgepath.edge.turns import LARGE_BODY
from edgepath.native.abi import lib
from edgepath.peer_secret import peer_keys
from edgepath.transports.loopback import LoopbackTransport

SECOND = 10**9
TENANTS = {
    "free": Tenant("free", b"tenant:free"),
    "capped": Tenant("capped", b"tenant:capped", slot_cap=1),
    "rpm": Tenant("rpm", b"tenant:rpm", requests_per_minute=1),
    "tpm": Tenant("tpm", b"tenant:tpm", tokens_per_minute=20),
}


def lifecycle(port: FakePort) -> EdgeLifecycle:
    tokenizer = CharTokenizer()
    keys = ApiKeys.of_digests([(hashlib.sha256(k.encode()).digest(), t) for k, t in TENANTS.items()])
    core = HttpCore(Limits(1 << 20, 64, 64, tokenizer.vocab_size), keys)
    metrics = EdgeMetrics(lambda: port.free_slots()[0], lambda: port.delivery_stats)
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


def head(key: str | None, path: str = "/v1/generate", method: str = "POST") -> Request:
    headers = [] if key is None else [(b"x-api-key", key.encode())]
    return Request(method, path, headers, b"", t_receive_ns=0)


def whole(key: str, prompt: str = "hello", max_tokens: int = 4) -> Request:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    return Request("POST", "/v1/generate", [(b"x-api-key", key.encode())], body, t_receive_ns=0)


def refused(edge: EdgeLifecycle, request: Request, length: int | None = 100, now: int = 0) -> dict:
    actions = edge.head(1, request, length, now)
    assert actions is not None, "the head was let through"
    (answer,) = actions
    assert isinstance(answer, Respond)
    return {"status": answer.response.status, **json.loads(answer.response.body)["error"],
            "headers": dict(answer.response.headers)}  # fmt: skip


@pytest.fixture
def port() -> FakePort:
    return FakePort()


def test_a_head_that_passes_holds_nothing_and_the_request_is_judged_whole_later(port: FakePort) -> None:
    edge = lifecycle(port)
    assert edge.head(1, head("free"), 100, 0) is None
    assert not port.held and port.asked == [(0, 0, 1)]  # the agent was asked about a slot, the frame given back
    assert edge.head(2, head("free", "/v1/tokenize"), 100, 0) is None  # no slot asked for: nothing to ask
    assert edge.head(3, head(None, "/health/live", "GET"), None, 0) is None  # the ops pages read no body
    assert len(port.asked) == 1 and not edge.tracked


@pytest.mark.parametrize(
    ("request_", "status", "kind"),
    [
        (head(None), 401, "unauthorized"),
        (head("nobody"), 401, "unauthorized"),
        (head("free", "/v1/nothing"), 404, "not_found"),
        (head("free", "/v1/generate", "PUT"), 405, "method_not_allowed"),
    ],
)
def test_a_path_method_or_key_refused_whatever_the_body_is_answered_from_the_head(
    port: FakePort, request_: Request, status: int, kind: str
) -> None:
    edge = lifecycle(port)
    error = refused(edge, request_)
    assert (error["status"], error["type"]) == (status, kind)
    assert not port.asked and not port.held


def test_no_slot_to_be_had_is_a_429_from_the_head_with_when_to_come_back(port: FakePort) -> None:
    edge = lifecycle(port)
    port.unclaimable = True
    error = refused(edge, head("free"))
    assert (error["status"], error["type"]) == (429, "no_slot") and error["headers"][b"retry-after-ms"] == b"1500"
    assert not port.held  # the frame it asked with is back
    port.free.clear()  # every frame taken: refused without asking the agent
    assert refused(edge, head("free"))["type"] == "no_slot"
    assert 'edgepath_refusals_total{reason="no_slot"} 2.0' in edge.metrics.exposition().decode()


def test_a_tenant_at_its_slot_cap_or_out_of_quota_is_refused_from_the_head(port: FakePort) -> None:
    edge = lifecycle(port)
    assert edge.receive(1, whole("capped"), now=0) == []  # in flight: its one slot
    assert refused(edge, head("capped"))["type"] == "slot_cap"
    assert edge.receive(2, whole("rpm"), now=0) == []  # its one request this minute
    error = refused(edge, head("rpm"))
    assert (error["status"], error["type"]) == (429, "quota_exceeded") and "1 request" in error["message"]
    assert b"x-ratelimit-remaining-requests" in error["headers"]
    assert edge.receive(3, whole("tpm", "x" * 10, max_tokens=9), now=0) == []  # 19 of its 20 tokens
    error = refused(edge, head("tpm"))
    assert "any request takes at least 2 tokens" in error["message"] and "1 of the 20-token quota" in error["message"]
    assert edge.head(4, head("free"), 100, 0) is None  # the others go on


def test_a_draining_edge_refuses_from_the_head(port: FakePort) -> None:
    edge = lifecycle(port)
    edge.admission.draining = True
    error = refused(edge, head("free"))
    assert (error["status"], error["type"]) == (503, "draining")
    assert edge.head(2, head("free", "/v1/tokenize"), 10, 0) is None  # what takes no slot is still served


def test_a_tenants_budget_of_body_bytes_refuses_its_heads_until_it_refills(port: FakePort) -> None:
    edge = lifecycle(port)
    edge.admission.bodies = BodyBudget(rate=1000, burst=2000)
    big = whole("free", "y" * 1900)
    assert edge.head(1, head("free"), len(big.body), 0) is None
    edge.receive(1, big, now=0)  # read: its bytes are taken from the tenant's budget
    error = refused(edge, head("free"), length=len(big.body), now=0)
    assert (error["status"], error["type"]) == (429, "body_rate") and "1000 bytes a second" in error["message"]
    retry_ms = int(error["headers"][b"retry-after-ms"])
    assert 1800 <= retry_ms <= 1950  # the time the budget takes to hold this body again
    assert edge.head(2, head("tpm"), len(big.body), 0) is None  # another tenant's budget is its own
    assert edge.head(3, head("free"), len(big.body), retry_ms * 10**6) is None  # refilled


def test_a_body_budget_holds_at_least_one_largest_body_and_owes_for_bodies_of_no_declared_length() -> None:
    budget = BodyBudget(rate=100, burst=10)
    assert budget.burst == 100 and budget.refused("t", 100, 0) is None
    budget.take("t", 150, 0)  # a body that declared no length: read, and owed for
    assert budget.refused("t", 0, 0) == pytest.approx(0.51)  # owes 50 bytes, and a head needs 1
    assert budget.refused("t", 0, SECOND) is None
    assert BodyBudget(rate=0, burst=0).refused("t", 1 << 30, 0) is None  # no budget
    with pytest.raises(ValueError, match="0 \\(none\\) or a positive number"):
        BodyBudget(rate=-1, burst=1)


def test_a_dropped_body_is_paid_by_its_tenant_as_it_is_read_and_says_how_long_to_stop_reading(port: FakePort) -> None:
    """A refused request's body (HTTP/1.1 reads it to go on): its bytes are the tenant's to pay, from its bucket of
    refused bytes; while that owes, the adapter stops reading for as long as the bucket takes to refill
    (edge/adapters/tcp.py) -- and what the tenant's next request may use is not spent by it."""
    edge = lifecycle(port)
    edge.admission.budget_bodies(1000, 1000)
    dropping = Dropping(edge.admission.drops, "free")
    assert dropping.drop(600, 0) == 0.0  # the bucket held it: read on
    assert dropping.drop(900, 0) == pytest.approx(0.5)  # owes 500 bytes: half a second at 1000 a second
    assert edge.head(1, head("free"), 900, 0) is None  # its next body within its budget is read meanwhile
    edge.admission.drops.take("free", 500, SECOND // 4)  # another of its refused bodies was read meanwhile
    assert dropping.owes(SECOND // 2) == pytest.approx(0.5)  # so the first waits on (it would owe nothing now)
    assert dropping.owes(2 * SECOND) == 0.0 and Dropping(edge.admission.drops, "u").owes(0) == 0.0  # refilled; another
    assert Dropping(BodyBudget(rate=0, burst=0), "t").drop(1 << 30, 0) == 0.0  # no budget: never paced


@pytest.fixture
def slots(tmp_path) -> Server:  # type: ignore[no-untyped-def]
    yield from start_server(tmp_path, None)


def test_a_large_body_whose_tenants_line_is_full_is_refused_from_its_head(slots: Server) -> None:
    """Through the service: a tenant with as many large requests waiting for their turn as it may have gets 429
    ``large_requests_waiting`` for its next large body at its head; a small one of it is read."""

    async def go() -> tuple[Dropping | None, Dropping | None, Recorded]:
        agent = Agent(LoopbackTransport(peer_keys(None)), frames=8, input_capacity=64, output_capacity=64)
        agent.attach(slots.address)
        core = HttpCore(Limits(1 << 20, 64, 64, CharTokenizer().vocab_size), ApiKeys(["a"]))
        service = EdgeService(
            core, CharTokenizer(), agent, asyncio.get_running_loop(), ThreadPoolExecutor(2), workers=2
        )
        service.start()
        pad = json.dumps({"prompt": "x" * LARGE_BODY}).encode()
        keyed = [(b"x-api-key", b"a")]
        for _ in range(2):  # two large ones in its line, not read yet (their turn is the next loop iteration)
            service.handle(Request("POST", "/v1/generate", keyed, pad, lib.ep_now_ns()), Recorded())
        third = Recorded()
        large = service.head(Request("POST", "/v1/generate", keyed, b"", lib.ep_now_ns()), len(pad), third)
        small = service.head(Request("POST", "/v1/generate", keyed, b"", lib.ep_now_ns()), 20, Recorded())
        service.stop()
        return large, small, third

    large, small, third = asyncio.run(go())
    assert large is not None and large.tenant == "key-1" and small is None  # its dropped body: its tenant pays
    assert third.response.status == 429 and b"large_requests_waiting" in third.response.body
