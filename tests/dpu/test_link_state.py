"""A link's state from heartbeat observations (sans-I/O): up, unresponsive after a still heartbeat, up again
when it moves, down when lost -- driven with a fake clock, so every transition is exact."""

from __future__ import annotations

import pytest

from edgepath.dpu.link_state import LinkHealth, LinkState, LinkTracker, Readiness, Reason, readiness


def attached(timeout: float = 3.0, beat: int = 7, now: float = 100.0) -> LinkTracker:
    tracker = LinkTracker("pool", timeout, now)
    tracker.attached(beat, now)
    return tracker


def test_a_new_tracker_is_down_until_attached() -> None:
    tracker = LinkTracker("pool", 3.0, 10.0)
    assert tracker.health() == LinkHealth("pool", LinkState.DOWN, Reason.NOT_ATTACHED, 10.0, 10.0, 3.0)
    assert tracker.observe(1, 11.0) is LinkState.DOWN  # observations do not attach
    tracker.attached(1, 12.0)
    assert tracker.health() == LinkHealth("pool", LinkState.UP, Reason.NONE, 12.0, 12.0, 3.0)


def test_a_still_heartbeat_is_unresponsive_exactly_at_the_hang_timeout() -> None:
    tracker = attached(3.0, beat=7, now=100.0)
    assert tracker.observe(7, 102.999) is LinkState.UP
    assert tracker.observe(7, 103.0) is LinkState.UNRESPONSIVE
    health = tracker.health()
    assert (health.state, health.reason, health.since, health.heard) == (
        LinkState.UNRESPONSIVE,
        Reason.NO_HEARTBEAT,
        103.0,
        100.0,
    )
    assert health.describe(104.5) == "no heartbeat for 4.5 s (hang timeout 3 s)"


def test_the_silence_counts_from_the_last_move_seen() -> None:
    tracker = attached(3.0, beat=1, now=0.0)
    assert tracker.observe(2, 2.0) is LinkState.UP  # moved: heard at 2.0
    assert tracker.observe(2, 4.9) is LinkState.UP
    assert tracker.observe(2, 5.0) is LinkState.UNRESPONSIVE
    assert tracker.health().heard == 2.0


def test_any_change_of_the_word_counts_even_backwards() -> None:
    """Only changes count, never the size: a wrapped or reset counter is still a beat."""
    tracker = attached(1.0, beat=2**64 - 1, now=0.0)
    assert tracker.observe(0, 0.9) is LinkState.UP
    assert tracker.observe(0, 2.0) is LinkState.UNRESPONSIVE


def test_a_heartbeat_that_moves_again_makes_the_link_up_from_then() -> None:
    tracker = attached(1.0, beat=5, now=0.0)
    tracker.observe(5, 1.5)
    assert tracker.observe(6, 8.0) is LinkState.UP
    health = tracker.health()
    assert (health.reason, health.since, health.heard) == (Reason.NONE, 8.0, 8.0)
    assert tracker.observe(6, 8.5) is LinkState.UP


def test_an_unresponsive_link_stays_so_and_keeps_its_since() -> None:
    tracker = attached(1.0, beat=5, now=0.0)
    tracker.observe(5, 1.0)
    tracker.observe(5, 30.0)
    assert tracker.health().since == 1.0  # the supervisor measures how long it has been so from here


def test_a_lost_link_is_down_with_the_first_reason_and_ignores_observations() -> None:
    tracker = attached(1.0, beat=5, now=0.0)
    tracker.observe(5, 1.0)
    tracker.lost(Reason.DISCONNECTED, 2.0)
    tracker.lost(Reason.FAILED, 3.0, "read failed")  # the same loss seen again
    assert tracker.observe(6, 4.0) is LinkState.DOWN
    health = tracker.health()
    assert (health.state, health.reason, health.since) == (LinkState.DOWN, Reason.DISCONNECTED, 2.0)
    assert health.describe(5.0) == "the connection to the slot server ended"
    tracker.attached(9, 6.0)  # a new server (epoch) at the same address
    assert tracker.health() == LinkHealth("pool", LinkState.UP, Reason.NONE, 6.0, 6.0, 1.0)


def test_a_loss_with_detail_says_it() -> None:
    tracker = attached()
    tracker.lost(Reason.FAILED, 101.0, "compare-and-swap: connection reset")
    assert tracker.health().describe(102.0) == (
        "an operation on the link to the slot server failed: compare-and-swap: connection reset"
    )


def test_an_observation_from_the_past_does_not_move_the_read_time_back() -> None:
    tracker = attached(3.0, beat=1, now=10.0)
    tracker.observe(1, 12.0)
    tracker.observe(1, 11.0)  # read before, reported after (another thread's read)
    assert tracker.observed == 12.0


@pytest.mark.parametrize("reason", [Reason.NONE, Reason.NO_HEARTBEAT])
def test_a_loss_needs_a_reason_of_down(reason: Reason) -> None:
    with pytest.raises(ValueError, match="a lost link needs a reason of DOWN"):
        attached().lost(reason, 1.0)


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_the_hang_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(ValueError, match="hang timeout must be positive seconds"):
        LinkTracker("pool", timeout, 0.0)


def health(state: LinkState, reason: Reason, address: str = "pool", heard: float = 0.0) -> LinkHealth:
    return LinkHealth(address, state, reason, 1.0, heard, 3.0)


def test_a_port_is_ready_when_any_link_is_up() -> None:
    links = [health(LinkState.DOWN, Reason.DISCONNECTED), health(LinkState.UP, Reason.NONE)]
    assert readiness(links, 9.0) == Readiness(True, "ok")


def test_an_unresponsive_server_is_named_first_with_how_long_it_has_been_still() -> None:
    links = [
        health(LinkState.DOWN, Reason.DISCONNECTED, "a"),
        health(LinkState.UNRESPONSIVE, Reason.NO_HEARTBEAT, "b", heard=2.0),
    ]
    assert readiness(links, 7.5) == Readiness(
        False, "unresponsive", "slot server b: no heartbeat for 5.5 s (hang timeout 3 s)"
    )


def test_with_every_server_down_each_says_why() -> None:
    links = [health(LinkState.DOWN, Reason.DISCONNECTED, "a"), health(LinkState.DOWN, Reason.NOT_ATTACHED, "b")]
    assert readiness(links, 2.0) == Readiness(
        False,
        "unavailable",
        "slot server a: the connection to the slot server ended; slot server b: not attached to the slot server",
    )
    assert readiness([], 0.0) == Readiness(False, "unavailable", "no slot server is attached")


def test_a_health_goes_through_an_agent_processs_status_words_without_its_detail() -> None:
    sent = LinkHealth("a", LinkState.UNRESPONSIVE, Reason.NO_HEARTBEAT, 12.5, 9.25, 3.0)
    assert LinkHealth.from_words("a", sent.words()) == sent
    failed = LinkHealth("b", LinkState.DOWN, Reason.FAILED, 1.0, 0.5, 3.0, "read: connection reset")
    assert LinkHealth.from_words("b", failed.words()) == LinkHealth("b", LinkState.DOWN, Reason.FAILED, 1.0, 0.5, 3.0)


@pytest.mark.parametrize("words", [(0, 0, 0, 0, 0), (9, 0, 1, 1, 10**9), (1, 99, 1, 1, 10**9)])
def test_words_never_published_read_as_a_link_not_attached(words: tuple[int, ...]) -> None:
    health = LinkHealth.from_words("a", words)
    assert (health.state, health.reason) == (LinkState.DOWN, Reason.NOT_ATTACHED)
