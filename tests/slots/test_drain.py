"""When a draining slot server may exit (sans I/O): once nobody is connected, once idle after telling its agents,
or at the end of its grace period -- never while it runs something and agents wait, within the grace period."""

from __future__ import annotations

from edgepath.slots.drain import NOTICE, Drain


def test_a_busy_server_keeps_serving_within_its_grace_period() -> None:
    drain = Drain(started=100.0, grace=25.0)
    assert drain.over(100.0, idle=False, agents=2) is None
    assert drain.over(124.9, idle=False, agents=2) is None


def test_an_idle_server_exits_once_its_agents_have_had_time_to_notice() -> None:
    drain = Drain(started=100.0, grace=25.0)
    assert drain.over(100.0 + NOTICE / 2, idle=True, agents=1) is None  # an agent may not have looked yet
    assert "every slot is free" in (drain.over(100.0 + NOTICE, idle=True, agents=1) or "")


def test_with_no_agent_connected_it_exits_at_once() -> None:
    assert "no agent" in (Drain(started=100.0, grace=25.0).over(100.0, idle=False, agents=0) or "")


def test_the_grace_period_ends_the_drain_whatever_still_runs() -> None:
    drain = Drain(started=100.0, grace=3.0)
    assert "grace period of 3 s is over" in (drain.over(103.0, idle=False, agents=2) or "")
    assert Drain(started=100.0, grace=0.0).over(100.0, idle=True, agents=1) is not None  # no grace: at once
