"""The data path over a wire: the agent and the slot server on two soft-RoCE devices joined by a veth
pair, each device with its own address (set up inside the lane's VM by ``tests/softroce/wire``,
which passes ``--wire FILE``), first clean, then under faults injected on the wire with ``tc netem``:
loss, delay, and the wire cut for a few seconds; then ``edgepath serve`` on the agent's side in front of
two slot servers on the other (issue 21's failover across the wire): one killed and restarted, the same
under 1% loss, and the slot side's link taken down and up.

Every scenario checks what must hold whatever the wire does: each request is answered exactly
once, nothing is duplicated or late, every slot is FREE afterwards; and what the wire costs: the
latency of each request (submit -> final answer) goes to the lane's results file.  Elsewhere (no
``--wire``) these tests skip: the host kernel has no RDMA."""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import failover
from helpers.procs import slot_states
from helpers.supervised import Load, scrape, series
from helpers.tokenizers import byte_tokenizer
from helpers.waiting import wait_for

from edgepath.children import Child, free_port
from edgepath.dma.registry import make_transport
from edgepath.dma.transport import Access
from edgepath.dma.verbs_setup import ACK_TIMEOUT
from edgepath.dpu.agent_client import AgentClient
from edgepath.dpu.frame import write_request
from edgepath.native.abi import State, Status

pytestmark = pytest.mark.slow

SLOTS, TOKENS, FRAMES, WINDOW = 8, 64, 32, 8
# A CLAIMED slot's lease must outlast the wire's retransmissions, or the slot server drops a late doorbell
# as a stale writer's (and nobody answers the request).  edgepath sets the ACK timeout to 4.096 us * 2^14 =
# 67 ms (rdma_cm alone gives 2.1 s, past the default 1 s lease); 20 s still covers rdma_cm's whole retry
# budget, so these tests do not depend on that setting.
LEASE_S = 20
_ports = iter(range(7500, 7600))


@dataclass(frozen=True)
class Side:
    """One end of the wire: its RDMA device, GID index, address and veth."""

    device: str
    gid_index: int
    addr: str
    netdev: str

    def flags(self) -> list[str]:
        return ["--data-path", "verbs", "--device", self.device, "--gid-index", str(self.gid_index)]


@dataclass
class Wire:
    """The topology ``tests/softroce/wire`` built, and where the results go."""

    agent: Side
    slot: Side
    results: Path
    tmp: Path

    def record(self, scenario: str, data: dict[str, Any]) -> None:
        """Merge ``data`` into the results file under ``scenario`` (the lane prints it)."""
        old = json.loads(self.results.read_text()) if self.results.exists() else {}
        old[scenario] = data
        self.results.write_text(json.dumps(old, indent=1))

    def probe_options(self) -> dict[str, Any]:
        """Transport options for a probe on the agent's side (reads the slot server's state words)."""
        return {"device": self.agent.device, "gid_index": self.agent.gid_index}


