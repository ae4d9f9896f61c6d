"""The thread governor's arithmetic (model/threads.py) and its reading of /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgepath.model.threads import CpuSample, ThreadGovernor, read_sample


def sample(at: float, waited: float = 0.0, idle: float = 0.0) -> CpuSample:
    return CpuSample(waited_s=waited, idle_s=idle, at=at)


SLOW = 0.001  # a calibration's time for a 100 ms step that makes it 100x slow: slower than any thread count goes


def test_a_step_whose_threads_waited_for_cpus_and_went_slow_sends_the_next_to_fewer_threads() -> None:
    governor = ThreadGovernor(4)
    # 4 threads, a 100 ms step, 0.2 s waited in the run queue: half of 4 x 0.1 s -> the CPUs of two threads
    assert governor.after_step(sample(0.0), sample(0.1, waited=0.2), SLOW) == 2
    assert governor.last_wait == pytest.approx(0.5) and governor.last_ratio == pytest.approx(100)
    # waiting below the share (0.25) moves nothing; on 1 thread there is nothing left to give up
    assert governor.after_step(sample(0.1, 0.2), sample(0.2, 0.2 + 0.04), SLOW) == 2
    assert governor.after_step(sample(0.2, 0.24), sample(0.3, 0.24 + 0.2), SLOW) == 1
    assert governor.after_step(sample(0.3, 0.44), sample(0.4, 0.44 + 0.1), SLOW) == 1


def test_a_neighbour_that_only_slows_the_steps_keeps_every_thread() -> None:
    """Threads that waited half the step, but the step took 1.25x the calibration's time, less than one thread
    of two is expected to take (2x): giving a thread up would only make it slower."""
    governor = ThreadGovernor(2)
    assert governor.after_step(sample(0.0), sample(0.1, waited=0.1), 0.08) == 2
    assert governor.last_ratio == pytest.approx(1.25)
    # one slow step among fast ones moves the ratio by WEIGHT of its excess: 3x once, after 1.0x ...
    assert governor.ratios[2] == pytest.approx(1.0 + ThreadGovernor.WEIGHT * 0.25)
    assert governor.after_step(sample(0.1, 0.1), sample(0.2, 0.2), 0.1 / 3) == 2
    # ... but what steps on one thread were seen to take is the measure: had they gone at 1.2x, 2 threads go slower
    governor.ratios[1] = 1.2
    assert governor.after_step(sample(0.2, 0.2), sample(0.3, 0.3), 0.08) == 1
    # and steps on one thread teach it how fast they go
    governor.after_step(sample(0.3, 0.3), sample(0.4, 0.3), 0.05)
    assert governor.ratios[1] == pytest.approx(1.2 + ThreadGovernor.WEIGHT * (2.0 - 1.2))


def test_a_step_too_short_to_tell_moves_nothing() -> None:
    governor = ThreadGovernor(2)
    assert governor.after_step(sample(0.0), sample(0.001, waited=0.002), SLOW / 100) == 2


def test_all_threads_come_back_once_cpus_have_been_idle_for_the_hold() -> None:
    governor = ThreadGovernor(2, hold=1.0)
    assert governor.after_step(sample(0.0), sample(0.1, waited=0.2), SLOW) == 1
    # 0.5 s later: a CPU idle all along, but not for the hold yet
    assert governor.after_step(sample(0.5, 0.2, idle=0.4), sample(0.6, 0.2, idle=0.5), SLOW) == 1
    # over 1.0 s since the drop only 0.4 CPU idle on average: stays on 1, and the window starts again
    assert governor.after_step(sample(1.0, 0.2, 0.45), sample(1.1, 0.2, 0.4), SLOW) == 1
    assert governor.last_idle == pytest.approx(0.4)
    # the next second, 0.9 CPUs idle: back to 2
    assert governor.after_step(sample(2.0, 0.2, 1.2), sample(2.1, 0.2, 1.3), SLOW) == 2
    assert governor.last_idle == pytest.approx(0.9)
    assert governor.last_window == pytest.approx(1.0)


def test_a_raise_taken_back_at_once_doubles_the_hold_and_one_that_lasts_resets_it() -> None:
    governor = ThreadGovernor(2, hold=1.0, hold_max=8.0)
    one = 0.05  # a step on one thread at twice the calibration's time, as one thread of two goes
    governor.after_step(sample(0.0), sample(0.1, waited=0.2), SLOW)
    assert governor.after_step(sample(1.0, 0.2, 1.0), sample(1.1, 0.2, 1.1), one) == 2  # raised at 1.1
    assert governor.after_step(sample(1.2, 0.2, 1.1), sample(1.3, 0.3, 1.1), SLOW) == 1  # 0.1 s later: taken back
    assert governor.hold == 2.0
    # a second of idle CPU is no longer enough: two are
    assert governor.after_step(sample(2.2, 0.3, 2.0), sample(2.3, 0.3, 2.1), one) == 1
    assert governor.after_step(sample(3.3, 0.3, 3.0), sample(3.4, 0.3, 3.2), one) == 2  # raised at 3.4
    assert governor.after_step(sample(11.5, 0.3, 3.2), sample(11.6, 0.3, 3.2), one) == 2  # lasted hold_max: reset
    assert governor.hold == 1.0


def fake_proc(root: Path, waits: dict[str, int], stat: str | None) -> str:
    for task, waited in waits.items():
        (root / "self" / "task" / task).mkdir(parents=True)
        (root / "self" / "task" / task / "schedstat").write_text(f"123456 {waited} 7\n")
    if stat is not None:
        (root / "stat").write_text(stat)
    return str(root)


def test_read_sample_sums_its_threads_run_queue_time_and_the_machines_idle_and_iowait(tmp_path: Path) -> None:
    root = fake_proc(tmp_path, {"100": 1_500_000_000, "101": 250_000_000}, "cpu  10 0 20 400 100 0 0 0 0 0\n")
    got = read_sample(5.0, root)
    assert got == CpuSample(waited_s=1.75, idle_s=500 / os.sysconf("SC_CLK_TCK"), at=5.0)


def test_read_sample_is_none_where_the_kernel_keeps_no_such_figures(tmp_path: Path) -> None:
    assert read_sample(1.0, fake_proc(tmp_path, {"100": 5}, None)) is None


def test_read_sample_reads_this_machine() -> None:
    first = read_sample(0.0)
    assert first is not None and first.waited_s >= 0 and first.idle_s > 0
    second = read_sample(1.0)
    assert second is not None and second.idle_s >= first.idle_s
