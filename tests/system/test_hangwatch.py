"""``serve``'s hang watch, alone: it reads a slot server's heartbeat with an agent of its own and asks the
supervisor to kill the server once it has stayed unresponsive for a second hang timeout -- once per server --
and keeps the supervision counts where edge workers read them.

The slot server runs in this process and its loop is never turned (exactly a frozen one: its memory answers,
its loop does nothing); the watch's clock is the test's; the supervisor is a recorder in place of the real one,
whose kill and restart are tested on real processes in tests/system/test_hang.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from edgepath.builder import build_hang_watch
from edgepath.config import DataPath
from edgepath.dpu.link_state import LinkHealth, LinkState, Reason
from edgepath.hangwatch import HangWatch, read_counts
from edgepath.peer_secret import peer_keys
from edgepath.slots.handlers import echo
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.supervisor import Supervisor, hang_verdict
from edgepath.transports.loopback import LoopbackTransport

HANG = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """What the watch asks of its supervisor: counts, and kill."""

    def __init__(self) -> None:
        self.restarts = 0
        self.hangs = 0
        self.killed: list[str] = []

    def kill(self, why: str) -> bool:
        self.killed.append(why)
        self.hangs += 1
        return True


@pytest.fixture
def frozen(tmp_path: Path) -> Iterator[SlotServer]:
    server = SlotServer(
        LoopbackTransport(peer_keys(None)), str(tmp_path / "slots.sock"), echo, SlotServerConfig(slots=2)
    )
    server.start_connection_manager()  # agents attach; the loop never turns
    yield server
    server.close()
    server.transport.close()


def watch_of(server: SlotServer, tmp_path: Path, clock: Clock, recorder: Recorder) -> HangWatch:
    supervisor: Supervisor = recorder  # type: ignore[assignment]
    return build_hang_watch(supervisor, server.address, DataPath(), 2, HANG, str(tmp_path), clock=clock)


def test_a_frozen_server_is_killed_once_after_two_hang_timeouts(frozen: SlotServer, tmp_path: Path) -> None:
    clock, recorder = Clock(), Recorder()
    watch = watch_of(frozen, tmp_path, clock, recorder)
    try:
        watch.check()  # attaches at 100 s: the silence counts from here
        assert read_counts(str(tmp_path)) == (0, 0)
        for now in (101.0, 102.0):
            clock.now = now
            watch.check()  # unresponsive from 102 s
        assert watch.links.links[0].tracker.state is LinkState.UNRESPONSIVE
        clock.now = 103.99
        watch.check()
        assert recorder.killed == []  # not yet a whole second hang timeout
        clock.now = 104.0
        watch.check()
        clock.now = 105.0
        watch.check()  # the same server, still there: never killed twice
        assert len(recorder.killed) == 1 and "no heartbeat for" in recorder.killed[0]
        assert read_counts(str(tmp_path)) == (0, 1)
    finally:
        watch.stop()


def test_a_server_that_beats_is_never_killed(frozen: SlotServer, tmp_path: Path) -> None:
    clock, recorder = Clock(), Recorder()
    watch = watch_of(frozen, tmp_path, clock, recorder)
    try:
        watch.check()
        for _ in range(10):
            frozen.poll_once(0.0)
            clock.now += HANG / 2
            watch.check()
        assert recorder.killed == []
    finally:
        watch.stop()


def test_no_counts_before_the_watch_wrote_them(tmp_path: Path) -> None:
    assert read_counts(str(tmp_path)) is None


@pytest.mark.parametrize(
    ("state", "since", "now", "killed"),
    [
        (LinkState.UP, 0.0, 100.0, False),
        (LinkState.DOWN, 0.0, 100.0, False),  # gone: the supervisor's restart path has it
        (LinkState.UNRESPONSIVE, 10.0, 11.9, False),
        (LinkState.UNRESPONSIVE, 10.0, 12.0, True),
    ],
)
def test_the_verdict_needs_a_whole_hang_timeout_of_unresponsiveness(
    state: LinkState, since: float, now: float, killed: bool
) -> None:
    reason = Reason.NO_HEARTBEAT if state is LinkState.UNRESPONSIVE else Reason.NONE
    health = LinkHealth("s", state, reason, since, since - HANG, HANG)
    verdict = hang_verdict(health, now)
    assert (verdict is not None) == killed
    if killed:
        assert verdict == "unresponsive for 2.0 s more after no heartbeat for 2.0 s (hang timeout 2 s)"
