"""Bounded exponential back-off (sans-I/O): the delays, their cap, and a retry schedule driven by a fake clock."""

from __future__ import annotations

import pytest

from edgepath.dpu.backoff import Backoff, Retry


def test_the_delay_doubles_from_the_first_to_its_cap() -> None:
    backoff = Backoff(first_delay=0.1, max_delay=0.5)
    assert [backoff.delay(n) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert backoff.delay(10_000) == 0.5  # bounded however long the peer stays away (no float overflow)


@pytest.mark.parametrize(("first", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_a_back_off_that_makes_no_sense_is_refused(first: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < first_delay <= max_delay"):
        Backoff(first, cap)


def test_a_delay_follows_a_failure() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        Backoff().delay(0)


def test_a_retry_is_due_after_each_delay_and_starts_over_once_it_worked() -> None:
    retry = Retry(Backoff(first_delay=1.0, max_delay=4.0))
    assert retry.due(0.0)  # nothing failed yet
    assert retry.failed(10.0) == 1.0 and not retry.due(10.99) and retry.due(11.0)
    assert retry.failed(11.0) == 2.0 and not retry.due(12.99) and retry.due(13.0)
    assert retry.failed(13.0) == 4.0 and retry.failed(17.0) == 4.0  # capped
    assert retry.failures == 4 and retry.next_at == 21.0
    retry.reset()
    assert retry.due(0.0) and retry.failed(30.0) == 1.0  # from the first delay again
