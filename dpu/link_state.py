"""The state of an agent's link to one slot server, sans I/O: up, unresponsive or down, why, since when.

A slot server advances a heartbeat word in its pool header at every turn of its loop (and so after every
model step); the loop never waits longer than its lease-scan interval, so an idle live server beats too.
Whoever reads that word -- the agent, in the same RDMA READ as the state words it reads anyway, or in a
periodic probe -- hands :class:`LinkTracker` the value and the reader's own clock:

* **UP**: attached, and the heartbeat has moved within ``hang_timeout``.
* **UNRESPONSIVE**: the heartbeat has not moved for ``hang_timeout`` seconds.  The server's memory still
  answers one-sided reads and compare-and-swaps (the NIC, or shared memory, does that), but its CPU side
  is frozen: a stuck GPU kernel, a wedged driver, SIGSTOP, a model step far over its budget.  Nothing is
  claimed there; a heartbeat that moves again makes the link UP.
* **DOWN**: the connection ended or an operation on it failed; UP again only by attaching anew.
* **DRAINING**: connected, but no new request is claimed there: the slot server left the agent's source of
  slot servers (:mod:`edgepath.dpu.discovery`) or says it is stopping; what it holds finishes there or moves
  (:meth:`edgepath.dpu.links.LinkSet.settle`).  UP again only when the source names it again.

Only changes of the word count, never its size, and only the reader's clock is used: the server may be
another machine with another clock.  The heartbeat's last move is known to the reader only to within
one observation, so an UNRESPONSIVE verdict is never early: the word really was still for at least
``hang_timeout`` of the reader's time.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from edgepath.transports.base import DEFAULT_HANG_TIMEOUT as DEFAULT_HANG_TIMEOUT  # the agents' default


def check_hang_timeout(seconds: float) -> float:
    """``seconds`` if it can be a hang timeout (positive), else a ValueError saying so."""
    if not seconds > 0:
        raise ValueError(f"hang timeout must be positive seconds, got {seconds}")
    return seconds


class LinkState(enum.Enum):
    """Where a link to a slot server stands (the value is what ``/health`` shows)."""

    UP = "up"
    UNRESPONSIVE = "unresponsive"
    DOWN = "down"
    DRAINING = "draining"


class Reason(enum.IntEnum):
    """Why a link is not UP (a small code, so an agent process can publish it to its edges)."""

    NONE = 0  # UP
    NO_HEARTBEAT = 1  # UNRESPONSIVE: the heartbeat word stood still for the hang timeout
    DISCONNECTED = 2  # DOWN: the connection ended (the server process exited, or dropped us)
    FAILED = 3  # DOWN: an operation on the link failed (a read, a compare-and-swap, a write)
    NOT_ATTACHED = 4  # DOWN: never attached, or attaching again failed
    DROPPED = 5  # DOWN: the agent let go of it (it stood unresponsive; its requests moved to another server)
    DRAINED = 6  # DRAINING, then DOWN: it is being (was) drained -- no claims there; its requests finish or move


_STATE_CODES = {LinkState.UP: 1, LinkState.UNRESPONSIVE: 2, LinkState.DOWN: 3, LinkState.DRAINING: 4}
_STATES = {code: state for state, code in _STATE_CODES.items()}

_REASONS = {
    Reason.NONE: "",
    Reason.DISCONNECTED: "the connection to the slot server ended",
    Reason.FAILED: "an operation on the link to the slot server failed",
    Reason.NOT_ATTACHED: "not attached to the slot server",
    Reason.DROPPED: "the agent let go of the unresponsive slot server and moved its requests",
    Reason.DRAINED: "drained: no new request is claimed there",
}


@dataclass(frozen=True, slots=True)
class LinkHealth:
    """A snapshot of one link: the slot server's address, the link's state, why, since when, and when its
    heartbeat was last seen moving.

    Times are the reader's monotonic seconds.  ``detail`` says more than the reason code where the cause
    is known (a transport error's text)."""

    address: str
    state: LinkState
    reason: Reason
    since: float  # entered this state
    heard: float  # the heartbeat was last seen moving (or the link attached)
    hang_timeout: float
    detail: str = ""

    @property
    def up(self) -> bool:
        return self.state is LinkState.UP

    def words(self) -> tuple[int, int, int, int, int]:
        """This health as integers -- state, reason, since, heard, hang timeout (times in ns) -- for an agent
        process's status region (:class:`~edgepath.contract.wire.AgentStatus`); the detail stays behind."""
        times = (round(self.since * 1e9), round(self.heard * 1e9), round(self.hang_timeout * 1e9))
        return (_STATE_CODES[self.state], int(self.reason), *times)

    @classmethod
    def from_words(cls, address: str, words: Sequence[int]) -> LinkHealth:
        """The health of the link to ``address`` that :meth:`words` published; words never published (or
        caught half-written) read as a link not attached yet."""
        state = _STATES.get(words[0])
        if state is None or words[1] not in Reason._value2member_map_:
            return cls(address, LinkState.DOWN, Reason.NOT_ATTACHED, 0.0, 0.0, words[4] / 1e9 or 1.0)
        return cls(address, state, Reason(words[1]), words[2] / 1e9, words[3] / 1e9, words[4] / 1e9)

    def describe(self, now: float) -> str:
        """One line for a person (``/health``, logs): what is wrong, or ``up``."""
        if self.reason is Reason.NO_HEARTBEAT:
            return f"no heartbeat for {now - self.heard:.1f} s (hang timeout {self.hang_timeout:g} s)"
        text = _REASONS[self.reason] or self.state.value
        return f"{text}: {self.detail}" if self.detail else text


class LinkTracker:
    """One link's state from heartbeat observations (sans I/O: values and ``now`` in, state out)."""

    def __init__(self, address: str, hang_timeout: float, now: float) -> None:
        """A link to the slot server at ``address``, not attached yet (DOWN); ``hang_timeout``: seconds of a
        still heartbeat that make an attached link UNRESPONSIVE."""
        self.address = address
        self.hang_timeout = check_hang_timeout(hang_timeout)
        self._state = LinkState.DOWN
        self._reason = Reason.NOT_ATTACHED
        self._detail = ""
        self._since = now
        self._heard = now
        self._observed = now
        self._beat: int | None = None

    @property
    def state(self) -> LinkState:
        return self._state

    @property
    def observed(self) -> float:
        """When the heartbeat was last read (attach included)."""
        return self._observed

    def health(self) -> LinkHealth:
        return LinkHealth(
            self.address, self._state, self._reason, self._since, self._heard, self.hang_timeout, self._detail
        )

    def attached(self, beat: int, now: float) -> None:
        """Attached (again) to a server whose heartbeat reads ``beat``: UP, the silence counted from now."""
        self._beat, self._heard, self._observed = beat, now, now
        self._enter(LinkState.UP, Reason.NONE, now)

    def observe(self, beat: int, now: float) -> LinkState:
        """The heartbeat word read ``beat`` at ``now``: the link's state after it (a DOWN link stays DOWN, a
        DRAINING one DRAINING: its heartbeat is still recorded, :attr:`heard`)."""
        if self._state is LinkState.DOWN:
            return self._state
        self._observed = max(self._observed, now)
        if beat != self._beat:
            self._beat, self._heard = beat, now
            if self._state is LinkState.UNRESPONSIVE:
                self._enter(LinkState.UP, Reason.NONE, now)
        elif self._state is LinkState.UP and now - self._heard >= self.hang_timeout:
            self._enter(LinkState.UNRESPONSIVE, Reason.NO_HEARTBEAT, now)
        return self._state

    @property
    def heard(self) -> float:
        """When the heartbeat was last seen moving (or the link attached)."""
        return self._heard

    def drain(self, now: float, detail: str = "") -> None:
        """No more claims on this connected link (``detail``: why); a DOWN or DRAINING link is left as it is."""
        if self._state in (LinkState.UP, LinkState.UNRESPONSIVE):
            self._enter(LinkState.DRAINING, Reason.DRAINED, now)
            self._detail = detail

    def undrain(self, now: float) -> None:
        """A DRAINING link may be claimed again: UP (a still heartbeat makes it UNRESPONSIVE as ever)."""
        if self._state is LinkState.DRAINING:
            self._enter(LinkState.UP, Reason.NONE, now)

    def lost(self, reason: Reason, now: float, detail: str = "") -> None:
        """The link is gone (``reason``: DISCONNECTED, FAILED, NOT_ATTACHED, DROPPED); a first loss is kept, later
        ones (the same loss seen again) change nothing."""
        if reason is Reason.NONE or reason is Reason.NO_HEARTBEAT:
            raise ValueError(f"a lost link needs a reason of DOWN, got {reason.name}")
        if self._state is not LinkState.DOWN:
            self._detail = detail
            self._enter(LinkState.DOWN, reason, now)

    def _enter(self, state: LinkState, reason: Reason, now: float) -> None:
        if state is not LinkState.DOWN:
            self._detail = ""
        self._state, self._reason, self._since = state, reason, now


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether a port can serve (some slot server is UP), and if not, the status and reason to show."""

    ready: bool
    status: str  # "ok", "unresponsive" (some server is connected but frozen) or "unavailable"
    reason: str = ""  # empty when ready


def readiness(links: Sequence[LinkHealth], now: float) -> Readiness:
    """The verdict over a port's links at ``now`` (the links' clock): ready when any is UP; else what is
    wrong, naming the unresponsive servers first (they are the ones a restart will fix)."""
    if any(link.up for link in links):
        return Readiness(True, "ok")
    if not links:
        return Readiness(False, "unavailable", "no slot server is attached")
    stuck = [link for link in links if link.state is LinkState.UNRESPONSIVE]
    shown = stuck or links
    reason = "; ".join(f"slot server {link.address}: {link.describe(now)}" for link in shown)
    return Readiness(False, "unresponsive" if stuck else "unavailable", reason)
