"""Running tests/claimer.py processes from tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edgepath.builder import data_path_transport
from edgepath.config import DataPath
from edgepath.dpu.agent import Agent
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT
from edgepath.native.abi import State

CLAIMER = str(Path(__file__).with_name("claimer.py"))


def start_claimer(mode: str, config: dict, stdin: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CLAIMER, mode, json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        text=True,
    )


def result_of(proc: subprocess.Popen[str], timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"claimer failed ({proc.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def slot_states(address: str, slots: int, transport: str = "loopback", options: dict | None = None) -> list[int]:
    """The state (low byte of each state word) of every slot of the slot server at ``address``,
    read by a probe agent with one RDMA READ."""
    probe = Agent(
        data_path_transport(DataPath(transport, **(options or {})), DEFAULT_HANG_TIMEOUT),
        frames=1,
        input_capacity=16,
        output_capacity=16,
        max_servers=1,
        max_slots_per_server=slots,
    )
    try:
        link = probe.attach(address)
        probe.link_set.refresh(link)
        return [int(w) & 0xFF for w in link.words]
    finally:
        probe.transport.close()


def all_free(address: str, slots: int, transport: str = "loopback", options: dict | None = None) -> bool:
    return all(state == State.FREE for state in slot_states(address, slots, transport, options))


def all_claimed(address: str, slots: int) -> bool:
    """Every slot is taken (RUNNING), e.g. by requests that are still streaming."""
    return all(state == State.RUNNING for state in slot_states(address, slots))
