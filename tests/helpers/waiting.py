"""Bounded polling of a condition: the only waiting the tests do (they wait for states, never for a time)."""

from __future__ import annotations

import time
from collections.abc import Callable

INTERVAL = 0.005  # seconds between two looks


def eventually(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether ``condition`` holds within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(INTERVAL)
    return True


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until ``condition`` holds; an AssertionError naming ``what`` after ``timeout`` seconds."""
    if not eventually(condition, timeout):
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
