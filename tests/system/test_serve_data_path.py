"""``edgepath serve`` over the chosen data path: loopback here, RDMA verbs in the soft-RoCE lane
(``--transport verbs``) -- HTTP/3 in, echo out, every slot FREE afterwards."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.edge import free_port, running_edge
from helpers.procs import all_free

from edgepath.config import (
    AgentSettings,
    DataPath,
    EdgeSettings,
    HandlerSettings,
    ServeOptions,
    Sizing,
    StartedSlotServer,
)
from edgepath.edge.adapters.tls import default_certificate
from edgepath.edge.client import h3_client

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child


@pytest.mark.transport
def test_serve_over_the_data_path(
    transport_name: str, transport_options: dict, data_path: DataPath, new_address, tmp_path: Path
) -> None:
    address = new_address("slot-server")
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port()),
        sizing=Sizing(slots=4, input_capacity=256, output_capacity=256),
        agent=AgentSettings(frames=16),
        handler=HandlerSettings("echo"),
        data_path=data_path,
        started=StartedSlotServer(listen=address),
    )
    with running_edge(options, tmp_path) as edge:

        async def main() -> list[tuple[int, str]]:
            async with h3_client("127.0.0.1", edge.port, str(default_certificate()), server_name="localhost") as c:
                replies = await asyncio.gather(*(c.generate(f"over {transport_name} #{i}") for i in range(8)))
            return [(r.status, r.json()["text"] if r.status == 200 else "") for r in replies]

        answers = asyncio.run(asyncio.wait_for(main(), 120))
        assert all(status in (200, 429) for status, _ in answers)
        ok = [(i, text) for i, (status, text) in enumerate(answers) if status == 200]
        assert ok and all(text == f"over {transport_name} #{i}" for i, text in ok)
        assert all_free(address, 4, transport_name, transport_options)


@pytest.mark.transport
def test_verbs_data_path_without_a_listen_address_is_a_clear_error() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgepath",
            "serve",
            "--data-path",
            "verbs",
            "--handler",
            "echo",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--slot-server-listen IP:PORT" in out.stderr
