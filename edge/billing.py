"""What each request that ran is charged -- against its tenant's quota, in the per-tenant metrics and in the usage
log, always the same number -- and when.

A request answered is charged the tokens its answer carries (its ``usage``).  A request the edge gives up on before
an answer -- its client went away, its deadline passed, its slot server stopped responding, another of its choices
failed -- is charged the output tokens the model computed for it: the slot server says how many in the abandoned
frame's final result (:class:`~edgepath.dpu.port.Delivery` ``abandoned``), which comes once it has stopped the
request; until then its reservation stays held.  If that final never comes (the slot server is gone, or holds the
frame past the request timeout), it is charged what the edge had seen by then.  So a client that hangs up near the
end of a long answer pays for what was computed for it, streamed or not, and the quota, ``/metrics`` and the usage
line agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgepath.dpu.port import Delivery
from edgepath.edge.measure import Measure
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.tenancy.gate import TenantGate
from edgepath.edge.tracked import Tracked, output_tokens, prompt_charged, usage_line


@dataclass(slots=True)
class Unsettled:
    """A request given up before its answer, waiting for the count of what was computed for it."""

    t: Tracked
    finish: str  # how it ended: cancelled, timeout, failed
    deadline_ns: int = 0  # charged what the edge had seen if no count has come by then (0: not set yet)


class Billing:
    """The charges of one edge's requests (``gate``: quotas and the usage log; ``measure``: reads a frame's cached
    prompt tokens; ``wait_ns``: how long a request given up waits for its count)."""

    def __init__(self, gate: TenantGate, metrics: EdgeMetrics, measure: Measure, wait_ns: int) -> None:
        self.gate = gate
        self.wait_ns = wait_ns
        self.metrics = metrics
        self.measure = measure
        self.unsettled: dict[int, Unsettled] = {}  # by frame

    def charge(self, t: Tracked, ran: bool, words: int, cached: int, finish: str) -> None:
        """``t`` is charged its prompt and the tokens of ``words`` output words (``ran``: a slot ran it; one that did
        not is charged nothing) and its tenant's hold is settled; its usage (``cached`` prompt tokens from the cache,
        how it ended: ``finish``) goes to the per-tenant metrics and the usage log."""
        completion = output_tokens(t.work, words) if ran else 0
        if t.hold is not None:
            self.gate.settle(t.hold, prompt_charged(t) + completion, ran)
            t.hold = None
        if ran:
            usage = usage_line(t, completion, cached, finish)
            self.metrics.tenant_usage(usage.tenant, finish, usage.prompt_tokens, usage.cached_tokens, completion)
            self.gate.record(usage)

    def defer(self, t: Tracked, finish: str) -> None:
        """``t``'s frame is abandoned: charge it when its slot server says what it computed, or after ``wait_ns``."""
        assert t.frame is not None
        if t.hold is not None:
            self.gate.uncap(t.hold)  # its place under the tenant's slot_cap frees now; its tokens wait for the count
        self.unsettled[t.frame] = Unsettled(t, finish)

    def computed(self, delivery: Delivery) -> None:
        """An abandoned frame's final result: its request is charged what was computed for it (at least what the edge
        had seen, at most its ``max_tokens``).  A frame abandoned after its answer (a stop string the edge saw) was
        charged then: nothing waits for it."""
        owed = self.unsettled.pop(delivery.index, None)
        if owed is None:
            return
        t = owed.t
        words = max(min(delivery.count, t.work.max_tokens), t.sent)
        self.charge(t, True, words, self.measure.cached(t, delivery.index), owed.finish)

    def expire(self, now: int) -> None:
        """Requests whose count has not come by their deadline (``wait_ns`` after the first look at them: ``now``)
        are charged what the edge had seen."""
        for frame, owed in list(self.unsettled.items()):
            if not owed.deadline_ns:
                owed.deadline_ns = now + self.wait_ns
            elif now > owed.deadline_ns:
                del self.unsettled[frame]
                self.charge(owed.t, True, owed.t.sent, 0, owed.finish)
