"""``edgepath serve`` supervises the slot server it starts: a killed one is restarted (bounded back-off),
the edge re-attaches, and a crash loop ends serve with exit status 1 and a message saying why.

The restart policy is a sans-I/O decision and is tested without processes or clocks; the promise
itself is tested on a real ``edgepath serve --transport tcp`` process with a real SIGKILL."""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.supervised import Load, slot_server_of, start_serve_tcp
from helpers.waiting import wait_for

from edgepath.children import Child, ChildError, exit_reason
from edgepath.supervisor import RestartPolicy

RECOVERY_S = 5.0  # issue #11: 200s again within 5 s of the kill, no operator action


# -- the policy, alone ---------------------------------------------------------------------------


def test_back_off_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(first_delay=0.1, max_delay=0.5, max_restarts=10, window=60.0)
    assert [policy.after_exit(float(t)) for t in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_more_deaths_than_allowed_within_the_window_is_a_crash_loop() -> None:
    policy = RestartPolicy(first_delay=0.1, max_delay=2.0, max_restarts=2, window=10.0)
    assert policy.after_exit(0.0) == 0.1
    assert policy.after_exit(1.0) == 0.2
    assert policy.after_exit(2.0) is None  # the third death within 10 s


def test_deaths_older_than_the_window_are_forgotten() -> None:
    policy = RestartPolicy(first_delay=0.1, max_delay=2.0, max_restarts=2, window=10.0)
    assert policy.after_exit(0.0) == 0.1
    assert policy.after_exit(5.0) == 0.2
    assert policy.after_exit(14.0) == 0.2  # the death at 0 s has left the window: two within it
    assert policy.after_exit(100.0) == 0.1  # a quiet child starts again from the first delay


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"first_delay": 0.0}, "first_delay"), ({"first_delay": 3.0}, "max_delay"), ({"window": 0.0}, "window")],
)
def test_a_policy_that_makes_no_sense_is_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_exit_reasons_say_signal_or_code() -> None:
    assert exit_reason(-signal.SIGKILL) == "killed by signal SIGKILL"
    assert exit_reason(3) == "exit code 3"


def test_children_are_verbose_when_their_parent_logs_debug(caplog: pytest.LogCaptureFixture) -> None:
    """``edgepath -v serve`` promises every process's debug messages: the children it starts get ``-v``."""
    from edgepath.children import edgepath_argv

    with caplog.at_level(logging.INFO, logger=""):
        assert edgepath_argv("slot-server", "--slots", "2")[3:] == ["slot-server", "--slots", "2"]
    with caplog.at_level(logging.DEBUG, logger=""):
        assert edgepath_argv("slot-server", "--slots", "2")[3:] == ["-v", "slot-server", "--slots", "2"]


def test_a_child_that_fails_to_start_reports_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(ChildError) as failed:
        Child.start(["slot-server", "--listen", str(tmp_path / "s.sock"), "--handler", "nosuch"], forward_stderr=False)
    message = str(failed.value)
    assert "slot-server did not start" in message and "exit code 2" in message
    assert "argument --handler: unknown handler 'nosuch'" in message  # the child's own one-line error


def _never_ready(pid_file: Path) -> list[str]:
    """A command line that writes its pid to ``pid_file`` and never prints a ready line."""
    code = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(600)"
    return [sys.executable, "-c", code]


def test_a_child_that_never_says_ready_is_stopped_at_its_start_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    hangs = _never_ready(pid_file)
    with pytest.raises(ChildError, match=r"printed no 'ready' line within 0\.5 s"):
        Child.start([], argv=hangs, ready_timeout=0.5, forward_stderr=False)
    assert not Path(f"/proc/{pid_file.read_text()}").exists()  # stopped and reaped


def test_a_start_that_is_cancelled_stops_its_child_at_once(tmp_path: Path) -> None:
    """serve stopping while a slot server (re)starts does not wait out --start-timeout (a model may load for
    minutes): the start gives up when its supervisor is stopped."""
    pid_file = tmp_path / "pid"
    hangs = _never_ready(pid_file)
    cancel = threading.Event()
    threading.Thread(target=lambda: wait_for(pid_file.exists, 30, "the child's pid") or cancel.set()).start()
    with pytest.raises(ChildError, match="was stopped while it started"):
        Child.start([], argv=hangs, ready_timeout=600, forward_stderr=False, cancel=cancel)
    assert not Path(f"/proc/{pid_file.read_text()}").exists()


# -- the promise, on a real serve process ----------------------------------------------------------


@pytest.fixture
def serve_tcp(
    edgepath_process: Callable[..., Child], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[Child, int]]]:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))

    made = itertools.count()

    def start(*extra: str) -> tuple[Child, int]:
        listen = str(tmp_path / f"slots-{next(made)}.sock")
        return start_serve_tcp(edgepath_process, "--handler", "echo", "--slot-server-listen", listen, *extra)

    yield start