@pytest.fixture(scope="module")
def wire(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Wire:
    path = request.config.getoption("--wire")
    if path is None:
        pytest.skip("needs the two-device wire of the soft-RoCE lane (tests/softroce/wire sets it up, --wire FILE)")
    spec = json.loads(Path(path).read_text())
    return Wire(
        Side(**spec["agent"]),
        Side(**spec["slot"]),
        Path(spec["results"]),
        tmp_path_factory.mktemp("wire"),
    )


def _run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout


def _tx_packets(netdev: str) -> int:
    return int(Path(f"/sys/class/net/{netdev}/statistics/tx_packets").read_text())


def _netem_drops(netdev: str) -> int:
    """Packets the netem qdisc on ``netdev`` dropped so far."""
    return sum(int(q.get("drops", 0)) for q in json.loads(_run("tc", "-s", "-j", "qdisc", "show", "dev", netdev)))


@contextlib.contextmanager
def netem(wire: Wire, *spec: str) -> Iterator[None]:
    """``tc netem SPEC`` on both ends' egress (so both directions), removed afterwards."""
    try:
        for side in (wire.agent, wire.slot):
            _run("tc", "qdisc", "replace", "dev", side.netdev, "root", "netem", *spec)
        yield
    finally:
        for side in (wire.agent, wire.slot):
            subprocess.run(["tc", "qdisc", "del", "dev", side.netdev, "root"], capture_output=True, timeout=30)


def wire_cut(wire: Wire, seconds: float) -> Callable[[], None]:
    """A fault: the wire passes nothing for ``seconds`` (netem drops every packet both ways); links
    and routes stay up, as when a cable or a switch between two hosts fails."""

    def act() -> None:
        with netem(wire, "loss", "100%"):
            time.sleep(seconds)

    return act


@dataclass
class Pair:
    """A slot server on the slot side of the wire and an agent on the agent side, as processes."""

    server_addr: str
    agent_addr: str
    children: list[Child]

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def start_pair(wire: Wire) -> Pair:
    server_addr = f"{wire.slot.addr}:{next(_ports)}"
    agent_addr = str(wire.tmp / f"agent-{server_addr.rsplit(':', 1)[1]}.sock")
    sizes = ["--input-capacity", str(TOKENS), "--output-capacity", str(TOKENS)]
    children = [
        Child.start(
            [
                "slot-server",
                *wire.slot.flags(),
                "--listen",
                server_addr,
                "--slots",
                str(SLOTS),
                "--lease",
                str(LEASE_S),
                *sizes,
            ],
            ready_timeout=120,
        )
    ]
    try:
        children.append(
            Child.start(
                [
                    "agent",
                    *wire.agent.flags(),
                    "--slot-server",
                    server_addr,
                    "--listen",
                    agent_addr,
                    "--frames",
                    str(2 * FRAMES),
                    "--frames-per-edge",
                    str(FRAMES),
                    *sizes,
                ],
                ready_timeout=120,
            )
        )
    except Exception:
        children[0].stop()
        raise
    return Pair(server_addr, agent_addr, children)


@pytest.fixture(scope="module")
def pair(wire: Wire) -> Iterator[Pair]:
    """One slot server and agent for the scenarios that keep the connection (run in file order)."""
    p = start_pair(wire)
    yield p
    p.stop()


@dataclass
class Run:
    """What a bounded run of requests through the agent came to."""

    requests: int
    answers: np.ndarray  # answers per request (must all be 1)
    status: np.ndarray  # final status per request (-1: none)
    latency_ns: np.ndarray  # submit -> final answer, per answered request
    mismatches: int  # OK answers whose tokens differ from the request's (echo handler)
    stats: Any  # the client's DeliveryStats
    wall_s: float
    fault_at_s: float | None

    def summary(self) -> dict[str, Any]:
        ms = self.latency_ns[self.latency_ns > 0] / 1e6
        counts = collections.Counter(Status(int(s)).name if s >= 0 else "NONE" for s in self.status)
        quantiles = {f"p{q}_ms": round(float(np.percentile(ms, q)), 2) for q in (50, 90, 99)} if ms.size else {}
        return {
            "requests": self.requests,
            "status": dict(counts),
            **quantiles,
            "max_ms": round(float(ms.max()), 1) if ms.size else None,
            "over_1s": int((ms > 1000).sum()),
            "unanswered": int((self.answers == 0).sum()),
            "wall_s": round(self.wall_s, 1),
            "fault_at_s": None if self.fault_at_s is None else round(self.fault_at_s, 2),
        }

    def check_exactly_once(self, allowed: set[Status]) -> None:
        """Every request answered once, with an allowed status; nothing duplicated, unknown or late."""
        answered = int((self.answers > 0).sum())
        assert answered == self.requests, f"only {answered} of {self.requests} answered: {self.summary()}"
        assert (self.answers == 1).all(), "a request was answered more than once"
        stats = self.stats
        assert (stats.delivered, stats.duplicates, stats.unknown, stats.late) == (self.requests, 0, 0, 0), stats
        got = {Status(int(s)) for s in np.unique(self.status)}
        assert got <= allowed, f"statuses {sorted(s.name for s in got)}, allowed {sorted(s.name for s in allowed)}"
        assert self.mismatches == 0, f"{self.mismatches} answers carried other tokens than their request's"


def drive(agent_addr: str, requests: int, fault: Callable[[], None] | None = None, budget: float = 240.0) -> Run:
    """``requests`` echo requests through the agent, ``WINDOW`` in flight; ``fault`` runs in a thread
    once a fifth of them were sent, so it hits requests in flight.  Bounded by ``budget`` seconds."""
    client = AgentClient(agent_addr)
    rng = np.random.default_rng(requests)
    payload = rng.integers(0, 131_072, size=(requests, TOKENS), dtype=np.int32)
    answers = np.zeros(requests, dtype=np.int64)
    status = np.full(requests, -1)
    sent_at = np.zeros(requests, dtype=np.int64)
    latency = np.zeros(requests, dtype=np.int64)
    in_flight: dict[int, int] = {}
    sent = answered = mismatches = 0
    thread: threading.Thread | None = None
    fault_at = None
    start = time.monotonic()
    deadline = start + budget
    try:
        while answered < requests and time.monotonic() < deadline:
            if fault is not None and thread is None and sent >= requests // 5:
                thread = threading.Thread(target=fault, name="fault", daemon=True)
                fault_at = time.monotonic() - start
                thread.start()
            while sent < requests and len(in_flight) < WINDOW and (index := client.acquire()) is not None:
                write_request(client.frames, index, payload[sent], request_id=sent, max_new_tokens=TOKENS)
                sent_at[sent] = time.perf_counter_ns()
                assert client.submit(index) is None, "the agent process went away"
                in_flight[index] = sent
                sent += 1
            for index in [d.index for d in client.poll(timeout=0.5) if d.final]:
                rid = in_flight.pop(index)
                latency[rid] = time.perf_counter_ns() - sent_at[rid]
                res = client.frames.results[index]
                answers[rid] += 1
                status[rid] = int(res["status"])
                if status[rid] == Status.OK:
                    n = int(res["output_count"])
                    mismatches += int(res["request_id"]) != rid or not np.array_equal(
                        client.frames.outputs[index, :n], payload[rid]
                    )
                answered += 1
                client.release(index)
        wall = time.monotonic() - start
        if thread is not None:
            thread.join(budget)
        return Run(requests, answers, status, latency, mismatches, client.delivery_stats, wall, fault_at)
    finally:
        client.close()


def check_slots_free(wire: Wire, pair: Pair) -> None:
    states = slot_states(pair.server_addr, SLOTS, "verbs", wire.probe_options())
    assert all(s == State.FREE for s in states), f"slots not FREE after the run: {states}"


# -- the transport alone ---------------------------------------------------------------


def test_the_transport_crosses_the_wire_between_the_two_devices(wire: Wire) -> None:
    """CAS, WRITE_WITH_IMM, write + doorbell and READ from the agent's device to the slot side's, each
    seen on the veths, each waited for by its own completion."""
    server = make_transport("verbs", device=wire.slot.device, gid_index=wire.slot.gid_index)
    client = make_transport("verbs", device=wire.agent.device, gid_index=wire.agent.gid_index)
    try:
        pool = server.register("pool", 4096, Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC)
        local = client.register("local", 4096, Access.NONE)
        listener = server.listen(f"{wire.slot.addr}:{next(_ports)}", [pool], {})
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(conn=listener.accept(timeout=30.0)), daemon=True)
        thread.start()
        conn = client.connect(listener.address, [], {}, timeout=30.0)
        thread.join(30.0)
        assert box.get("conn") is not None
        from pyverbs import enums as e

        attr, _ = conn.qp.query(e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY)
        assert attr.timeout == ACK_TIMEOUT, f"ACK timeout exponent {attr.timeout}, set {ACK_TIMEOUT} at RTS"
        remote = conn.remote["pool"]
        before = {side.netdev: _tx_packets(side.netdev) for side in (wire.agent, wire.slot)}
        assert conn.compare_and_swap(remote, 0, 0, 41) == 0
        assert conn.compare_and_swap(remote, 0, 0, 42) == 41  # failed: the word is 41
        local.buf[:256] = np.arange(256, dtype=np.uint8)
        for i in range(50):
            conn.write_with_imm(local, 0, remote, 1024, 256, i)
        for i in range(20):
            conn.write_then_imm(local, 0, remote, 1024, 256, 256, 3072, 8, 50 + i)
        conn.read(local, 2048, remote, 1024, 256)
        # Each operation waited for its own completion and left none behind for the next one.
        assert conn.scq.poll(16)[0] == 0
        got, deadline = 0, time.monotonic() + 30
        while got < 70 and time.monotonic() < deadline:
            got += len(server.cq.wait(1.0))
        after = {side.netdev: _tx_packets(side.netdev) for side in (wire.agent, wire.slot)}
        assert got == 70
        assert bytes(pool.buf[1024:1280]) == bytes(range(256)) == bytes(local.buf[2048:2304])
        # 93 requests (CAS, WRITE, READ) go out on the agent's veth, and an ACK or response per request
        # comes back on the slot side's.
        assert after[wire.agent.netdev] - before[wire.agent.netdev] >= 93, (before, after)
        assert after[wire.slot.netdev] - before[wire.slot.netdev] >= 73, (before, after)
        wire.record(
            "qp",
            {
                "timeout": attr.timeout,
                "timeout_ms": round(4.096 * 2**attr.timeout / 1000, 1),
                "retry_cnt": attr.retry_cnt,
                "rnr_retry": attr.rnr_retry,
            },
        )
    finally:
        client.close()
        server.close()


