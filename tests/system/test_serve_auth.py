"""API keys over HTTP/3 on a real ``edgepath serve``: 401 without a good key; with keys, the readiness probe open
and /health not."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.edge import free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.tls import default_certificate
from edgepath.edge.client import h3_client

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child


def test_over_quic_a_missing_key_is_401_and_a_good_one_is_served(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k-123\n")
    options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port(), api_keys_file=str(keys)),
        sizing=Sizing(slots=2),
        agent=AgentSettings(frames=4),
        handler=HandlerSettings("echo"),
    )
    with running_edge(options, tmp_path) as edge:

        async def main() -> tuple[int, int, int]:
            statuses = []
            for key in (None, "nope", "k-123"):
                async with h3_client(
                    "127.0.0.1", edge.port, str(default_certificate()), server_name="localhost", api_key=key
                ) as c:
                    statuses.append((await c.generate("hello")).status)
            async with h3_client("127.0.0.1", edge.port, str(default_certificate()), server_name="localhost") as c:
                statuses.append((await c.request("GET", "/health/ready")).status)
                statuses.append((await c.request("GET", "/health")).status)
            return tuple(statuses)

        assert asyncio.run(asyncio.wait_for(main(), 60)) == (401, 401, 200, 200, 401)
