"""One quota ledger for a deployment's edges, in a process of its own (``edgepath ledger``): two edge processes
counting in it hold a tenant with quota Q to at most Q in total; its words outlive a restart as stated -- all of
them after a stop (SIGTERM), up to the last save after a kill (SIGKILL), none when nothing was saved -- and while it
is down the edges refuse the tenant (503 ``quota_unavailable``), never serve it unlimited.  docs/TENANTS.md, "One
quota over several edges"."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.supervised import start_serve_tcp
from test_cli_errors import edgepath_fails
from test_serve_quota import generate, tenants_file
from test_serve_tenants import no_flat_keys  # noqa: F401  (autouse: no flat key list from the environment)

from edgepath.builder import data_path_transport
from edgepath.children import Child
from edgepath.config import DataPath
from edgepath.contract import wire
from edgepath.dpu.ledger import RemoteLedger
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT
from edgepath.edge.tenancy.quota import MINUTE_NS, Quotas, Refused, Reservation
from edgepath.edge.tenancy.tenants import Tenant
from edgepath.peer_secret import peer_keys
from edgepath.transports.loopback import LoopbackTransport

pytestmark = pytest.mark.slow  # multi-process: a ledger process, edge processes

S = 10**9
T0 = 1_800_000_000 * S  # the simulated time every reservation below is made at: nothing refills between them
TENANT = Tenant("acme", b"tenant:acme", tokens_per_minute=6000)
RACED = Tenant("raced", b"tenant:raced", tokens_per_minute=60_000)


def ledger(start: Callable[..., Child], address: str, *args: str) -> Child:
    return start("ledger", "--listen", address, *args)


def remaining(address: str) -> int:
    """The tokens TENANT has left at T0 in the ledger at ``address``, read by a fresh edge."""
    transport = LoopbackTransport(peer_keys(None))
    try:
        got = Quotas(RemoteLedger(transport, address)).limits(TENANT, T0)
        assert isinstance(got, dict), got
        return got["tokens"].remaining
    finally:
        transport.close()


def spend(address: str, tokens: int) -> None:
    transport = LoopbackTransport(peer_keys(None))
    try:
        assert isinstance(Quotas(RemoteLedger(transport, address)).reserve(TENANT, tokens, T0), Reservation)
    finally:
        transport.close()


def _hammer(address: str, seconds: float, go: object, out: object) -> None:
    """An edge in a process of its own: reserve 7 tokens as fast as it can for ``seconds`` (and until refused once)."""
    transport = data_path_transport(DataPath("loopback"), DEFAULT_HANG_TIMEOUT)
    quotas = Quotas(RemoteLedger(transport, address))
    out.put("ready")  # type: ignore[attr-defined]
    go.wait()  # type: ignore[attr-defined]
    served = refused = 0
    started = time.monotonic()
    while time.monotonic() < started + (seconds if refused else 60.0):
        got = quotas.reserve(RACED, 7, time.time_ns())
        if isinstance(got, Reservation):
            quotas.settle(got, 7, time.time_ns())
            served += 7
        else:
            assert isinstance(got, Refused), got
            refused += 1
    transport.close()
    out.put((served, refused))  # type: ignore[attr-defined]


def test_two_edge_processes_on_a_ledger_process_are_served_at_most_the_quota_in_total(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    """Q = 60,000 tokens a minute; two edge processes race on it for two seconds: both served, both refused, and
    together served no more than Q plus what refilled meanwhile (overshoot 0)."""
    address = str(tmp_path / "ledger")
    ledger(edgepath_process, address)
    context = multiprocessing.get_context("spawn")
    out, go = context.Queue(), context.Event()
    racers = [context.Process(target=_hammer, args=(address, 2.0, go, out)) for _ in range(2)]
    for racer in racers:
        racer.start()
    assert [out.get(timeout=60) for _ in racers] == ["ready", "ready"]
    start = time.time_ns()
    go.set()
    results = [out.get(timeout=90) for _ in racers]
    end = time.time_ns()
    for racer in racers:
        racer.join(timeout=30)
    limit = RACED.tokens_per_minute
    allowance = limit + wire.bucket_clock(end, limit, MINUTE_NS) - wire.bucket_clock(start, limit, MINUTE_NS)
    served = sum(s for s, _ in results)
    print(f"served {served} ({results[0][0]} + {results[1][0]}) of an allowance of {allowance}")
    assert all(s > 0 and r > 0 for s, r in results), results
    assert limit - 7 < served <= allowance


def test_a_ledger_stopped_keeps_every_word_and_one_killed_what_it_had_saved(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    address, state = str(tmp_path / "ledger"), str(tmp_path / "ledger.state")
    first = ledger(edgepath_process, address, "--state", state, "--save-interval", "3600")
    spend(address, 1000)
    spend(address, 500)
    assert first.stop(signum=signal.SIGTERM) == 0  # a stop: saved as the last thing it does
    second = ledger(edgepath_process, address, "--state", state, "--save-interval", "0.1")
    assert remaining(address) == 6000 - 1500  # nothing forgiven
    spend(address, 2000)
    saved = Path(state).stat().st_mtime_ns
    deadline = time.monotonic() + 10
    while Path(state).stat().st_mtime_ns == saved:  # the next save (every 0.1 s when the words changed)
        assert time.monotonic() < deadline, "no save within 10 s"
        time.sleep(0.05)
    second.kill()
    second.wait(10)
    third = ledger(edgepath_process, address, "--state", state, "--save-interval", "3600")
    assert remaining(address) == 6000 - 3500  # a kill after the save: nothing forgiven either
    spend(address, 700)  # never saved: the next save is an hour away
    third.kill()
    third.wait(10)
    ledger(edgepath_process, address, "--state", state)
    assert remaining(address) == 6000 - 3500  # a kill forgives what was spent since the last save, no more


def test_a_ledger_file_that_is_not_a_ledger_is_refused_at_start(tmp_path: Path) -> None:
    state = tmp_path / "ledger.state"
    state.write_bytes(b"something else")
    line = edgepath_fails(["ledger", "--listen", str(tmp_path / "ledger"), "--state", str(state)], tmp_path)
    assert str(state) in line and "move it away" in line
    line = edgepath_fails(["ledger", "--listen", str(tmp_path / "l"), "--state", str(tmp_path / "no" / "s")], tmp_path)
    assert "--state" in line and "no directory" in line


def test_two_serve_edges_on_a_ledger_process_refuse_past_the_quota_and_fail_closed_while_it_is_down(
    edgepath_process: Callable[..., Child], tmp_path: Path
) -> None:
    """Two ``serve`` processes (their own slot servers, echo) count a tenant of 10 requests a day in one ledger
    process: of 20 requests alternating between them 10 are served, then 429 ``quota_exceeded``.  The ledger
    killed: 503 ``quota_unavailable`` (fail closed), and a tenant without a quota is still served; started again on
    its file: the tenant is still over its quota (429), not forgiven.  An edge started before the ledger waits for
    it (``--quota-wait``)."""
    path = tenants_file(
        tmp_path / "tenants.toml",
        ("acme", "key-a", "requests_per_day = 10"),  # none refills within the test
        ("free", "key-f", ""),
    )
    address, state = str(tmp_path / "ledger"), str(tmp_path / "ledger.state")
    found: list[int] = []
    common = ("--handler", "echo", "--tenants-file", path, "--quota-home", address)
    early = threading.Thread(  # started before the ledger: it waits for it (at most 60 s), then serves
        target=lambda: found.append(start_serve_tcp(edgepath_process, *common, "--quota-wait", "60", timeout=90)[1])
    )
    early.start()
    time.sleep(1.0)
    assert early.is_alive() and not found  # waiting
    home = ledger(edgepath_process, address, "--state", state, "--save-interval", "0.1")
    early.join(timeout=90)
    edges = [*found, start_serve_tcp(edgepath_process, *common)[1]]
    assert len(edges) == 2
    statuses = [generate(edges[i % 2], "key-a") for i in range(20)]
    assert [s for s, _, _ in statuses].count(200) == 10
    assert all(doc["error"]["type"] == "quota_exceeded" for s, doc, _ in statuses if s != 200)
    assert {s for s, _, _ in statuses[:10]} == {200}  # the first ten, through both edges
    time.sleep(0.5)  # saved (every 0.1 s)
    home.kill()
    home.wait(10)
    deadline = time.monotonic() + 10
    while (got := generate(edges[0], "key-a"))[0] != 503:  # noticed within a check interval
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    assert got[1]["error"]["type"] == "quota_unavailable"
    assert generate(edges[1], "key-f")[0] == 200  # no quota: not the ledger's concern
    ledger(edgepath_process, address, "--state", state)
    deadline = time.monotonic() + 15
    while (got := generate(edges[1], "key-a"))[0] == 503:  # the edges connect again
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    assert got[0] == 429 and got[1]["error"]["type"] == "quota_exceeded"  # still spent: not forgiven