# -- the data path: agent and slot server processes on either side ------------------------


def test_clean_wire_every_request_answered_once(wire: Wire, pair: Pair) -> None:
    before = _tx_packets(wire.agent.netdev)
    run = drive(pair.agent_addr, 300, budget=60)
    wire.record("clean", run.summary())
    run.check_exactly_once({Status.OK, Status.NO_SLOT})
    assert (run.status == Status.OK).sum() > 0
    # Claim, request + doorbell and the slot server's answer cross the veth for each OK request.
    assert _tx_packets(wire.agent.netdev) - before >= (run.status == Status.OK).sum()
    check_slots_free(wire, pair)


def test_one_percent_loss_each_way_retransmits_and_loses_nothing(wire: Wire, pair: Pair) -> None:
    with netem(wire, "loss", "1%"):
        run = drive(pair.agent_addr, 200, budget=150)
        drops = {side.netdev: _netem_drops(side.netdev) for side in (wire.agent, wire.slot)}
    wire.record("loss 1% each way", {**run.summary(), "netem_drops": drops})
    assert sum(drops.values()) > 0, "netem dropped nothing: the scenario did not test loss"
    run.check_exactly_once({Status.OK, Status.NO_SLOT})
    check_slots_free(wire, pair)


def test_added_delay_shows_in_every_answer(wire: Wire, pair: Pair) -> None:
    with netem(wire, "delay", "5ms"):
        run = drive(pair.agent_addr, 100, budget=60)
    wire.record("delay 5 ms each way", run.summary())
    run.check_exactly_once({Status.OK, Status.NO_SLOT})
    ok = run.latency_ns[run.status == Status.OK]
    # A request needs at least its claim's round trip and its write's: 2 x 10 ms.
    assert ok.size and ok.min() >= 20e6, f"fastest answer {ok.min() / 1e6:.1f} ms under a 10 ms round trip"
    check_slots_free(wire, pair)


