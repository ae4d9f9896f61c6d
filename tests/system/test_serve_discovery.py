"""``edgepath serve --slot-servers-from dir:PATH`` under load: a slot server that appears in the directory is
attached and claimed, one whose socket leaves it is drained -- its streams finish, nothing new is claimed there
-- and let go of, with no failed request.

Everything is a real process: two ``edgepath slot-server --handler paced-echo`` (so requests are in flight when
the set changes) listening in a directory the test owns, and one ``edgepath serve --transport tcp``; the source
is that directory (the loopback data path's form of a headless Service: docs/DEPLOY.md).  Taking a slot
server's socket out of the directory is how the test removes it from the source while it still runs."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.failover import claims, generated, listing
from helpers.supervised import Load, scrape, series
from helpers.tokenizers import byte_tokenizer
from helpers.waiting import wait_for

from edgepath.children import Child, free_port

pytestmark = pytest.mark.slow

SLOTS = 4
PATIENCE = 60.0  # seconds each step may take on a loaded 2-core machine (the targets are printed, not asserted)


def test_serve_attaches_a_slot_server_that_appears_and_drains_one_that_leaves_with_no_failed_request(
    tmp_path: Path, edgepath_process: Callable[..., Child]
) -> None:
    tokenizer = str(byte_tokenizer(tmp_path / "tokenizer.json"))
    slots = tmp_path / "slots"
    slots.mkdir()
    a, b = str(slots / "a.sock"), str(slots / "b.sock")

    def slot_server(address: str) -> Child:
        return edgepath_process(
            "slot-server", "--listen", address, "--slots", str(SLOTS), "--handler", "paced-echo",
            "--handler-option", "token_delay=0.002",
        )  # fmt: skip

    slot_server(a)
    port = free_port(socket.SOCK_STREAM)
    edgepath_process(
        "serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--tokenizer", tokenizer,
        "--frames", "64", "--slot-servers-from", f"dir:{slots}", "--resolve-interval", "0.5",
    )  # fmt: skip
    assert list(listing(port)) == [a]
    with Load(port, threads=3, max_requests=4000, max_seconds=6 * PATIENCE) as load:
        wait_for(lambda: claims(port, a) >= 20, PATIENCE, "requests on the first slot server")
        slot_server(b)
        appeared = time.monotonic()
        wait_for(lambda: listing(port).get(b, {}).get("state") == "up", PATIENCE, "the new slot server attached")
        attached_s = time.monotonic() - appeared
        wait_for(lambda: claims(port, b) >= 20, PATIENCE, "requests on the new slot server")
        os.unlink(a)  # a leaves the source; its process still runs and still holds requests
        left = time.monotonic()
        wait_for(lambda: a not in listing(port), PATIENCE, "the drained slot server let go of")
        drained_s = time.monotonic() - left
        after = claims(port, b)
        wait_for(lambda: claims(port, b) >= after + 20, PATIENCE, "requests on the remaining slot server")
    text = scrape(port)
    statuses = {x.status for x in load.answers}
    print(
        f"discovery: {len(load.answers)} requests, statuses {sorted(statuses)}, attached {attached_s:.2f} s after "
        f"listening, drained and let go of {drained_s:.2f} s after leaving the source"
    )
    assert statuses == {200}, [x for x in load.answers if x.status != 200][:5]
    assert generated(text) == len(load.answers)  # each answered once, as the edge counts it
    assert series(text, "edgepath_port_duplicates_total") == 0
    assert series(text, "edgepath_port_unknown_total") == 0
    assert list(listing(port)) == [b]
