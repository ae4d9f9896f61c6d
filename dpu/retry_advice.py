"""When to tell a refused client to come back, sans I/O: at the soonest time it is predicted to be taken, and
never two clients for the same moment.

A refusal (429) says when a retry is predicted to be admitted.  Told alone, that is the moment the work ahead
drains below the bound (``over_bound``) or a slot frees (``no_slot``).  But every client refused in the same
stretch is predicted the same moment: sent back together they find room for one, and the rest are refused again
(issue 34's first run of the retrying phases: 5 % of advised retries admitted).  So the advice is **booked**: each
advised client is counted for the work it brings (its own prompt on the server that would take it, or the time
between two slots freeing), and the next client refused is told to come after the clients advised before it.

Nothing is held: no request waits in the server, a client that does not come back costs nothing but the later
advice of those booked behind it (a booking lapses once its time has passed), and admission never reads the
bookings -- a client that comes back early, or a new one, is admitted whenever the server has room (so no booking
can lock anyone out).  Each advice is stretched by up to ``jitter`` of its own work at random, so clients do not
return in lockstep yet keep their order.  One book per agent: clients refused by other agents are not counted."""

from __future__ import annotations

import random
from collections import deque

#: a refused client's advised retry: at least this long (ms; one model step is about that), at most this long (the
#: openai SDK honours a retry-after-ms of up to 60 s)
RETRY_MIN_MS, RETRY_MAX_MS = 20.0, 60_000.0
#: each advice stretched by up to this share of the work it books, at random
RETRY_JITTER = 0.25


class RetryAdvice:
    """The book of advised returns: ``advise`` answers one refusal and books it."""

    def __init__(
        self,
        rng: random.Random,
        min_ms: float = RETRY_MIN_MS,
        max_ms: float = RETRY_MAX_MS,
        jitter: float = RETRY_JITTER,
    ) -> None:
        if not 0 < min_ms <= max_ms or jitter < 0:
            raise ValueError(f"retry advice: need 0 < min_ms <= max_ms, jitter >= 0; got {min_ms}, {max_ms}, {jitter}")
        self._rng = rng
        self.min_ms, self.max_ms, self.jitter = min_ms, max_ms, jitter
        self._booked: deque[tuple[float, float]] = deque()  # (advised return, its work taken by then), seconds

    def advise(self, now: float, soonest_ms: float, work_ms: float) -> float:
        """Milliseconds from ``now`` (monotonic seconds) after which to tell a refused client to come back: no
        sooner than ``soonest_ms`` (when the server is predicted to have room for it), nor than the clients advised
        before it have been taken; the client is booked for ``work_ms`` of the server's time.  An advice past
        ``max_ms`` is ``max_ms`` and books nothing (the client is not expected back then)."""
        booked = self._booked
        while booked and booked[0][1] <= now:  # bookings whose time and work have passed lapse
            booked.popleft()
        work_s = max(0.0, work_ms) / 1e3
        start = max(now + max(0.0, soonest_ms) / 1e3, booked[-1][1] if booked else now)
        at = start + self._rng.uniform(0.0, self.jitter) * work_s
        ms = (at - now) * 1e3
        if ms >= self.max_ms:
            return self.max_ms
        ms = max(self.min_ms, ms)
        booked.append((now + ms / 1e3, now + ms / 1e3 + work_s))
        return ms

    @property
    def booked(self) -> int:
        """Clients advised and not yet due (as of the last advice)."""
        return len(self._booked)
