"""Faults with nothing lost: every request sent gets exactly one answer, every slot ends FREE.

Deployment: slot server, agent and edge in separate processes/threads, connected as in production.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers.edge import free_port, running_edge
from helpers.procs import all_claimed, all_free

from edgepath.config import EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.tls import default_certificate
from edgepath.edge.client import H3Client, h3_client

pytestmark = pytest.mark.slow


def run(coro_fn: Any, port: int) -> Any:
    async def main() -> Any:
        async with h3_client("127.0.0.1", port, cafile=str(default_certificate()), server_name="localhost") as c:
            return await coro_fn(c)

    return asyncio.run(asyncio.wait_for(main(), 120))


async def until_status(c: H3Client, status: int, tries: int = 200) -> int:
    for _ in range(tries):
        got = (await c.request("GET", "/health")).status
        if got == status:
            return got
        await asyncio.sleep(0.05)
    return got


def test_agent_killed_mid_flight_gives_503_then_a_restarted_agent_resumes_without_restarting_the_edge(
    edgepath_process: Any, tmp_path: Path
) -> None:
    """The handler is slow (a token every 0.5 s) and the lease long (60 s): the only way the killed agent's
    slots can come back within the test is the slot server seeing its connection close."""
    slots_addr, agent_addr = str(tmp_path / "slots.sock"), str(tmp_path / "agent.sock")
    edgepath_process(
        "slot-server",
        "--listen",
        slots_addr,
        "--slots",
        "2",
        "--handler",
        "paced-echo",
        "--handler-option",
        "token_delay=0.5",
        "--input-capacity",
        "256",
        "--output-capacity",
        "256",
        "--lease",
        "60",
    )
    agent_args = (
        "agent",
        "--slot-server",
        slots_addr,
        "--listen",
        agent_addr,
        "--frames",
        "64",
        "--frames-per-edge",
        "32",
        "--input-capacity",
        "256",
        "--output-capacity",
        "256",
    )
    agent = edgepath_process(*agent_args)
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port()),
        agent_process=agent_addr,
        handler=HandlerSettings("echo"),
        sizing=Sizing(input_capacity=256, output_capacity=256),
    )
    with running_edge(options, tmp_path / "edge") as edge:

        async def burst_and_kill(c: H3Client) -> list[int]:
            assert (await c.generate("hi", max_tokens=1)).status == 200
            tasks = [asyncio.ensure_future(c.generate(f"in flight {i}")) for i in range(6)]
            while not all_claimed(slots_addr, 2):  # both slots running (many seconds each); the rest got 429
                await asyncio.sleep(0.01)
            agent.send_signal(signal.SIGKILL)
            return [r.status for r in await asyncio.gather(*tasks)]

        statuses = run(burst_and_kill, edge.port)
        agent.wait(timeout=10)
        counts = Counter(statuses)
        assert sum(counts.values()) == 6  # exactly one answer each
        assert counts == Counter({503: 2, 429: 4}), counts  # the two in their slots: 503; the rest were refused
        assert wait_until(lambda: all_free(slots_addr, 2), 5.0), "slots left held after the agent was killed"

        async def while_gone(c: H3Client) -> tuple[int, int]:
            health = await until_status(c, 503)
            return health, (await c.generate("nobody home")).status

        assert run(while_gone, edge.port) == (503, 503)

        edgepath_process(*agent_args)  # the agent comes back; the edge was never restarted

        async def after(c: H3Client) -> tuple[int, int]:
            health = await until_status(c, 200)
            return health, (await c.generate("after")).status

        assert run(after, edge.port) == (200, 200)
    assert wait_until(lambda: all_free(slots_addr, 2), 5.0)


def wait_until(condition: Any, timeout: float) -> bool:
    """Poll a state until it holds (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False
