"""The agent port: what an edge needs from an agent, whether in process or a separate process.

:class:`edgepath.dpu.agent.Agent` (in process) and :class:`edgepath.dpu.agent_client.AgentClient`
(an ``edgepath agent`` process over shared memory) both implement :class:`AgentPort`; the edge
depends on this protocol only.

Both keep their frames in a :class:`~edgepath.dpu.frame_book.FrameBook`.  A frame's life: ``acquire`` ->
the caller writes the request (tokens, header fields) into
``frames`` in place -> ``submit`` -> zero or more non-final :class:`Delivery` (streamed output,
``frames.outputs[index, :count]`` is readable) -> exactly one final delivery (the result header in
``frames.results[index]`` is complete) -> ``release``.  A caller that stops caring (client gone,
deadline passed) calls ``abandon``: it gets no delivery for that frame again, and the agent gives
the frame back to the free list itself once the slot server has let go of it (its final result
arrived, or its link died) -- so nothing of the old request can ever land in the frame's next use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from edgepath.contract.pool import AgentFrames, FrameLayout
from edgepath.dpu.link_state import LinkHealth
from edgepath.native.abi import Status


@dataclass(frozen=True, slots=True)
class Delivery:
    """Output arrived for in-flight frame ``index``: ``count`` tokens are placed so far; ``final``:
    the result header is complete (status, timings) and nothing more will come."""

    index: int
    count: int
    final: bool
    #: the final result of a frame the caller abandoned: ``count`` output tokens were computed for it (what its
    #: request is billed), and the frame is free already -- the caller does not release it
    abandoned: bool = False


@dataclass
class DeliveryStats:
    """Exactly-once accounting: completions that named a frame not (or no longer) in flight."""

    delivered: int = 0  # final deliveries handed to the caller
    duplicates: int = 0  # a second final for a frame already answered
    unknown: int = 0  # a completion for a frame that was never in flight, or for another generation
    abandoned: int = 0  # frames given up by the caller
    late: int = 0  # completions for abandoned frames, from a link given up on after they were sent, or from a server
    # the request moved away from: discarded
    migrated: int = 0  # requests moved to another slot server when theirs went away (each move counted)


@dataclass(frozen=True, slots=True)
class SlotLimits:
    """A tenant's limits on the slots it holds at once, counted from the state words across every edge and pool
    (docs/TENANTS.md): its ``floor`` -- slots it can always have, taken back when lent -- and its ``cap`` -- slots
    it may hold at most (0: none)."""

    floor: int = 0
    cap: int = 0


@dataclass(frozen=True, slots=True)
class SlotServerStatus:
    """One slot server behind a port, as ``/health`` and ``/metrics`` list it; a count the port does not
    know (an agent process does not publish them) is None."""

    health: LinkHealth  # its address, the link's state, why, since when
    free_slots: int | None = None  # free now (0 unless the link is up)
    total_slots: int | None = None  # its slots (as of its last attach)
    claims: int | None = None  # slots this agent claimed there, over every attach
    reattaches: int | None = None  # times it came back and was attached again


class AgentPort(Protocol):
    frames: AgentFrames
    layout: FrameLayout
    delivery_stats: DeliveryStats

    def fileno(self) -> int:
        """Readable when deliveries may be waiting (after :meth:`arm`)."""
        ...

    def arm(self) -> bool:
        """Ask for a wake-up on :meth:`fileno`; True if something is already waiting (poll again)."""
        ...

    def acquire(self) -> int | None:
        """A frame to fill, or None when all are in use (the caller answers 429)."""
        ...

    def set_limits(self, limits: Mapping[int, SlotLimits]) -> None:
        """The slot floors and caps of every tenant that has one, by its id in the state words (the tenants file's:
        docs/TENANTS.md): whose slots above their floor may be taken back for a tenant under its own, and how many
        each may hold.  Limits not given here are learned from the requests that name them."""
        ...

    def early_refusal(self, index: int, tenant: int, floor: int, slots: int = 1) -> Status | None:
        """Before frame ``index`` is filled: NO_SLOT (its figures in the frame's result header) when no claim for
        ``slots`` slots by ``tenant`` (its floor id and floor) can succeed now, whatever the prompt; else None."""
        ...

    def submit(self, index: int) -> Status | None:
        """Send frame ``index``: None when in flight, else the refusal (NO_SLOT, UNAVAILABLE, BAD_REQUEST)."""
        ...

    def submit_group(self, indexes: Sequence[int]) -> Status | None:
        """Send frames ``indexes`` -- one request's choices, the same prompt -- to as many slots of one slot server,
        claimed all or none: None when in flight (an agent process may still refuse them all, through every
        frame's final answer, the first frame's first), else the refusal (the first frame's result header holds
        its figures)."""
        ...

    def poll(self) -> list[Delivery]:
        """What arrived since the last call, without waiting."""
        ...

    def cancel(self, index: int) -> None:
        """Ask the slot running frame ``index`` to stop; its final delivery (CANCELLED, or a result that
        was already on its way) still comes."""
        ...

    def abandon(self, index: int) -> None:
        """Give up on in-flight frame ``index``: cancel it, deliver nothing more, and free the frame
        once the slot server has let go of it -- at once when it was lost with its slot server and not reported
        yet (:meth:`check_links` then never reports it)."""
        ...

    def release(self, index: int) -> None:
        """Give back a frame that is not in flight (answered, or never submitted)."""
        ...

    def check_links(self) -> list[int]:
        """Frames lost with a slot server (or agent process) that went away: answer them 503.  Also where
        slot servers' heartbeats are looked at when nothing else has for a while."""
        ...

    def stalled(self) -> list[int]:
        """Frames in flight on a slot server that became unresponsive, each reported once: answer them 504
        and abandon them (they stay fenced until that server lets go of them or its link is lost)."""
        ...

    def links_health(self) -> list[LinkHealth]:
        """The link to every slot server behind this port: up, unresponsive or down, why, since when."""
        ...

    def revive(self, timeout: float = ...) -> Sequence[object]:
        """Reconnect what went away, if it is back (waiting at most ``timeout`` seconds for each);
        what came back."""
        ...

    def alive(self) -> bool:
        """Whether any slot server is connected (up, or unresponsive)."""
        ...

    def capacity(self) -> FrameLayout:
        """The largest request (input tokens) and answer (output tokens) the data path behind this port
        takes: what the edge's limits may not exceed."""
        ...

    def free_slots(self) -> tuple[int, int]:
        """(free slots on slot servers that are up, all their slots), read now (which looks at the servers'
        heartbeats too)."""
        ...

    def servers(self) -> Sequence[SlotServerStatus]:
        """The slot servers behind this port, one entry each, in the order they were given."""
        ...
