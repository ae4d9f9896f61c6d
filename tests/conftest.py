"""Shared fixtures. ``--transport verbs`` re-runs the transport-level and end-to-end suites over
RDMA verbs (the soft-RoCE lane); the default is the loopback transport."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edgepath.dma.transport import Transport, make_transport

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


@pytest.fixture(scope="session")
def transport_name(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--transport")


@pytest.fixture(scope="session")
def transport_options(request: pytest.FixtureRequest, transport_name: str) -> dict[str, object]:
    if transport_name == "verbs":
        return {
            "device": request.config.getoption("--rdma-device"),
            "gid_index": request.config.getoption("--gid-index"),
        }
    return {}


@pytest.fixture(scope="session")
def transport_cli_args(transport_name: str, transport_options: dict[str, object]) -> list[str]:
    """The same choice as command-line flags, for tests that start edgepath processes."""
    args = ["--transport", transport_name]
    if transport_name == "verbs":
        args += ["--device", str(transport_options["device"]), "--gid-index", str(transport_options["gid_index"])]
    return args


@pytest.fixture
def new_transport(transport_name: str, transport_options: dict[str, object]) -> Iterator[Callable[[], Transport]]:
    """Factory of transport endpoints of the chosen kind; all are closed after the test."""
    made: list[Transport] = []

    def factory() -> Transport:
        t = make_transport(transport_name, **transport_options)
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
def edgepath_process() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``python -m edgepath ARGS`` and wait for its 'ready' line; all are stopped after the test."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, timeout: float = 30.0) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgepath", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs.append(proc)
        line = _read_line(proc, timeout)
        if not line.startswith("ready"):
            proc.kill()
            _, err = proc.communicate(timeout=5)
            raise RuntimeError(f"edgepath {' '.join(args)} did not start: {line!r}\n{err}")
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return proc.stdout.readline()
