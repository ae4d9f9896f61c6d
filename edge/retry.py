"""When a client that retries comes back after a 429: the openai Python SDK's schedule, as it ships
(openai/_base_client.py, ``_calculate_retry_timeout``), so that ``edgepath chat`` and the benchmarks' retrying
users behave as the clients users run: the server's ``retry-after-ms``, else ``Retry-After`` (seconds), when
within 60 s; else 0.5 s x 2^n, at most 8 s, less up to a quarter at random."""

from __future__ import annotations

import random
from collections.abc import Mapping

#: the SDK honours advice up to this long; longer (or none) falls back to its own backoff
RETRY_LIMIT_S = 60.0
INITIAL_DELAY_S = 0.5
MAX_DELAY_S = 8.0
#: the SDK's default ``max_retries``
DEFAULT_RETRIES = 2


def advised_wait(headers: Mapping[str, str]) -> float | None:
    """The server's advice in a 429's headers (names lower-case, as HTTP/3 sends them), in seconds: its
    ``retry-after-ms``, else its ``retry-after`` in seconds; None when there is none that reads as a number."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            return float(headers[name]) * scale
        except (KeyError, ValueError):
            continue
    return None


def retry_delay(advised: float | None, retries_so_far: int, rng: random.Random) -> tuple[float, bool]:
    """How long the SDK waits before its next attempt, and whether that is the server's advice."""
    if advised is not None and 0 < advised <= RETRY_LIMIT_S:
        return advised, True
    delay = min(INITIAL_DELAY_S * 2.0**retries_so_far, MAX_DELAY_S)
    return delay * (1 - 0.25 * rng.random()), False
