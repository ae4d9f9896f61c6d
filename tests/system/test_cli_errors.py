"""Every command-line mistake is one line on stderr and exit status 2 -- never a traceback.

Each case runs ``edgepath`` as a user would (a subprocess) and checks that the one line names the
option, the value given and what is allowed instead."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgepath.children import edgepath_argv

NOT_A_FILE = "/nonexistent/edgepath-test.json"
RENAMED = ("--transport is now --data-path", "loopback|verbs")

# (arguments, what the one line must contain)
CASES: list[tuple[list[str], tuple[str, ...]]] = [
    (["serve", "--tokenizer", NOT_A_FILE], ("--tokenizer", NOT_A_FILE, "readable file", "does not exist")),
    (["serve", "--port", "99999"], ("--port", "99999", "1-65535")),
    (["serve", "--port", "http"], ("--port", "'http'", "1-65535")),
    (["request", "--port", "0", "hi"], ("--port", "'0'", "1-65535")),
    (["chat", "--max-tokens", "0", "hi"], ("--max-tokens", "'0'", "positive integer")),
    (["chat", "--temperature", "warm", "hi"], ("--temperature", "'warm'", ">= 0")),
    (["serve", "--slots", "0"], ("--slots", "'0'", "positive integer")),
    (["serve", "--frames", "many"], ("--frames", "'many'", "positive integer")),
    (["serve", "--max-body", "-1"], ("--max-body", "'-1'", "positive integer")),
    (["serve", "--request-timeout", "-5"], ("--request-timeout", "'-5'", "> 0")),
    (["serve", "--gid-index", "-1"], ("--gid-index", "'-1'", ">= 0")),
    (["slot-server", "--lease", "0"], ("--lease", "'0'", "> 0")),
    (["serve", "--slot-spin-us", "nan"], ("--slot-spin-us", "'nan'", ">= 0")),
    (["slot-server", "--slots", "tpu:4"], ("--slots", "'tpu:4'", "gpu:N")),
    (["demo", "--requests", "ten"], ("--requests", "'ten'", "positive integer")),
    (["demo", "--concurrency", "1000"], ("--concurrency", "1000", "at most 256")),
    (["serve", "--handler", "nosuch"], ("--handler", "'nosuch'", "module:attribute")),
    (["serve", "--handler", "no_such_module_xyz:fn"], ("--handler", "no_such_module_xyz", "cannot import")),
    (["slot-server", "--handler", "json:nope"], ("--handler", "json:nope", "no attribute")),
    (["serve", "--handler-option", "x"], ("--handler-option", "'x'", "KEY=VALUE")),
    (["serve", "--transport", "udp"], ("--transport", "'udp'", "'quic', 'tcp'")),
    (["serve", "--data-path", "rdma"], ("--data-path", "'rdma'", "'loopback', 'verbs'")),
    (["slot-server", "--transport", "loopback"], RENAMED),
    (["agent", "--transport", "verbs"], RENAMED),
    (["demo", "--transport", "loopback"], RENAMED),
    (["serve", "--device", "rxe0"], ("--device", "--data-path verbs", "loopback")),
    (["serve", "--data-path", "verbs"], ("--data-path verbs", "--slot-server-listen IP:PORT")),
    (["demo", "--data-path", "verbs"], ("--data-path verbs", "--slot-server-listen IP:PORT")),
    (
        ["slot-server", "--data-path", "verbs", "--device", "nosuchdev0"],
        ("--data-path verbs --device nosuchdev0", "verbs transport"),
    ),
    (
        ["serve", "--certificate", NOT_A_FILE, "--private-key", NOT_A_FILE],
        ("--certificate", NOT_A_FILE, "readable file"),
    ),
    (["serve", "--api-keys-file", NOT_A_FILE], ("--api-keys-file", NOT_A_FILE, "readable file")),
    (["serve", "--protect-ops"], ("--protect-ops", "--api-keys-file", "EDGEPATH_API_KEYS")),
    (["serve", "--host", "999.999.999.999"], ("--host 999.999.999.999", "cannot listen")),
    (["serve", "--slot-server", "/nonexistent/slots.sock"], ("--slot-server /nonexistent/slots.sock", "nothing is")),
    (["serve", "--agent", "/nonexistent/agent.sock"], ("--agent /nonexistent/agent.sock", "nothing is")),
    (["serve", "--slot-server", "/a.sock", "--slot-server", "/a.sock"], ("--slot-server /a.sock", "given twice")),
    (
        ["serve", "--slot-server", "/nonexistent/a.sock", "--slot-server", "/nonexistent/b.sock"],
        ("--slot-server /nonexistent/a.sock", "nothing is"),
    ),
    (
        ["serve", "--slot-server", "/a.sock", "--slot-server-listen", "/b.sock"],
        ("--slot-server-listen", "--local-slot-server"),
    ),
    (["serve", "--port", "9000", "--port", "9001"], ("--port", "more than once", "one value")),
    (["serve", "--local-slot-server", "--local-slot-server"], ("--local-slot-server", "more than once", "switch")),
    (["slot-server", "--lease", "1", "--lease", "2"], ("--lease", "more than once", "one value")),
]


def edgepath_fails(args: list[str], cwd: Path, **popen: Any) -> str:
    """Run ``edgepath ARGS`` (``popen``: more of subprocess.run's keywords); assert exit status 2 and one line
    on stderr, no traceback; that line."""
    done = subprocess.run(
        edgepath_argv(*args), capture_output=True, text=True, timeout=60, check=False, cwd=cwd, **popen
    )
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(lines) == 1, done.stderr
    assert "ready" not in done.stdout
    return lines[0]


@pytest.fixture(autouse=True)
def private_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("EDGEPATH_API_KEYS", raising=False)


@pytest.mark.parametrize(("args", "expected"), CASES, ids=[" ".join(args) for args, _ in CASES])
def test_a_command_line_mistake_is_one_line_and_exit_2(
    args: list[str], expected: tuple[str, ...], tmp_path: Path
) -> None:
    line = edgepath_fails(args, tmp_path)
    assert line.startswith(f"edgepath {args[0]}: error: "), line
    for text in expected:
        assert text in line, (text, line)


def test_a_certificate_without_its_key(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not checked: the pair is incomplete\n")
    line = edgepath_fails(["serve", "--certificate", str(cert)], tmp_path)
    assert "--certificate and --private-key go together" in line


@pytest.fixture
def as_a_user() -> dict[str, Any]:
    """How to run a command as a user who is refused what mode bits refuse: as ourselves, or -- when we are
    root, who reads even a mode-000 file (and CI runs as root) -- as ``nobody``, without root's groups."""
    if os.geteuid() != 0:
        return {}
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may search (``tmp_path`` is private to us, so ``nobody`` could not even start
    there), removed afterwards."""
    made = Path(tempfile.mkdtemp(prefix="edgepath-cli-"))
    made.chmod(0o755)
    yield made
    for path in [made / "closed", made]:
        if path.exists():
            path.chmod(0o755)
    shutil.rmtree(made)


@pytest.mark.parametrize(
    ("where", "why"),
    [("tokenizer.json", "no permission to read it"), ("closed/tokenizer.json", "a directory on its path is closed")],
    ids=["mode-000 file", "closed directory"],
)
def test_an_unreadable_file(open_dir: Path, as_a_user: dict[str, Any], where: str, why: str) -> None:
    secret = open_dir / where
    secret.parent.mkdir(exist_ok=True)
    secret.write_text("{}")
    secret.chmod(0)
    secret.parent.chmod(0o755 if secret.parent == open_dir else 0)
    line = edgepath_fails(["serve", "--tokenizer", str(secret)], open_dir, **as_a_user)
    assert "--tokenizer" in line and str(secret) in line and why in line


@pytest.fixture(params=[("quic", socket.SOCK_DGRAM), ("tcp", socket.SOCK_STREAM)], ids=["quic", "tcp"])
def busy_port(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    transport, kind = request.param
    with socket.socket(socket.AF_INET, kind) as busy:
        busy.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            busy.listen()
        yield transport, busy.getsockname()[1]


def test_a_port_in_use(busy_port: tuple[str, int], tmp_path: Path) -> None:
    transport, port = busy_port
    line = edgepath_fails(["serve", "--transport", transport, "--port", str(port)], tmp_path)
    assert f"--port {port}" in line and "Address already in use" in line and "free port" in line


def test_help_still_works() -> None:
    done = subprocess.run(edgepath_argv("serve", "--help"), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "--data-path" in done.stdout and "--max-restarts" in done.stdout


def _help(*command: str) -> str:
    done = subprocess.run(edgepath_argv(*command, "--help"), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())  # argparse wraps lines: one line of words


def test_the_top_help_speaks_to_users() -> None:
    """``edgepath --help`` says what the program does and how to start, with no developer's docstring in it."""
    text = _help()
    assert "Serve a language model with an OpenAI-compatible API" in text
    assert 'edgepath chat "What is the capital of France?"' in text and "edgepath serve" in text
    for developer in (":mod:", "entry point", "edgepath.commands", "edgepath-bench"):
        assert developer not in text
    assert "-v, --verbose log more" in text


@pytest.mark.parametrize("command", ["request", "chat"])
def test_the_clients_help_says_what_each_option_does_for_them(command: str) -> None:
    """The clients' ``--host`` is the server they send to (it once said "address to listen on", the server's
    meaning), and the default answer length is stated."""
    text = _help(command)
    assert "--host HOST the server to send to" in text and "listen" not in text
    assert "--port PORT the server's HTTP/3 port (default 4433)" in text
    assert "--max-tokens MAX_TOKENS output tokens at most (default 128)" in text
