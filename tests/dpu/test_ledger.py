"""The quota ledger over a real transport (loopback here, verbs in the soft-RoCE lane): two edges -- two transport
endpoints, and two processes racing -- CAS the buckets of one home, serve no more than the quota between them and
never refuse a tenant under it; a home that goes away fails closed and is reconnected to when it is back."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import pytest

from edgepath.builder import data_path_transport
from edgepath.config import DataPath
from edgepath.contract import wire
from edgepath.dpu.ledger import LedgerHome, RemoteLedger
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT
from edgepath.edge.tenancy.quota import MINUTE_NS, Quotas, Refused, Reservation, Unavailable
from edgepath.edge.tenancy.tenants import Tenant
from edgepath.transports.base import Transport, TransportError
from edgepath.transports.peer_auth import UNKNOWN_SECRET, PeerKeys, PeerRefused
from edgepath.transports.registry import make_transport

pytestmark = pytest.mark.transport

S = 10**9
GREEDY = Tenant("greedy", b"tenant:greedy", tokens_per_minute=6000, requests_per_minute=600)
MODEST = Tenant("modest", b"tenant:modest", tokens_per_minute=6000)


def test_two_edges_over_two_simulated_minutes_serve_at_most_the_quota_and_refuse_no_tenant_under_it(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> None:
    """Two edges share one ledger for 120 simulated seconds, a step a tenth of a second.  A greedy tenant asks for
    twice its quota (two requests of 10 tokens a step: 12,000 a minute of its 6,000), spread over both edges; a
    modest one for half of its own (10 tokens every other step).  Requests end one to three steps later, using a
    third to all of what they reserved, the rest given back.  At every step the greedy tenant's tokens served and
    reserved are within its quota (the full bucket it started with plus what refilled since); the modest one is
    never refused."""
    address = new_address("ledger")
    home = LedgerHome(new_transport(), address)
    edges = [Quotas(RemoteLedger(new_transport(), address)) for _ in range(2)]
    start = 1_700_000_000 * S  # any Unix time
    served = {"greedy": 0, "modest": 0}
    refused = {"greedy": 0, "modest": 0}
    open_: list[tuple[int, int, Reservation, int]] = []  # (ends at step, edge, reservation, tokens it uses)
    limit = GREEDY.tokens_per_minute
    for tick in range(1201):
        now = start + tick * S // 10
        for ending in [o for o in open_ if o[0] <= tick]:
            _, edge, reservation, used = ending
            edges[edge].settle(reservation, used, now)
            served[reservation.tenant] += used
            open_.remove(ending)
        asks = [(GREEDY, 0), (GREEDY, 1)] + ([(MODEST, tick % 4 // 2)] if tick % 2 == 0 else [])
        for tenant, edge in asks:
            got = edges[edge].reserve(tenant, 10, now)
            if isinstance(got, Refused):
                refused[tenant.name] += 1
            else:
                assert isinstance(got, Reservation), got
                open_.append((tick + 1 + tick % 3, edge, got, 10 * (1 + tick % 3) // 3))
        reserved = sum(r.tokens for _, _, r, _ in open_ if r.tenant == "greedy")
        refilled = wire.bucket_clock(now, limit, MINUTE_NS) - wire.bucket_clock(start, limit, MINUTE_NS)
        assert served["greedy"] + reserved <= limit + refilled  # overshoot 0, at every step
    assert refused["modest"] == 0
    assert refused["greedy"] > 0  # it did ask for more than its quota
    assert served["greedy"] > 0.6 * (limit + 2 * limit)  # and got it (ends use two thirds of a request on average)
    home.close()


RACED = Tenant("raced", b"tenant:raced", tokens_per_minute=60_000)  # 1,000 a second


def _hammer(data_path: DataPath, address: str, seconds: float, go: Any, out: Any) -> None:
    """One edge in a process of its own, with a transport endpoint of its own of the chosen kind: once ``go`` is
    set, reserve as fast as it can for ``seconds`` and until it has been refused once (a slow transport -- verbs
    in an emulated VM -- may take longer to spend the bucket; a minute at most), each request using all it
    reserved; what it was served (and how often refused) goes to ``out``."""
    transport = data_path_transport(data_path, DEFAULT_HANG_TIMEOUT)
    quotas = Quotas(RemoteLedger(transport, address))
    tenant = RACED
    out.put("ready")
    go.wait()
    served = refused = 0
    started = time.monotonic()
    while time.monotonic() < started + (seconds if refused else 60.0):
        got = quotas.reserve(tenant, 7, time.time_ns())
        if isinstance(got, Reservation):
            quotas.settle(got, 7, time.time_ns())
            served += 7
        else:
            assert isinstance(got, Refused)
            refused += 1
    transport.close()
    out.put((served, refused))


def test_two_edge_processes_racing_on_one_bucket_never_serve_more_than_it_holds(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str], data_path: DataPath
) -> None:
    """Two processes CAS the same bucket as fast as they can for two seconds, or until refused (real clocks, started
    together): both are served, both are refused once it is spent, and together they are served no more than the
    bucket's limit plus what refilled in that time."""
    address = new_address("ledger")
    home = LedgerHome(new_transport(), address)
    context = multiprocessing.get_context("spawn")
    out, go = context.Queue(), context.Event()
    racers = [context.Process(target=_hammer, args=(data_path, address, 2.0, go, out)) for _ in range(2)]
    for racer in racers:
        racer.start()
    assert [out.get(timeout=60) for _ in racers] == ["ready", "ready"]
    start = time.time_ns()
    go.set()
    results = [out.get(timeout=90) for _ in racers]
    end = time.time_ns()
    for racer in racers:
        racer.join(timeout=30)
    served = sum(s for s, _ in results)
    limit = RACED.tokens_per_minute
    allowance = limit + (wire.bucket_clock(end, limit, MINUTE_NS) - wire.bucket_clock(start, limit, MINUTE_NS))
    assert all(s > 0 and r > 0 for s, r in results), results  # both were served, both were refused: they raced
    assert served <= allowance
    assert served > limit - 7  # and the bucket was used whole
    home.close()


