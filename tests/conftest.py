"""Shared fixtures. ``--transport verbs`` re-runs the transport-level and end-to-end suites over
RDMA verbs (the soft-RoCE lane); the default is the loopback transport."""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edgepath.builder import data_path_transport
from edgepath.children import Child
from edgepath.config import DataPath
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT
from edgepath.peer_secret import PEER_SECRET_ENV
from edgepath.transports.base import Transport

# Every process a test starts, and every transport it makes through the builder, proves it holds this run's peer
# secret (docs/DATAPATH.md, "Peers prove they belong"): one made per run, inherited by the processes started.
os.environ.setdefault(PEER_SECRET_ENV, secrets.token_hex(32))

_ports = itertools.count(int(os.environ.get("EDGEPATH_TEST_PORT_BASE", "20000")))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("edgepath")
    group.addoption(
        "--transport",
        default="loopback",
        choices=("loopback", "verbs"),
        help="transport for the transport-level and end-to-end tests",
    )
    group.addoption("--rdma-device", default=os.environ.get("EDGEPATH_RDMA_DEVICE", "rxe0"))
    group.addoption("--gid-index", type=int, default=int(os.environ.get("EDGEPATH_GID_INDEX", "1")))
    group.addoption(
        "--rdma-addr",
        default=os.environ.get("EDGEPATH_RDMA_ADDR", "10.77.0.1"),
        help="IP address of the RDMA device's netdev (verbs addresses are ADDR:PORT)",
    )
    group.addoption(
        "--wire",
        default=None,
        metavar="FILE",
        help="the soft-RoCE lane's two-device wire (JSON by tests/softroce/wire) for tests/softroce/test_rxe_wire.py",
    )


@pytest.fixture(scope="session")
def transport_name(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--transport")


@pytest.fixture(scope="session")
def transport_options(request: pytest.FixtureRequest, transport_name: str) -> dict[str, Any]:
    if transport_name == "verbs":
        return {
            "device": request.config.getoption("--rdma-device"),
            "gid_index": request.config.getoption("--gid-index"),
        }
    return {}


@pytest.fixture(scope="session")
def data_path(transport_name: str, transport_options: dict[str, Any]) -> DataPath:
    """The chosen transport as the agent <-> slot-server link of edgepath's commands."""
    return DataPath(transport_name, **transport_options)


@pytest.fixture(scope="session")
def transport_cli_args(data_path: DataPath) -> list[str]:
    """The same choice as command-line flags (``--data-path ...``), for tests that start edgepath processes."""
    return data_path.flags()


@pytest.fixture
def new_transport(transport_name: str, transport_options: dict[str, Any]) -> Iterator[Callable[[], Transport]]:
    """Factory of transport endpoints of the chosen kind; all are closed after the test."""
    made: list[Transport] = []

    def factory() -> Transport:
        t = data_path_transport(DataPath(transport_name, **transport_options), DEFAULT_HANG_TIMEOUT)
        made.append(t)
        return t

    yield factory
    for t in reversed(made):
        t.close()


@pytest.fixture
def new_address(request: pytest.FixtureRequest, transport_name: str, tmp_path: Path) -> Callable[[str], str]:
    """A fresh listen address for ``role``: a socket path (loopback) or ADDR:PORT (verbs)."""
    names = itertools.count()

    def factory(role: str) -> str:
        if transport_name == "verbs":
            return f"{request.config.getoption('--rdma-addr')}:{next(_ports)}"
        return str(tmp_path / f"{role}-{next(names)}.sock")

    return factory


@pytest.fixture
def edgepath_process() -> Iterator[Callable[..., Child]]:
    """Start ``edgepath ARGS`` and wait for its 'ready' line; all are stopped after the test."""
    children: list[Child] = []

    def start(*args: str, timeout: float = 30.0) -> Child:
        child = Child.start(args, ready_timeout=timeout)
        children.append(child)
        return child

    yield start
    for child in reversed(children):  # the last started first: edges before the slot servers they use
        child.stop()