def test_wire_cut_for_two_seconds_delays_requests_in_flight_and_loses_none(wire: Wire, pair: Pair) -> None:
    """A cut well inside one operation's 4 s wait is ridden out (the operation in flight at the cut completed
    about 0.85 s after a 3 s cut ended: within 0.1 s of that wait, so a 3 s cut sometimes took the link down)."""
    run = drive(pair.agent_addr, 200, fault=wire_cut(wire, 2.0), budget=60)
    wire.record("wire cut 2 s", run.summary())
    run.check_exactly_once({Status.OK, Status.NO_SLOT})
    assert run.latency_ns.max() >= 2e9, "no request waited out the cut: the fault missed the traffic"
    check_slots_free(wire, pair)


# -- serve across the wire: two slot servers on the far side, one killed, loss, the link down and up ----------


@dataclass
class Served:
    """``edgepath serve`` (HTTP/1.1 at ``port``) on the agent's side of the wire, in front of two slot servers
    on the other side (``a`` first); ``restart`` starts a slot server at ``a`` again."""

    port: int
    a: str
    b: str
    first: Child
    restart: Callable[[], Child]


@pytest.fixture(scope="module")
def served(wire: Wire) -> Iterator[Served]:
    """One edge and its slot servers for the failover scenarios (run in file order, each leaving both up)."""
    children: list[Child] = []

    def start(*args: str) -> Child:
        children.append(Child.start(args, ready_timeout=failover.START_S))
        return children[-1]

    def slot_server(address: str) -> Child:
        return start(
            "slot-server", *wire.slot.flags(), "--listen", address, "--slots", str(failover.SLOTS),
            "--lease", str(LEASE_S), "--handler", "echo",
        )  # fmt: skip

    a, b = (f"{wire.slot.addr}:{next(_ports)}" for _ in range(2))
    first = slot_server(a)
    slot_server(b)
    port = free_port(socket.SOCK_STREAM)
    tokenizer = byte_tokenizer(wire.tmp / "tokenizer.json")
    try:
        start(
            "serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--tokenizer", str(tokenizer),
            "--frames", "64", *wire.agent.flags(), "--slot-server", a, "--slot-server", b,
        )  # fmt: skip
        yield Served(port, a, b, first, lambda: slot_server(a))
    finally:
        for child in reversed(children):
            child.stop()


