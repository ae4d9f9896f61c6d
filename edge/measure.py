"""What the edge measures of one request as its answer comes back: time to first token and inter-token latency, the
wait for the first token against the agent's prediction, the return path's cost, and the prompt tokens its slot
server took from its prefix cache.  Read from the frame's headers (the model side's stamps, same host clock) and
written to the request's timings (``Server-Timing``) and the edge's metrics.
"""

from __future__ import annotations

from edgepath.contract import wire
from edgepath.contract.pool import AgentFrames
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.tracked import Tracked


class Measure:
    """The measurements of one edge's requests (``frames``: the agent port's frames, whose headers hold the stamps)."""

    def __init__(self, frames: AgentFrames, metrics: EdgeMetrics) -> None:
        self.frames = frames
        self.metrics = metrics

    def sent(self, t: Tracked, req: wire.RequestHeader, t1: int, t2: int) -> None:
        """``t`` was submitted at ``t1`` and the port answered at ``t2``: its claim and doorbell times (or, when a
        slot is being taken back for it, when it waits from: it is sent at the hand-over, its claim timed then), and
        what the agent predicted for it."""
        written = req.t_written_ns
        if written:
            t.timings["claim"] = written - t1
            t.timings["doorbell"] = t2 - written
        else:
            t.handover_from = t1
        if req.predicted_ttft_us:
            t.timings["predicted_ttft"] = req.predicted_ttft_us * 1000
            t.timings["predicted_wait"] = req.predicted_wait_us * 1000

    def progress(self, t: Tracked, new: int, now: int) -> None:
        """A delivery of ``new`` output tokens before the end: the prompt tokens cached (placed with every progress
        word), the token timings, and for a stream -- whose headers leave with its first tokens and say when that
        was -- its first-token time and wait."""
        if t.cached_first < 0 and t.frame is not None:
            t.cached_first = self.frames.result_headers[t.frame].cached_tokens
        self.first_tokens(t, new, now)
        if t.work.stream:
            first_ns = now - t.request.t_receive_ns
            t.timings.setdefault("first_token", first_ns)
            self.waited(t, first_ns, now)

    def stopped(self, t: Tracked, frame: int, now: int) -> tuple[int, int]:
        """``t`` ended at a stop string the edge saw: its cached prompt tokens and its time to first token."""
        cached = self.cached(t, frame)
        first_ns = t.t_first_ns - t.request.t_receive_ns
        t.timings["first_token"] = first_ns
        self.waited(t, first_ns, now)
        if t.choice == 0:
            self.metrics.prompt(t.input_count, cached)
        return cached, first_ns

    def edge(self, t: Tracked, frame: int, now: int) -> None:
        """The edge's part of ``t``'s time: received -> the slot server saw it ready."""
        edge_ns = self.frames.result_headers[frame].t_ready_ns - self.frames.request_headers[frame].t_receive_ns
        t.timings["edge"] = edge_ns
        self.metrics.edge(edge_ns, now)

    def final(self, t: Tracked, frame: int, new: int, now: int) -> tuple[int, int]:
        """``t`` finished on its slot with ``new`` output tokens not seen before: its cached prompt tokens and its
        time to first token -- streamed: when the first token left the edge; whole: the model side's own
        first-token time when it reports one (same host clock), else when the edge first saw output."""
        cached = self.cached(t, frame)
        if t.choice == 0:
            self.metrics.prompt(t.input_count, cached)
        if new > 0:
            self.first_tokens(t, new, now)
        model_first = self.frames.result_headers[frame].t_first_ns
        first_at = t.t_first_ns if t.work.stream else (model_first or t.t_first_ns)
        first_ns = first_at - t.request.t_receive_ns if first_at else 0
        if first_ns:
            t.timings["first_token"] = first_ns
            self.waited(t, first_ns, now)
        return cached, first_ns

    def cached(self, t: Tracked, frame: int) -> int:
        """Prompt tokens of ``t`` its slot server took from its prefix cache (placed with every progress word).  A
        request that moved (its server gone, its slot taken back: docs/MIGRATION.md) was sent again with its answer
        so far after its prompt, and that placement counts over both -- its own KV reused, more than its prompt: its
        first placement's count, seen with its first output, else no more than its prompt."""
        cached = int(self.frames.result_headers[frame].cached_tokens)
        if not self.frames.request_headers[frame].migrations:
            return cached
        return t.cached_first if t.cached_first >= 0 else min(cached, t.input_count)

    def first_tokens(self, t: Tracked, new: int, now: int) -> None:
        """Time to first token and inter-token latency (a delivery of ``new`` tokens after a gap
        counts as ``new`` tokens spaced evenly over it)."""
        if t.t_first_ns == 0:
            t.t_first_ns = now
            if t.choice == 0:  # a request's time to first token, once for its n choices
                self.metrics.first_token(now - t.request.t_receive_ns, now)
        else:
            self.metrics.inter_token((now - t.t_last_ns) / new, new)
        t.t_last_ns = now

    def waited(self, t: Tracked, first_ns: int, now: int) -> None:
        """Measure the request's wait for its first token, once: its time to first token (``first_ns``) minus
        what its own uncached prompt takes on an idle server, as the model side's cost model says (sent with
        the first token); with the agent's prediction, for the prediction's error."""
        if t.waited or t.frame is None or first_ns <= 0:
            return
        t.waited = True
        written = self.frames.request_headers[t.frame].t_written_ns
        if t.handover_from and written >= t.handover_from:  # the claim: taking the slot back and the hand-over
            t.timings["claim"] = written - t.handover_from
        own = self.frames.result_headers[t.frame].prefill_us * 1000
        wait = max(0, first_ns - own)
        t.timings["wait"] = wait
        if t.choice == 0:
            self.metrics.waited(wait, t.timings.get("predicted_ttft", 0), first_ns, now)

    def return_path(self, t: Tracked, frame: int, now: int) -> None:
        """The return path's cost for a stream's first token: the model side stamped when it produced it
        (same host clock); ``now`` is when its event goes to the transport (in ``Server-Timing`` as ``return``)."""
        produced = self.frames.result_headers[frame].t_first_ns
        if 0 < produced <= now:
            t.timings["return"] = now - produced
            self.metrics.return_path(now - produced)
