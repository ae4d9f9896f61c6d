"""Open-loop send schedules: precomputed before the first request, so the load never waits on the system.

Latency is measured from each request's *scheduled* time, not from when it was actually sent, so
a stalled system cannot hide its stall by slowing the client down (no coordinated omission).
"""

from __future__ import annotations

import numpy as np


def poisson(rate: float, count: int, seed: int = 0) -> np.ndarray:
    """Send offsets (seconds from start) of a Poisson process at ``rate`` requests/s."""
    if rate <= 0 or count <= 0:
        raise ValueError(f"rate and count must be positive, got rate={rate}, count={count}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.cumsum(gaps) - gaps[0]


def uniform_gaps(low: float, high: float, count: int, seed: int = 0) -> np.ndarray:
    """Send offsets with independent gaps drawn uniformly from [low, high] seconds."""
    if not 0 <= low <= high or count <= 0:
        raise ValueError(f"need 0 <= low <= high and count > 0, got low={low}, high={high}, count={count}")
    gaps = np.random.default_rng(seed).uniform(low, high, size=count)
    return np.cumsum(gaps) - gaps[0]


def parse(spec: str, count: int, seed: int = 0) -> np.ndarray:
    """``poisson:RATE`` or ``uniform:LOW_MS-HIGH_MS``."""
    kind, _, arg = spec.partition(":")
    if kind == "poisson":
        return poisson(float(arg), count, seed)
    if kind == "uniform":
        low, _, high = arg.partition("-")
        return uniform_gaps(float(low) / 1e3, float(high) / 1e3, count, seed)
    raise ValueError(f"unknown schedule {spec!r}: use poisson:RATE or uniform:LOW_MS-HIGH_MS")
