"""The open-loop schedules are what they claim to be, and bad specs are refused clearly."""

from __future__ import annotations

import numpy as np
import pytest

from edgepath.bench.schedule import parse, poisson, uniform_gaps


def test_poisson_schedule_has_the_requested_rate_and_exponential_gaps() -> None:
    offsets = poisson(rate=1000.0, count=20_000, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and (gaps >= 0).all()
    assert abs(len(offsets) / offsets[-1] - 1000.0) / 1000.0 < 0.03
    assert abs(np.std(gaps) / np.mean(gaps) - 1.0) < 0.05  # exponential: coefficient of variation 1


def test_uniform_gaps_stay_in_their_bounds() -> None:
    gaps = np.diff(uniform_gaps(0.05, 0.5, 2000, seed=1))
    assert gaps.min() >= 0.05 and gaps.max() <= 0.5
    assert abs(gaps.mean() - 0.275) < 0.02


def test_spec_parsing_and_refusals() -> None:
    assert len(parse("poisson:200", 10)) == 10
    assert np.diff(parse("uniform:50-500", 100)).min() >= 0.05
    with pytest.raises(ValueError, match="unknown schedule"):
        parse("burst:5", 10)
    with pytest.raises(ValueError, match="must be positive"):
        poisson(0, 10)
    with pytest.raises(ValueError, match="low <= high"):
        uniform_gaps(0.5, 0.1, 10)
