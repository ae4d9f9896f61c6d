"""Quotas, sans I/O with a fake clock: reserved before any work, refused at once over quota with when to come
back, the unused part refunded when the request ends, never more served than the quota -- by one edge, and by
two edges whose buckets are the same ledger words (each CAS its own decision)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.contract import wire
from edgepath.dpu.ledger import LedgerUnavailable
from edgepath.edge.tenancy.quota import (
    Ledger,
    Limits,
    LocalLedger,
    Quotas,
    Refused,
    Reservation,
    Unavailable,
    headers,
    reset_text,
)
from edgepath.edge.tenancy.tenants import Tenant

ACME = Tenant("acme", b"tenant:acme", tokens_per_minute=600)  # 10 tokens a second
S = 10**9  # nanoseconds in a second


def reserve(quotas: Quotas, tokens: int, now: float, tenant: Tenant = ACME, requests: int = 1) -> Reservation:
    got = quotas.reserve(tenant, tokens, int(now * S), requests)
    assert isinstance(got, Reservation), got
    return got


def limits(quotas: Quotas, now: float, tenant: Tenant = ACME, unit: str = "tokens") -> Limits:
    got = quotas.limits(tenant, int(now * S))
    assert isinstance(got, dict), got
    return got[unit]


def test_a_tenant_without_quota_is_never_counted() -> None:
    quotas = Quotas()
    free = Tenant("free", b"tenant:free")
    assert quotas.reserve(free, 10**9, 0) is None
    assert quotas.limits(free, 0) is None


def test_prompt_and_max_tokens_are_reserved_and_the_unused_part_comes_back() -> None:
    quotas = Quotas()
    r = reserve(quotas, 500, 0.0)  # prompt 100 + max_tokens 400
    assert r.limits == {"tokens": Limits(600, 100, 50.0)} == {"tokens": limits(quotas, 0.0)}
    refused = quotas.reserve(ACME, 200, 0)
    assert isinstance(refused, Refused)
    assert (refused.need, refused.unit, refused.window, refused.limit, refused.remaining) == (
        200,
        "tokens",
        "minute",
        600,
        100,
    )
    assert refused.retry_after == pytest.approx(10.0)  # 100 more tokens refill in 10 s
    quotas.settle(r, 130, 0)  # it used its prompt and 30 tokens
    assert limits(quotas, 0.0) == Limits(600, 470, 13.0)
    reserve(quotas, 200, 0.0)
    with pytest.raises(ValueError, match="twice"):
        quotas.settle(r, 0, 0)


def test_a_request_that_never_ran_gives_everything_back() -> None:
    tenant = Tenant("acme", b"tenant:acme", tokens_per_minute=600, requests_per_minute=2)
    quotas = Quotas()
    r = reserve(quotas, 500, 0.0, tenant)
    assert limits(quotas, 0.0, tenant, "requests") == Limits(2, 1, 30.0)
    quotas.settle(r, 0, 0, ran=False)
    assert limits(quotas, 0.0, tenant) == Limits(600, 600, 0.0)
    assert limits(quotas, 0.0, tenant, "requests") == Limits(2, 2, 0.0)


def test_the_bucket_refills_with_time_and_never_beyond_its_limit() -> None:
    quotas = Quotas()
    quotas.settle(reserve(quotas, 600, 0.0), 600, 0)
    assert isinstance(quotas.reserve(ACME, 1, 0), Refused)
    assert limits(quotas, 30.0) == Limits(600, 300, 30.0)
    assert limits(quotas, 1e6) == Limits(600, 600, 0.0)


def test_a_request_larger_than_the_whole_quota_is_never_admitted() -> None:
    refused = Quotas().reserve(ACME, 601, 0)
    assert isinstance(refused, Refused) and refused.retry_after == math.inf


def test_the_day_window_binds_too_says_when_and_the_minute_gets_back_what_it_gave() -> None:
    both = Tenant("both", b"tenant:both", tokens_per_minute=600, tokens_per_day=1000)
    quotas = Quotas()
    quotas.settle(reserve(quotas, 600, 0.0, both), 600, 0)
    quotas.settle(reserve(quotas, 400, 60.0, both), 400, 60 * S)
    refused = quotas.reserve(both, 100, 120 * S)  # the minute has refilled; the day has not
    assert isinstance(refused, Refused) and refused.window == "day" and refused.limit == 1000
    # Whole tokens refill: in 2 minutes 1 of the day's (one each 86.4 s); 99 more to come.
    assert refused.remaining == 1 and refused.retry_after == pytest.approx(99 * 86.4)
    assert limits(quotas, 120.0, both) == Limits(600, 600, 0.0)  # the minute's 100 given back at once


def test_a_refusal_says_every_units_state() -> None:
    tenant = Tenant("both", b"tenant:both", tokens_per_minute=600, requests_per_day=10)
    quotas = Quotas()
    refused = quotas.reserve(tenant, 700, 0)
    assert isinstance(refused, Refused) and refused.unit == "tokens"
    assert refused.limits == {"tokens": Limits(600, 600, 0.0), "requests": Limits(10, 10, 0.0)}


def test_requests_per_minute_count_requests_whatever_their_tokens() -> None:
    tenant = Tenant("r", b"tenant:r", requests_per_minute=3)
    quotas = Quotas()
    for _ in range(3):
        reserve(quotas, 10_000, 0.0, tenant)
    refused = quotas.reserve(tenant, 1, 0)
    assert isinstance(refused, Refused) and (refused.need, refused.unit, refused.remaining) == (1, "requests", 0)
    assert refused.retry_after == pytest.approx(20.0)  # one request refills every 20 s
    assert refused.limits == {"requests": Limits(3, 0, 60.0)}
    assert isinstance(quotas.reserve(tenant, 1, 0, requests=0), Reservation)  # a further choice of one request


def test_a_reloaded_limit_keeps_what_is_spent() -> None:
    quotas = Quotas()
    quotas.settle(reserve(quotas, 500, 0.0), 500, 0)
    bigger = Tenant("acme", b"tenant:acme", tokens_per_minute=1200)
    assert limits(quotas, 0.0, bigger) == Limits(1200, 700, 25.0)
    assert quotas.limits(Tenant("acme", b"tenant:acme"), 0) is None  # its quota was removed
    smaller = Tenant("acme", b"tenant:acme", tokens_per_minute=300)
    assert limits(quotas, 0.0, smaller) == Limits(300, 0, 60.0)  # spent more than the new limit: none left


class Unreachable:
    """A ledger whose words cannot be reached after ``ops`` operations."""

    def __init__(self, ledger: Ledger, ops: int) -> None:
        self.entries, self.ledger, self.ops = ledger.entries, ledger, ops

    def cas(self, word: int, expected: int, desired: int) -> int:
        self.ops -= 1
        if self.ops < 0:
            raise LedgerUnavailable("ledger at /nowhere: gone")
        return self.ledger.cas(word, expected, desired)


def test_an_unreachable_ledger_refuses_and_keeps_what_it_could_not_give_back() -> None:
    both = Tenant("both", b"tenant:both", tokens_per_minute=600, tokens_per_day=1000)
    words = LocalLedger()
    quotas = Quotas(Unreachable(words, 3))  # the minute's key and bucket, the day's key: then gone
    got = quotas.reserve(both, 100, 0)
    assert isinstance(got, Unavailable) and "gone" in got.why
    assert quotas.lost_refunds == 100  # the minute's 100 could not be given back: charged, never served
    assert limits(Quotas(words), 0.0, both) == Limits(600, 500, 10.0)


def test_a_full_ledger_is_unavailable_not_unlimited() -> None:
    quotas = Quotas(LocalLedger(entries=1))
    reserve(quotas, 1, 0.0)
    other = Tenant("other", b"tenant:other", tokens_per_minute=600)
    got = quotas.reserve(other, 1, 0)
    assert isinstance(got, Unavailable) and "entries" in got.why


def test_the_bucket_word_counts_from_the_clock_and_wraps_harmlessly() -> None:
    period = 60 * S
    clock = wire.bucket_clock(2**70, 600, period)
    assert 0 <= clock < 2**64
    word = wire.bucket_word(clock, 500)
    assert wire.bucket_debt(word, clock) == 500
    assert wire.bucket_debt(word, (clock + 600) & (2**64 - 1)) == -100  # refilled: full, with room to spare
    assert wire.bucket_debt(0, clock) == 0  # an entry never used: full


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 1), st.floats(0, 5), st.integers(1, 700), st.floats(0, 1), st.booleans()),
        max_size=80,
    )
)
def test_two_edges_on_one_ledger_never_serve_more_than_the_quota_and_refuse_only_when_it_is_spent(
    steps: list[tuple[int, float, int, float, bool]],
) -> None:
    """Two edges, each its own :class:`Quotas` over the same words, take turns in any order: tokens used plus
    reserved never exceed the limit plus what refilled, and a refusal happens only when what neither edge has
    used or reserved cannot cover the request."""
    words = LocalLedger()
    edges = (Quotas(words), Quotas(words))
    now, used_total, open_ = 0.0, 0, [[], []]  # type: ignore[var-annotated]
    rate = ACME.tokens_per_minute / 60
    for edge, gap, tokens, fraction, end_one in steps:
        now += gap
        ns = int(now * S)
        if end_one and open_[edge]:
            r = open_[edge].pop(0)
            used = int(r.tokens * fraction)
            used_total += used
            edges[edge].settle(r, used, ns)
        left = limits(edges[1 - edge], now).remaining  # what the other edge reads from the words now
        got = edges[edge].reserve(ACME, tokens, ns)
        if isinstance(got, Refused):
            assert tokens > left  # refused only when what is left cannot cover it
        else:
            assert isinstance(got, Reservation)
            open_[edge].append(got)
        reserved = sum(r.tokens for edge_open in open_ for r in edge_open)
        assert used_total + reserved <= ACME.tokens_per_minute + rate * now + 1e-6  # no overshoot, ever


def test_the_headers_are_openais() -> None:
    assert headers({"tokens": Limits(600, 100, 50.0), "requests": Limits(60, 59, 1.0)}) == [
        (b"x-ratelimit-limit-tokens", b"600"),
        (b"x-ratelimit-remaining-tokens", b"100"),
        (b"x-ratelimit-reset-tokens", b"50s"),
        (b"x-ratelimit-limit-requests", b"60"),
        (b"x-ratelimit-remaining-requests", b"59"),
        (b"x-ratelimit-reset-requests", b"1s"),
    ]
    assert [reset_text(s) for s in (0.0, 0.0201, 1.25, 360.0, 7500.0)] == ["0ms", "21ms", "1.3s", "6m0s", "2h5m0s"]


def test_an_edge_that_dies_holding_reservations_costs_its_tenant_at_most_those_until_they_refill() -> None:
    words = LocalLedger()
    dying, living = Quotas(words), Quotas(words)
    for _ in range(3):
        reserve(dying, 100, 0.0)  # in flight when its edge is killed: never settled
    assert limits(living, 0.0).remaining == 300  # charged as if wholly used: never more served
    assert isinstance(living.reserve(ACME, 300, 0), Reservation)
    assert limits(living, 60.0).remaining == 600  # refilled within the window: the loss is bounded and ends