def _slots_free(wire: Wire, served: Served) -> bool:
    return all(
        all(s == State.FREE for s in slot_states(address, failover.SLOTS, "verbs", wire.probe_options()))
        for address in (served.a, served.b)
    )


def _kill_and_restart(served: Served) -> failover.KillRun:
    run = failover.kill_one_and_bring_it_back(served.port, served.first, served.a, served.b, served.restart)
    served.first = run.restarted
    return run


@pytest.mark.timeout(900)  # processes start slowly in the emulated VM
def test_serve_across_the_wire_survives_a_killed_slot_server_and_uses_it_again(wire: Wire, served: Served) -> None:
    run = _kill_and_restart(served)
    wire.record("serve: slot server killed", run.summary())
    run.check()
    wait_for(lambda: _slots_free(wire, served), 60, "every slot FREE on both slot servers")


@pytest.mark.timeout(900)  # processes start slowly in the emulated VM
def test_serve_across_the_wire_under_one_percent_loss_survives_a_killed_slot_server(wire: Wire, served: Served) -> None:
    """Loss delays what it hits by the ACK timeout; nothing is lost or answered twice, and the failover holds."""
    with netem(wire, "loss", "1%"):
        run = _kill_and_restart(served)
        drops = {side.netdev: _netem_drops(side.netdev) for side in (wire.agent, wire.slot)}
    wire.record("serve: slot server killed, loss 1% each way", {**run.summary(), "netem_drops": drops})
    assert sum(drops.values()) > 0, "netem dropped nothing: the scenario did not test loss"
    run.check(slowest=None)  # latency under loss is measured (recorded above), not bounded
    wait_for(lambda: _slots_free(wire, served), 60, "every slot FREE on both slot servers")


