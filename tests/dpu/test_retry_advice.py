"""The retry advice's book (dpu/retry_advice.py): refused clients told to come back one after another, each for the
work it brings; bookings lapse; nothing past the SDK's limit is booked."""

from __future__ import annotations

import itertools
import random

import pytest

from edgepath.dpu.retry_advice import RetryAdvice


def test_clients_refused_together_are_told_to_come_back_one_after_another() -> None:
    advice = RetryAdvice(random.Random(1), jitter=0.0)
    told = [advice.advise(10.0, 500.0, 300.0) for _ in range(4)]
    assert told == pytest.approx([500.0, 800.0, 1100.0, 1400.0])
    assert advice.booked == 4


def test_the_jitter_stretches_an_advice_by_at_most_a_share_of_its_work_and_keeps_the_order() -> None:
    advice = RetryAdvice(random.Random(3), jitter=0.25)
    told = [advice.advise(0.0, 1000.0, 400.0) for _ in range(50)]
    assert 1000.0 <= told[0] <= 1100.0
    assert all(400.0 <= b - a <= 500.0 + 1e-9 for a, b in itertools.pairwise(told))
    assert len({round(b - a, 6) for a, b in itertools.pairwise(told)}) > 1  # not in lockstep


def test_a_booking_lapses_once_its_time_and_work_have_passed() -> None:
    advice = RetryAdvice(random.Random(1), jitter=0.0)
    assert advice.advise(0.0, 100.0, 200.0) == pytest.approx(100.0)  # booked 0.1-0.3 s
    assert advice.advise(0.2, 0.0, 200.0) == pytest.approx(100.0)  # behind it: at 0.3 s
    assert advice.advise(1.0, 50.0, 10.0) == pytest.approx(50.0)  # both lapsed: the soonest again
    assert advice.booked == 1


def test_the_soonest_time_wins_when_it_is_later_than_the_bookings() -> None:
    advice = RetryAdvice(random.Random(1), jitter=0.0)
    advice.advise(0.0, 100.0, 100.0)
    assert advice.advise(0.0, 5000.0, 100.0) == pytest.approx(5000.0)


def test_an_advice_past_the_limit_is_the_limit_and_books_nothing() -> None:
    advice = RetryAdvice(random.Random(1), max_ms=1000.0, jitter=0.0)
    assert advice.advise(0.0, 900.0, 500.0) == pytest.approx(900.0)
    assert advice.advise(0.0, 0.0, 500.0) == 1000.0  # 1.4 s: past the limit
    assert advice.booked == 1
    assert advice.advise(0.0, 0.0, 0.0) == 1000.0  # still behind the first booking (ends at 1.4 s)


def test_an_advice_is_never_shorter_than_the_floor() -> None:
    assert RetryAdvice(random.Random(1), min_ms=20.0).advise(0.0, 0.0, 0.0) == 20.0


@pytest.mark.parametrize(("min_ms", "max_ms", "jitter"), [(0.0, 10.0, 0.1), (20.0, 10.0, 0.1), (1.0, 10.0, -0.1)])
def test_bad_limits_are_refused(min_ms: float, max_ms: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="retry advice"):
        RetryAdvice(random.Random(1), min_ms, max_ms, jitter)
