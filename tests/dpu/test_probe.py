"""``edgepath probe``: a slot server checked as its agents judge it (dpu/probe.py), the liveness and readiness
probe of the slot-server pods (slot servers serve no HTTP). A slot server whose loop turns passes both; a frozen
one fails once the hang timeout passes on the probe's clock; a draining one is alive but not ready; an address
where nothing listens fails naming it. The servers' loops are turned by the probe's own waits (``sleep``) and its
clock is the test's, so every verdict is exact."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from edgepath.cli import main
from edgepath.dpu.probe import judge, probe
from edgepath.slots.server import SlotServer
from edgepath.transports.base import Transport

pytestmark = pytest.mark.transport

HANG = 2.0


class Clock:
    """The probe's monotonic clock; each of its waits moves it and may turn a slot server's loop."""

    def __init__(self, turn: SlotServer | None = None) -> None:
        self.now = 50.0
        self.turn = turn
        self.waits = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.waits += 1
        if self.turn is not None:
            self.turn.poll_once(0)


def test_a_slot_server_whose_loop_turns_passes_as_live_and_ready(
    make_server: Callable[..., SlotServer], new_transport: Callable[[], Transport]
) -> None:
    server = make_server()
    for ready in (False, True):
        clock = Clock(turn=server)
        verdict = probe(new_transport(), server.address, HANG, ready=ready, clock=clock, sleep=clock.sleep)
        assert verdict.passed, verdict.reason
        assert "up" in verdict.reason and clock.now - 50.0 < HANG


def test_a_frozen_slot_server_fails_once_its_heartbeat_stood_still_for_the_hang_timeout(
    make_server: Callable[..., SlotServer], new_transport: Callable[[], Transport]
) -> None:
    server = make_server()  # its loop is never turned: frozen (its memory still answers)
    clock = Clock()
    verdict = probe(new_transport(), server.address, HANG, clock=clock, sleep=clock.sleep)
    assert not verdict.passed
    assert "heartbeat stood still" in verdict.reason and server.address in verdict.reason
    assert clock.now - 50.0 >= HANG and clock.waits > 1  # it waited the whole hang timeout, reading again


def test_a_draining_slot_server_is_alive_but_not_ready(
    make_server: Callable[..., SlotServer], new_transport: Callable[[], Transport]
) -> None:
    server = make_server()
    server.memory.drain()  # what the loop writes on SIGTERM: the pool header's draining word
    clock = Clock(turn=server)
    live = probe(new_transport(), server.address, HANG, clock=clock, sleep=clock.sleep)
    assert live.passed and "draining" in live.reason
    clock = Clock(turn=server)
    ready = probe(new_transport(), server.address, HANG, ready=True, clock=clock, sleep=clock.sleep)
    assert not ready.passed and "draining" in ready.reason


def test_an_address_where_nothing_listens_fails_naming_it(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> None:
    address = new_address("nobody")
    verdict = probe(new_transport(), address, HANG)
    assert not verdict.passed and address in verdict.reason and "cannot attach" in verdict.reason


def test_the_verdict_weighs_the_heartbeat_before_the_drain() -> None:
    assert not judge("a", moved=False, stopping=False, ready=False, waited=5.0).passed
    assert not judge("a", moved=False, stopping=True, ready=False, waited=5.0).passed
    assert judge("a", moved=True, stopping=True, ready=False, waited=0.1).passed
    assert not judge("a", moved=True, stopping=True, ready=True, waited=0.1).passed
    assert judge("a", moved=True, stopping=False, ready=True, waited=0.1).passed


def test_the_command_exits_0_for_a_running_slot_server_and_1_naming_the_reason_otherwise(
    serve: Callable[..., SlotServer],
    new_address: Callable[[str], str],
    transport_cli_args: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from edgepath.slots.handlers import echo

    server = serve(echo)  # its real loop, on a thread
    assert main(["probe", server.address, "--ready", *transport_cli_args]) == 0
    assert server.address in capsys.readouterr().out
    gone = new_address("gone")
    assert main(["probe", gone, "--hang-timeout", "1", *transport_cli_args]) == 1
    assert gone in capsys.readouterr().err