@pytest.mark.timeout(900)  # processes start slowly in the emulated VM
def test_serve_across_the_wire_rides_the_slot_side_link_down_and_up(wire: Wire, served: Served) -> None:
    """Both slot servers behind one link: while it is down every request is answered 503 (those in flight
    when it went, and new ones at once once both links are known down); when it is up again (and the
    route its going down removed is back, as a routing daemon would put it) both are re-attached on their
    own and serve, and every request was answered exactly once."""
    port, a, b = served.port, served.a, served.b
    down_s = 3.0
    route = f"{wire.agent.addr}/32 dev {wire.slot.netdev} src {wire.slot.addr}"  # as tests/softroce/wire made it
    before = {address: failover.listing(port)[address]["reattaches"] for address in (a, b)}
    counted = failover.generated(scrape(port))
    with Load(port, threads=3, max_requests=4000, max_seconds=600) as load:
        wait_for(lambda: load.count >= 50, 60, "requests before the link goes down")
        down_at = time.monotonic()
        _run("ip", "link", "set", wire.slot.netdev, "down")
        try:
            wait_for(lambda: {s["state"] for s in failover.listing(port).values()} == {"down"}, 60, "both links down")
            detected = time.monotonic()
            wait_for(lambda: len(load.sent_after(detected)) >= 20, 60, "requests while the link is down")
            time.sleep(max(0.0, down_at + down_s - time.monotonic()))  # the fault lasts its time, at least
        finally:
            _run("ip", "link", "set", wire.slot.netdev, "up")
            _run("ip", "route", "replace", *route.split())
        up_at = time.monotonic()
        wait_for(lambda: {s["state"] for s in failover.listing(port).values()} == {"up"}, 120, "both back up")
        back = time.monotonic()
        claimed = {address: failover.claims(port, address) for address in (a, b)}
        wait_for(lambda: all(failover.claims(port, x) >= claimed[x] + 5 for x in (a, b)), 60, "both claimed again")
    answers = load.answers
    text = scrape(port)
    assert {x.status for x in answers} <= {200, 503, 429}, {x.status for x in answers}
    assert failover.generated(text) - counted == len(answers), "an answer missing or counted twice"
    # A second completion for a frame the edge already answered is fenced by the port (counted, dropped: no
    # client gets two answers, checked above). Two of five lane runs saw one here when the link came back up;
    # why it is sent is not understood yet, so it is recorded rather than allowed to pass unseen.
    fenced = series(text, "edgepath_port_duplicates_total") or 0.0
    assert (series(text, "edgepath_port_unknown_total") or 0.0) == 0
    while_down = [x for x in answers if detected < x.sent and x.answered < up_at]
    assert while_down and all(x.status == 503 for x in while_down), {x.status for x in while_down}
    assert all(x.status == 200 for x in answers if x.sent > back), "not every request after the re-attach got 200"
    listed = failover.listing(port)
    assert all(listed[x]["reattaches"] == before[x] + 1 for x in (a, b)), listed
    seconds = np.array([x.seconds for x in while_down]) * 1e3
    wire.record(
        "serve: slot-side link down and up",
        {
            "requests": len(answers),
            "status": dict(collections.Counter(str(x.status) for x in answers)),
            "detected_s": round(detected - down_at, 2),
            "link_down_s": round(up_at - down_at, 2),
            "back_after_up_s": round(back - up_at, 2),
            "while_down_p50_ms": round(float(np.percentile(seconds, 50)), 1),
            "while_down_max_ms": round(float(seconds.max()), 1),
            "port_duplicates_fenced": fenced,
        },
    )
    wait_for(lambda: _slots_free(wire, served), 60, "every slot FREE on both slot servers")
