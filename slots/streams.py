"""Stream coalescing, sans-I/O: when a running slot's new output tokens go to its agent.

The first token goes at once (time to first token is what a streaming client waits for); later ones are
coalesced within a window, which bounds the progress writes per request without holding any token back
longer than the window.  A request that did not ask for streaming gets only its final result.  Nothing
here writes or reads a clock: the slot server passes ``now`` in and does the writes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class OutputStream:
    """One running slot's output as its agent has heard of it."""

    stream: bool  # the request asked for streamed output
    window: float  # seconds within which tokens after the first are coalesced
    count: int = 0  # output tokens the handler has written
    sent: int = 0  # output tokens announced to the agent
    pushed_at: float = 0.0  # when the last progress went

    def produced(self, count: int) -> bool:
        """The handler reports ``count`` tokens written so far; True for the request's first token."""
        if count <= self.count:
            return False
        first = self.count == 0
        self.count = count
        return first

    def due(self, now: float) -> bool:
        """Whether unannounced tokens should go now."""
        return self.stream and self.count > self.sent and (self.sent == 0 or now - self.pushed_at >= self.window)

    def wait(self, now: float) -> float | None:
        """Seconds until unannounced tokens are due (0 or less: now), None when nothing waits."""
        if not self.stream or self.count <= self.sent:
            return None
        return self.pushed_at + self.window - now

    def pushed(self, now: float) -> None:
        """Every token written so far is announced."""
        self.sent = self.count
        self.pushed_at = now
