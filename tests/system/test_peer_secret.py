"""Where the peer secret comes from (edgepath/peer_secret.py) and how a new one replaces it: a secret file read again
as it changes -- the old secret accepted for the grace period, only the new one after, and a stream under way never
dropped; a missing, unreadable or short secret is one line saying how to give one; ``serve`` that starts every peer
itself makes its own, readable by its user only, named on its children's command lines and never put on one."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.datapath import collect, send
from helpers.waiting import wait_for

from edgepath import peer_secret
from edgepath.children import Child, edgepath_argv, free_port
from edgepath.dpu.agent import Agent, AgentError
from edgepath.native.abi import Status
from edgepath.peer_secret import PEER_SECRET_ENV, PeerSecretMissing, own_secret_file, peer_keys
from edgepath.slots.handlers import PacedEcho
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.loopback import LoopbackTransport
from edgepath.transports.peer_auth import PeerKeys

OLD, NEW = "a" * 64, "b" * 64
TOKENS = 40  # streamed one every 20 ms: the stream is under way while the secret changes


@pytest.fixture
def secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(peer_secret, "POLL_INTERVAL", 0.02)  # the file is read again every 20 ms, not every second
    path = tmp_path / "peer-secret"
    path.write_text(OLD + "\n")
    return path


@pytest.fixture
def server_with(tmp_path: Path) -> Iterator[Callable[[PeerKeys], SlotServer]]:
    made: list[tuple[SlotServer, threading.Thread]] = []

    def start(keys: PeerKeys) -> SlotServer:
        config = SlotServerConfig(slots=4, input_capacity=64, output_capacity=64, stream_window=0.0)
        server = SlotServer(LoopbackTransport(keys), str(tmp_path / "slots.sock"), PacedEcho(0.02), config)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        made.append((server, thread))
        return server

    yield start
    for server, thread in made:
        server.stop()
        thread.join(timeout=5)
        server.close()


@pytest.fixture
def agents() -> Iterator[Callable[[str, str], Agent]]:
    made: list[Agent] = []

    def attach(secret: str, address: str) -> Agent:
        agent = Agent(LoopbackTransport(PeerKeys(secret.encode())), frames=2, input_capacity=64, output_capacity=64)
        made.append(agent)
        agent.attach(address)
        return agent

    yield attach
    for agent in made:
        agent.transport.close()


@pytest.mark.parametrize("grace", [3600.0, 0.0], ids=["within the grace", "after the grace"])
def test_a_new_secret_in_the_file_is_taken_without_dropping_a_stream(
    secret_file: Path, server_with: Callable[[PeerKeys], SlotServer], agents: Callable[[str, str], Agent], grace: float
) -> None:
    keys = peer_keys(str(secret_file), grace)
    server = server_with(keys)
    streaming = agents(OLD, server.address)
    index = send(streaming, list(range(TOKENS)), max_new=TOKENS)
    wait_for(lambda: bool(streaming.poll(timeout=0.1)), 5.0, "the first streamed tokens")
    secret_file.write_text(NEW + "\n")  # rotated: what a Kubernetes Secret's update looks like to the pod
    wait_for(lambda: keys.accepted(float("inf")) == [NEW.encode()], 5.0, "the new secret taken from the file")
    agents(NEW, server.address)  # a peer given the new one
    if grace:
        agents(OLD, server.address)  # a peer whose file has not changed yet
    else:
        with pytest.raises(AgentError, match="no secret in common"):
            agents(OLD, server.address)
    final = collect(streaming, index)[-1]  # the stream set up with the old secret went on to its end
    result = streaming.frames.result_headers[index]
    assert final.final and final.count == TOKENS
    assert result.status == Status.LENGTH and result.output_count == TOKENS


def test_a_file_that_goes_bad_keeps_the_secret_in_use(secret_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = peer_keys(str(secret_file), 60.0)
    secret_file.write_text("short\n")
    wait_for(lambda: "keeping the peer secret in use" in caplog.text, 5.0, "the bad file reported")
    assert keys.accepted(0.0) == [OLD.encode()]


def test_no_secret_says_how_to_give_one() -> None:
    with pytest.raises(PeerSecretMissing, match=f"--peer-secret-file FILE .*or set {PEER_SECRET_ENV}.*secrets.token"):
        peer_keys(None, environ={})


def test_a_file_serve_makes_is_its_users_alone(tmp_path: Path) -> None:
    path = own_secret_file(tmp_path / "serve.peer-secret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(peer_secret.read_secret(str(path))) == 64


def _without_secret() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != PEER_SECRET_ENV}


def edgepath_fails(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    """``edgepath ARGS`` fails as a mistake does (tests/system/test_cli_errors.py): exit 2, one line; that line."""
    done = subprocess.run(edgepath_argv(*args), capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    assert "Traceback" not in done.stderr and done.returncode == 2, (done.returncode, done.stderr)
    (line,) = done.stderr.splitlines()
    return line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["slot-server"], ("no peer secret", "--peer-secret-file FILE", PEER_SECRET_ENV)),
        (["agent"], ("no peer secret", "--peer-secret-file FILE", PEER_SECRET_ENV)),
        (["probe", "/nonexistent/slots.sock"], ("no peer secret", PEER_SECRET_ENV)),
        (["serve", "--slot-server", "/nonexistent/slots.sock"], ("--slot-server", "peer secret", PEER_SECRET_ENV)),
        (["serve", "--quota-home", "/nonexistent/q.sock"], ("--quota-home", "peer secret")),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_a_process_that_meets_peers_started_elsewhere_needs_the_secret(
    args: list[str], expected: tuple[str, ...], tmp_path: Path
) -> None:
    line = edgepath_fails(args, tmp_path, env=_without_secret())
    for text in expected:
        assert text in line, (text, line)


def test_a_short_secret_file_is_refused_saying_how_long(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("only sixteen bytes\n")
    line = edgepath_fails(["slot-server", "--peer-secret-file", str(short)], tmp_path, env=_without_secret())
    assert "--peer-secret-file" in line and "at least 32" in line


def test_serve_gives_the_children_it_starts_a_secret_of_its_own_by_file(tmp_path: Path) -> None:
    """What `make run` does: no secret given; the slot server child is told where serve's own is, never what."""
    env = {**_without_secret(), "XDG_RUNTIME_DIR": str(tmp_path)}
    port = free_port(kind=socket.SOCK_STREAM)
    serve = Child.start(
        ["serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--slots", "2"],
        env=env,
        ready_timeout=60.0,
    )
    try:
        children = [
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            for task in Path(f"/proc/{serve.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        (slot_server,) = [[arg.decode() for arg in argv] for argv in children if b"slot-server" in argv]
        secret_path = slot_server[slot_server.index("--peer-secret-file") + 1]
        secret = Path(secret_path).read_text().strip()
        assert len(secret) == 64 and not any(secret in arg for arg in slot_server)
        assert stat.S_IMODE(os.stat(secret_path).st_mode) == 0o600
    finally:
        serve.stop()
    assert not Path(secret_path).exists()  # removed when serve stops
