"""Token quotas, sans I/O with a fake clock: reserved before any work, refused at once over quota with when to
come back, the unused part refunded when the request ends, never more served than the quota."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.edge.quota import Limits, Quotas, Refused, Reservation, headers, reset_text
from edgepath.edge.tenants import Tenant

ACME = Tenant("acme", b"tenant:acme", tokens_per_minute=600)  # 10 tokens a second


def reserve(quotas: Quotas, tokens: int, now: float, tenant: Tenant = ACME) -> Reservation:
    got = quotas.reserve(tenant, tokens, now)
    assert isinstance(got, Reservation), got
    return got


def test_a_tenant_without_quota_is_never_counted() -> None:
    quotas = Quotas()
    free = Tenant("free", b"tenant:free")
    assert quotas.reserve(free, 10**9, 0.0) is None
    assert quotas.limits(free, 0.0) is None


def test_prompt_and_max_tokens_are_reserved_and_the_unused_part_comes_back() -> None:
    quotas = Quotas()
    r = reserve(quotas, 500, 0.0)  # prompt 100 + max_tokens 400
    assert quotas.limits(ACME, 0.0) == Limits(600, 100, 50.0)
    refused = quotas.reserve(ACME, 200, 0.0)
    assert refused == Refused(200, "minute", 600, 100, 10.0)  # 100 more tokens refill in 10 s
    quotas.settle(r, 130, 0.0)  # it used its prompt and 30 tokens
    assert quotas.limits(ACME, 0.0) == Limits(600, 470, 13.0)
    reserve(quotas, 200, 0.0)
    with pytest.raises(ValueError, match="twice"):
        quotas.settle(r, 0, 0.0)


def test_the_bucket_refills_with_time_and_never_beyond_its_limit() -> None:
    quotas = Quotas()
    quotas.settle(reserve(quotas, 600, 0.0), 600, 0.0)
    assert isinstance(quotas.reserve(ACME, 1, 0.0), Refused)
    assert quotas.limits(ACME, 30.0) == Limits(600, 300, 30.0)
    assert quotas.limits(ACME, 1e6) == Limits(600, 600, 0.0)


def test_a_request_larger_than_the_whole_quota_is_never_admitted() -> None:
    refused = Quotas().reserve(ACME, 601, 0.0)
    assert isinstance(refused, Refused) and refused.retry_after == math.inf


def test_the_day_window_binds_too_and_says_when() -> None:
    both = Tenant("both", b"tenant:both", tokens_per_minute=600, tokens_per_day=1000)
    quotas = Quotas()
    quotas.settle(reserve(quotas, 600, 0.0, both), 600, 0.0)
    quotas.settle(reserve(quotas, 400, 60.0, both), 400, 60.0)
    refused = quotas.reserve(both, 100, 120.0)  # the minute has refilled; the day has not
    assert isinstance(refused, Refused) and refused.window == "day" and refused.limit == 1000
    assert refused.retry_after == pytest.approx(100 / (1000 / 86400) - 120, rel=1e-6)  # 2 minutes refilled


def test_a_reloaded_limit_keeps_what_is_spent() -> None:
    quotas = Quotas()
    quotas.settle(reserve(quotas, 500, 0.0), 500, 0.0)
    bigger = Tenant("acme", b"tenant:acme", tokens_per_minute=1200)
    assert quotas.limits(bigger, 0.0) == Limits(1200, 700, 25.0)
    assert quotas.limits(Tenant("acme", b"tenant:acme"), 0.0) is None  # its quota was removed


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 5), st.integers(1, 700), st.floats(0, 1), st.booleans()),
        max_size=60,
    )
)
def test_tokens_served_never_exceed_the_quota_and_a_request_within_it_is_admitted(
    steps: list[tuple[float, int, float, bool]],
) -> None:
    """Over any run: tokens used within any window never exceed the limit plus what refilled during it, and a
    refusal happens only when the request needs more than what is neither used nor reserved."""
    quotas, now, used_total, open_ = Quotas(), 0.0, 0, []
    rate = ACME.tokens_per_minute / 60
    for gap, tokens, fraction, end_one in steps:
        now += gap
        if end_one and open_:
            r = open_.pop(0)
            used = int(r.tokens * fraction)
            used_total += used
            quotas.settle(r, used, now)
        level = quotas.limits(ACME, now)
        assert level is not None
        got = quotas.reserve(ACME, tokens, now)
        if isinstance(got, Refused):
            assert tokens > level.remaining  # refused only when what is left cannot cover it
        else:
            assert isinstance(got, Reservation)
            open_.append(got)
        reserved = sum(r.tokens for r in open_)
        assert used_total + reserved <= ACME.tokens_per_minute + rate * now + 1e-6  # no overshoot, ever


def test_the_headers_are_openais() -> None:
    assert headers(Limits(600, 100, 50.0)) == [
        (b"x-ratelimit-limit-tokens", b"600"),
        (b"x-ratelimit-remaining-tokens", b"100"),
        (b"x-ratelimit-reset-tokens", b"50s"),
    ]
    assert [reset_text(s) for s in (0.0, 0.0201, 1.25, 360.0, 7500.0)] == ["0ms", "21ms", "1.3s", "6m0s", "2h5m0s"]
