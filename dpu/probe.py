"""A slot server checked the way its agents judge it, for a platform's liveness and readiness probes.

A slot server serves no HTTP: what makes it alive to its agents is an attach that verifies its pool (magic, ABI
version, geometry) and a heartbeat word in the pool header that moves within the hang timeout; what makes it
worth claiming on is, besides, that it does not say it drains (SIGTERM). ``edgepath probe ADDRESS`` attaches as
an agent of one frame, reads the heartbeat until it moves (or the hang timeout passes) and lets go: exit 0 when
the slot server passes, 1 with the reason when it does not. Each probe takes one claimant id of the server's 24
bits (16.7 million: over five years of a probe every 10 s)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from edgepath.dpu.agent import Agent
from edgepath.dpu.links import AgentError
from edgepath.transports.base import Transport, TransportError

#: seconds between two reads of the heartbeat while waiting for it to move
READ_INTERVAL = 0.02


@dataclass(frozen=True)
class Verdict:
    """A probe's outcome: whether the slot server passed, and why (one line)."""

    passed: bool
    reason: str


def judge(address: str, moved: bool, stopping: bool, ready: bool, waited: float) -> Verdict:
    """The verdict on an attached slot server: its heartbeat ``moved`` within ``waited`` seconds, it says it is
    ``stopping``; ``ready``: a readiness probe (a draining server is alive, but not ready)."""
    if not moved:
        return Verdict(False, f"{address}: its heartbeat stood still for {waited:.1f} s (the hang timeout)")
    if ready and stopping:
        return Verdict(False, f"{address}: it is draining (stopping): nothing new is claimed there")
    state = "draining, alive" if stopping else "up"
    return Verdict(True, f"{address}: {state} (pool verified, heartbeat moving)")


def probe(
    transport: Transport,
    address: str,
    hang_timeout: float,
    ready: bool = False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Verdict:
    """Attach to the slot server at ``address`` over ``transport`` (closed on return), read its heartbeat until it
    moves or ``hang_timeout`` seconds pass, and judge it (:func:`judge`)."""
    try:
        agent = Agent(transport, frames=1, max_servers=1, hang_timeout=hang_timeout)
        try:
            link = agent.attach(address, timeout=hang_timeout)
        except (AgentError, TransportError) as exc:
            return Verdict(False, f"{address}: cannot attach: {exc}")
        first, start = int(link.beat[0]), clock()
        while True:
            try:
                agent.link_set.refresh(link)
            except TransportError as exc:
                return Verdict(False, f"{address}: reading its pool failed: {exc}")
            waited = clock() - start
            moved = int(link.beat[0]) != first
            if moved or waited >= hang_timeout:
                return judge(address, moved, bool(link.stopping[0]), ready, waited)
            sleep(READ_INTERVAL)
    finally:
        transport.close()


def probe_ledger(transport: Transport, address: str, timeout: float) -> Verdict:
    """Connect to the quota ledger at ``address`` over ``transport`` (closed on return) as an edge does, read one of
    its words by remote compare-and-swap (one that changes nothing), and let go: a ledger's liveness probe."""
    from edgepath.dpu.ledger import LedgerUnavailable, RemoteLedger

    try:
        try:
            ledger = RemoteLedger(transport, address, timeout=timeout)
        except TransportError as exc:
            return Verdict(False, f"{address}: no quota ledger answers: {exc}")
        try:
            ledger.cas(0, 0, 0)
        except LedgerUnavailable as exc:
            return Verdict(False, f"{address}: its words cannot be read: {exc}")
        finally:
            ledger.close()
        return Verdict(True, f"{address}: up (a quota ledger of {ledger.entries} entries, its words read)")
    finally:
        transport.close()