def test_a_home_that_goes_fails_closed_and_a_home_back_is_connected_to_again(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> None:
    address = new_address("ledger")
    home = LedgerHome(new_transport(), address)
    ledger = RemoteLedger(new_transport(), address)
    quotas = Quotas(ledger)
    now = time.time_ns()
    assert isinstance(quotas.reserve(GREEDY, 100, now), Reservation)
    home.close()
    deadline = time.monotonic() + 10
    while not isinstance(got := quotas.reserve(GREEDY, 100, now), Unavailable):  # noticed at the next check
        assert time.monotonic() < deadline, got
        time.sleep(0.02)
    assert address in got.why
    assert quotas.reserve(Tenant("free", b"tenant:free"), 100, now) is None  # no quota: not its concern
    home = LedgerHome(new_transport(), address)  # back, every bucket full
    deadline = time.monotonic() + 10
    while not isinstance(got := quotas.reserve(GREEDY, 100, now), Reservation):
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    assert ledger.reconnects == 1 and got.limits["tokens"].remaining == 5900
    home.close()


def test_an_address_where_no_home_listens_is_an_error_at_once(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> None:
    with pytest.raises(TransportError):
        RemoteLedger(new_transport(), new_address("nobody"), timeout=1.0)


def test_a_home_started_from_the_words_another_kept_goes_on_from_what_was_spent(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> None:
    """What ``edgepath ledger --state`` does across a restart, over the transport: the words a home had (a copy, as
    its file keeps them) are the next home's before any edge connects, so what was spent stays spent."""
    address = new_address("ledger")
    now = 1_800_000_000 * S  # one instant: nothing refills between the two homes
    home = LedgerHome(new_transport(), address)
    assert isinstance(Quotas(RemoteLedger(new_transport(), address)).reserve(GREEDY, 2500, now), Reservation)
    kept = home.words()
    home.close()
    home = LedgerHome(new_transport(), new_address("ledger-again"), words=kept)
    got = Quotas(RemoteLedger(new_transport(), home.address)).limits(GREEDY, now)
    assert isinstance(got, dict) and got["tokens"].remaining == 6000 - 2500
    home.close()


def test_an_edge_without_the_peer_secret_is_refused_and_counted_and_one_with_it_counts_on(
    new_transport: Callable[[], Transport],
    new_address: Callable[[str], str],
    transport_name: str,
    transport_options: dict[str, Any],
) -> None:
    """The issue-50 attacker on the ledger (zero a bucket, fill every entry) must first prove it holds the secret."""
    address = new_address("ledger")
    home = LedgerHome(new_transport(), address)
    stranger = make_transport(transport_name, PeerKeys(b"x" * 32, "a stranger's"), **transport_options)
    try:
        with pytest.raises(PeerRefused) as refused:
            RemoteLedger(stranger, address, timeout=20.0)
        assert refused.value.reason == UNKNOWN_SECRET
        deadline = time.monotonic() + 10
        while home.refused != 1:
            assert time.monotonic() < deadline, "the refusal was not counted"
            time.sleep(0.02)
        assert home.edges == 0
        quotas = Quotas(RemoteLedger(new_transport(), address))
        assert isinstance(quotas.reserve(GREEDY, 100, time.time_ns()), Reservation)
        assert home.edges == 1
    finally:
        stranger.close()
        home.close()
