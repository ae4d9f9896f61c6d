"""Fixtures for the data-path benchmarks: a slot-server process (so agent and poller do not share a GIL)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edgepath.peer_secret import PEER_SECRET_ENV

# The benchmarks' slot servers and agents prove they hold one peer secret: made per run, inherited by the processes
# they start (docs/DATAPATH.md, "Peers prove they belong").
os.environ.setdefault(PEER_SECRET_ENV, secrets.token_hex(32))


@pytest.fixture
def slot_server_process(tmp_path: Path) -> Iterator[Callable[..., str]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        address = str(tmp_path / f"slot-server-{len(procs)}.sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgepath", "slot-server", "--listen", address, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"slot server did not start: {line!r}")
        return address

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)
