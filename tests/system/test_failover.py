"""``edgepath serve`` over two slot servers: one SIGKILLed under load is out of admission at once, the
other keeps serving, and when it is back on its address the agent re-attaches by itself and uses it again.

Everything is a real process -- two ``edgepath slot-server`` processes started by the test and one
``edgepath serve --transport tcp --slot-server A --slot-server B`` -- and the fault is a real SIGKILL.
What every request saw is recorded by a bounded load (sequential requests from a few threads); the
per-server listing of ``/health`` and ``/metrics`` is how the test follows the slot servers (state, claims).
Over verbs (the soft-RoCE lane, ``--transport verbs``) the same test runs on rxe."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.failover import (
    AFTER_KILL,
    SLOTS,
    SLOWEST_S,
    START_S,
    claims,
    kill_one_and_bring_it_back,
    listing,
)
from helpers.procs import all_free
from helpers.supervised import Load
from helpers.tokenizers import byte_tokenizer
from helpers.waiting import wait_for

from edgepath.children import Child, free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def tokenizer(tmp_path: Path) -> str:
    """The edges' vocabulary: a real tokenizer.json that loads at once (echo answers are the prompts)."""
    return str(byte_tokenizer(tmp_path / "tokenizer.json"))


@pytest.mark.transport
def test_one_of_two_slot_servers_killed_under_load_is_left_out_then_used_again_when_back(
    tokenizer: str,
    edgepath_process: Callable[..., Child],
    new_address: Callable[[str], str],
    transport_cli_args: list[str],
    transport_name: str,
    transport_options: dict[str, Any],
) -> None:
    def slot_server(address: str) -> Child:
        return edgepath_process(
            "slot-server", "--listen", address, "--slots", str(SLOTS), "--handler", "echo", *transport_cli_args,
            timeout=START_S,
        )  # fmt: skip

    a, b = new_address("slots-a"), new_address("slots-b")
    first, _ = slot_server(a), slot_server(b)
    port = free_port(socket.SOCK_STREAM)
    edgepath_process(
        "serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--tokenizer", tokenizer,
        "--frames", "64", "--slot-server", a, "--slot-server", b, *transport_cli_args, timeout=START_S,
    )  # fmt: skip
    assert [s["total_slots"] for s in listing(port).values()] == [SLOTS, SLOTS]
    run = kill_one_and_bring_it_back(port, first, a, b, lambda: slot_server(a))
    print(f"failover ({transport_name}): {run.summary()}")
    run.check()
    reason = run.notes["down_reason"]
    if transport_name == "loopback":
        assert "ended" in reason, reason  # the socket's end, seen at once
    else:
        # rdma_cm's DISCONNECTED, or an operation that was in flight to the killed server when it died: it fails
        # after 7 ACK timeouts, ~0.5 s (verbs_setup.RETRY_COUNT; docs/VERBS.md, "A peer that is gone")
        assert "ended" in reason or "failed" in reason, reason
    for address in (a, b):
        wait_for(lambda at=address: all_free(at, SLOTS, transport_name, transport_options), 30, "every slot FREE")


def test_a_local_slot_server_alongside_a_running_one_is_started_supervised_and_listed_first(
    tokenizer: str, edgepath_process: Callable[..., Child], new_address: Callable[[str], str]
) -> None:
    remote, local = new_address("slots-remote"), new_address("slots-local")
    edgepath_process("slot-server", "--listen", remote, "--slots", "2", "--handler", "echo")
    port = free_port(socket.SOCK_STREAM)
    edgepath_process(
        "serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--tokenizer", tokenizer,
        "--slots", "3", "--slot-server", remote, "--local-slot-server", "--slot-server-listen", local,
    )  # fmt: skip
    listed = listing(port)
    assert list(listed) == [local, remote]
    assert [(s["state"], s["total_slots"]) for s in listed.values()] == [("up", 3), ("up", 2)]
    # admission takes the server with the most free slots (cached), the first on a tie: the remote one is used
    # once more requests are in flight than make the local one (3 slots) the fuller
    with Load(port, threads=4, max_requests=200, max_seconds=60) as load:
        wait_for(lambda: min(claims(port, local), claims(port, remote)) >= 5, 60, "both slot servers in use")
    assert {x.status for x in load.answers} == {200}


def test_one_of_two_slot_servers_frozen_under_load_is_dropped_its_requests_move_and_it_is_used_again_when_it_thaws(
    tokenizer: str, edgepath_process: Callable[..., Child], new_address: Callable[[str], str]
) -> None:
    """A hang, not a death (issue 20's heartbeat seen from the failover side), with stream migration (issue 28):
    within the hang timeout the agent lets go of the frozen slot server -- it closes the link, so the server
    cannot write into frames that moved -- and claims what it held again on the other, which serves everything;
    the frozen one is listed down with the reason.  Once thawed it finds its agent gone (it writes nothing for
    it), is attached again by itself and its slots are used again -- nobody restarts it (``serve`` restarts only
    a slot server it started)."""
    hang = 1.0
    a, b = new_address("slots-a"), new_address("slots-b")
    frozen = edgepath_process("slot-server", "--listen", a, "--slots", str(SLOTS), "--handler", "echo")
    edgepath_process("slot-server", "--listen", b, "--slots", str(SLOTS), "--handler", "echo")
    port = free_port(socket.SOCK_STREAM)
    edgepath_process(
        "serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--tokenizer", tokenizer,
        "--slot-server", a, "--slot-server", b, "--hang-timeout", str(hang),
    )  # fmt: skip
    with Load(port, threads=3, max_requests=4000, max_seconds=120) as load:
        wait_for(lambda: min(claims(port, a), claims(port, b)) >= 20, 60, "both slot servers in use")
        stopped_at = time.monotonic()
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: listing(port)[a]["state"] != "up", 10 * hang, "the frozen one left out")
            listed = listing(port)[a]
            if listed["state"] == "down":  # it held requests when found: dropped, they moved
                assert "let go of the unresponsive slot server" in listed["reason"], listed
            else:  # found with nothing in flight: left out, connected
                assert listed["state"] == "unresponsive" and "no heartbeat" in listed["reason"], listed
            held = claims(port, a)
            settled = time.monotonic()
            wait_for(lambda: len(load.oks_after(settled)) >= AFTER_KILL, 60, "200s from the other slot server")
            assert claims(port, a) == held  # nothing claimed on a frozen server
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        wait_for(lambda: listing(port)[a]["state"] == "up", 30, "the thawed slot server up again")
        wait_for(lambda: claims(port, a) >= held + 20, 30, "its slots to be used again")
    answers = load.answers
    assert {x.status for x in answers} <= {200, 429}, {x.status for x in answers}  # what it held moved: no 504
    assert all(x.status == 200 for x in answers if x.sent > settled), "after detection everything is served"
    slowest = max(x.seconds for x in answers if x.sent > stopped_at)
    assert slowest < SLOWEST_S, f"an answer took {slowest:.2f} s"
    counts = {s: sum(x.status == s for x in answers) for s in sorted({x.status for x in answers})}
    print(f"freeze: {len(answers)} requests {counts}; slowest after the freeze {slowest:.3f} s")