def test_a_killed_slot_server_is_back_within_seconds_and_every_request_gets_one_answer(
    serve_tcp: Callable[..., tuple[Child, int]],
) -> None:
    serve, port = serve_tcp()
    first = slot_server_of(serve)
    assert first is not None
    with Load(port) as load:
        wait_for(lambda: len(load.oks_after(0.0)) >= 20, 60, "steady 200s before the kill")
        killed_at = time.monotonic()
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: bool(load.oks_after(killed_at)), 30, "a 200 after the kill")
        back = min(a.answered for a in load.oks_after(killed_at))
        seen = load.count
        wait_for(lambda: load.count >= seen + 20, 60, "more answers after the restart")
    answers = load.answers
    no_answer = [a for a in answers if a.status == 0]
    assert not no_answer, no_answer[:5]  # every request got its answer ...
    assert all(a.status in (200, 503) for a in answers), {a.status for a in answers}  # ... 200, or 503 while down
    assert back - killed_at <= RECOVERY_S, f"200s again {back - killed_at:.2f} s after the kill"
    second = slot_server_of(serve)
    assert second is not None and second != first
    log = serve.stderr_tail()
    assert f"pid {first} killed by signal SIGKILL" in log and "restart 1" in log and f"(pid {second})" in log


def test_a_crash_loop_ends_serve_with_exit_1_and_says_why(serve_tcp: Callable[..., tuple[Child, int]]) -> None:
    serve, _ = serve_tcp("--max-restarts", "2", "--restart-window", "120")
    killed: list[int] = []
    for _ in range(3):
        wait_for(lambda: slot_server_of(serve) not in (None, *killed), 60, "a new slot server")
        pid = slot_server_of(serve)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    assert serve.wait(timeout=60) == 1
    log = serve.stderr_tail()
    assert "slot server died 3 times within 120 s" in log and "giving up" in log
    assert log.splitlines()[-1].startswith("edgepath serve: error: slot server died 3 times")
    assert slot_server_of(serve) is None


def children_running(serve: Child, marker: bytes) -> list[int]:
    """Live children of ``serve`` whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(ppid) == serve.pid and state != "Z" and marker in cmdline:
                found.append(int(entry.name))
    return sorted(found)


def listeners(port: int) -> int:
    """TCP sockets listening on ``port`` (from /proc/net/tcp: the kernel's view, not a process's)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "0A")


def generate(port: int, prompt: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", "/v1/generate", body=json.dumps({"prompt": prompt}))
        response = conn.getresponse()
        assert response.status != 200 or json.loads(response.read())["text"] == prompt
        return response.status
    finally:
        conn.close()


def generated_ok(port: int) -> float:
    """``/v1/generate`` 200s counted by the /metrics of whichever worker takes this connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("edgepath_requests_total{") and 'route="/v1/generate"' in line and 'status="200"' in line
    )


def one_view(port: int, expected: float) -> bool:
    """Every one of several /metrics scrapes (new connections, so the kernel spreads them over the
    workers) counts ``expected`` answers: the workers' counters are one view, not one per worker."""
    return {generated_ok(port) for _ in range(8)} == {expected}


def test_workers_share_the_port_each_is_supervised_and_all_stop_together(
    serve_tcp: Callable[..., tuple[Child, int]],
) -> None:
    serve, port = serve_tcp("--workers", "2")
    workers = children_running(serve, b"--reuse-port")
    slot_server = slot_server_of(serve)
    assert len(workers) == 2 and slot_server is not None
    assert [generate(port, f"both up {i}") for i in range(10)] == [200] * 10
    wait_for(lambda: one_view(port, 10), 30, "every worker's /metrics to count all 10 answers")

    assert listeners(port) == 2
    os.kill(workers[0], signal.SIGKILL)
    wait_for(lambda: listeners(port) == 1, 30, "the killed worker's listening socket to be gone")
    assert [generate(port, f"one down {i}") for i in range(10)] == [200] * 10  # the other holds the port
    wait_for(lambda: len(children_running(serve, b"--reuse-port")) == 2, 60, "the worker to be restarted")
    assert slot_server_of(serve) == slot_server  # the shared slot server was never touched
    wait_for(lambda: one_view(port, 20), 30, "the counts of the killed worker to stay in the one view")

    assert serve.stop(timeout=30) == 0
    assert not children_running(serve, b"edgepath")


def test_a_slot_server_whose_serve_is_killed_stops_itself(serve_tcp: Callable[..., tuple[Child, int]]) -> None:
    """serve SIGKILLed cannot stop its children; its slot server notices the parent gone and stops as a SIGTERM stops
    it (found in a SIGKILL test whose orphan slot server ran on for good)."""
    serve, _ = serve_tcp()
    child = slot_server_of(serve)
    assert child is not None
    os.kill(serve.proc.pid, signal.SIGKILL)
    serve.proc.wait(10)
    wait_for(lambda: not _alive(child), 60, f"the orphaned slot server (pid {child}) to stop")


def test_a_slot_server_shares_the_session_of_serve_and_not_its_process_group(
    serve_tcp: Callable[..., tuple[Child, int]],
) -> None:
    """The slot server stays in serve's session (Linux's autogroup shares the CPUs equally among sessions: in one of
    its own, a busy edge left the model at most half of the box, and llama.cpp's threads, which wait for each other
    at every node, ran its steps 10-40x slower) and in a process group of its own (a Ctrl-C reaches serve only,
    which stops its children in order)."""
    serve, _ = serve_tcp()
    child = slot_server_of(serve)
    assert child is not None
    assert os.getsid(child) == os.getsid(serve.proc.pid)
    assert os.getpgid(child) == child != os.getpgid(serve.proc.pid)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped by init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
