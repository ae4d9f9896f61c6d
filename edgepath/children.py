"""Child ``edgepath`` processes: start one, wait for its ``ready ADDRESS`` line, stop it; a free port.

Every edgepath command that listens prints ``ready ADDRESS`` on stdout once it accepts work.  This is
the one place that starts such a command as a child (``serve`` for its slot server, the tests, the
benchmarks), so a child that fails to start always reports the same way: what was run, how it ended,
and the tail of what it wrote on stderr.  Both output streams are drained by threads for the child's
whole life (a child never blocks on a full pipe); stderr is passed on to ours and its tail kept.
A child runs in its own session: signals meant for its parent's process group (a terminal's Ctrl-C)
reach the parent alone, which stops its children itself -- a supervisor never mistakes that for a crash.
A parent that dies without stopping them (SIGKILL, an OOM kill) cannot; so each child watches for its parent's
end (:func:`watch_parent`) and then stops itself as a SIGTERM stops it -- no orphan serves on for good.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import IO

STDERR_TAIL_LINES = 20
#: seconds between looks at a start's ``cancel`` event while it waits for the ready line
CANCEL_POLL = 0.05
#: the environment variable that tells a child its parent's pid (:func:`watch_parent`)
PARENT_ENV = "EDGEPATH_PARENT_PID"
#: seconds between a child's looks at whether its parent is still there
PARENT_POLL = 0.5

log = logging.getLogger("edgepath.children")


def watch_parent(environ: MutableMapping[str, str] = os.environ, poll: float = PARENT_POLL) -> threading.Thread | None:
    """In a child started by :meth:`Child.start`: a daemon thread that sends this process SIGTERM (its own stop:
    a slot server drains, then exits) once the parent is gone -- reparented, its pid no longer the parent's.  A
    thread, not ``PR_SET_PDEATHSIG``: that fires when the parent *thread* that started the child ends, and a
    supervisor restarts children from threads of its own.  None when this process is no such child.  The variable
    is taken out of ``environ``: a process this one starts otherwise is not told a parent that is not its own."""
    try:
        parent = int(environ.pop(PARENT_ENV))
    except (KeyError, ValueError):
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        log.error("the parent process %d is gone: stopping as SIGTERM stops this command", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="watch-parent", daemon=True)
    thread.start()
    return thread


class ChildError(RuntimeError):
    """A child did not start (or could not be stopped)."""


def exit_reason(returncode: int) -> str:
    """``exit code 3`` or ``killed by signal SIGKILL``: how a child ended, for logs and errors."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exit code {returncode}"


def edgepath_argv(*args: str) -> list[str]:
    """The command line of ``edgepath ARGS`` run by this interpreter, verbose (``-v``) when this process logs its
    debug messages: ``edgepath -v serve`` promises every process's, its slot-server child's per-step lines too."""
    verbose = ["-v"] if logging.getLogger().isEnabledFor(logging.DEBUG) else []
    return [sys.executable, "-m", "edgepath", *verbose, *args]


def free_port(kind: int = socket.SOCK_DGRAM, host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (UDP for QUIC by default, ``socket.SOCK_STREAM`` for TCP)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Child:
    """A running ``edgepath`` command that has printed ``ready ADDRESS``."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str, forward_stderr: bool) -> None:
        self.proc = proc
        self.name = name
        self.address: str | None = None
        self._ready = threading.Event()
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        assert proc.stdout is not None and proc.stderr is not None
        self._pumps = [
            threading.Thread(target=self._pump_stdout, args=(proc.stdout,), name=f"{name}-stdout", daemon=True),
            threading.Thread(
                target=self._pump_stderr, args=(proc.stderr, forward_stderr), name=f"{name}-stderr", daemon=True
            ),
        ]
        for pump in self._pumps:
            pump.start()

    @classmethod
    def start(
        cls,
        args: Sequence[str],
        *,
        ready_timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
        forward_stderr: bool = True,
        argv: Sequence[str] | None = None,
        cancel: threading.Event | None = None,
    ) -> Child:
        """Run ``edgepath ARGS`` (or ``argv``, a whole command line that prints the same ready line)
        and return once it is ready; :class:`ChildError` with its stderr tail when it is not within
        ``ready_timeout`` seconds, or at once when ``cancel`` is set meanwhile (the child is then stopped)."""
        command = list(argv) if argv is not None else edgepath_argv(*args)
        name = args[0] if argv is None and args else os.path.basename(command[0])
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())},
            # A process group of its own: a Ctrl-C reaches the parent only, which stops its children in order.  Not
            # a session of its own: Linux's autogroup gives every session an equal share of the CPUs, so a slot server
            # in one got at most half of a box whose edge was busy (docs/MODEL.md, "Sharing the CPUs").
            process_group=0,
        )
        child = cls(proc, name, forward_stderr)
        child._await_ready(" ".join(command[1:] if argv is None else command), ready_timeout, cancel)
        return child

    def _await_ready(self, what: str, timeout: float, cancel: threading.Event | None) -> None:
        closed = self._wait_ready(timeout, cancel)
        if self.address is not None:
            return
        if cancel is not None and cancel.is_set():
            self.stop()
            raise ChildError(f"{self.name} was stopped while it started: {what!r}")
        if closed:  # stdout ended without the line: the child is on its way out
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)
        if self.proc.poll() is None:
            self.stop()
            how = f"printed no 'ready' line within {timeout:g} s"
        else:
            self._pumps[1].join(timeout=5.0)  # the whole of stderr, up to the exit
            how = f"ended ({exit_reason(self.proc.returncode)}) before it was ready"
        tail = self.stderr_tail()
        raise ChildError(f"{self.name} did not start: {what!r} {how}" + (f"; its stderr ends:\n{tail}" if tail else ""))

    def _wait_ready(self, timeout: float, cancel: threading.Event | None) -> bool:
        """Whether the ready line (or the end of stdout) came within ``timeout`` seconds and before ``cancel``."""
        if cancel is None:
            return self._ready.wait(timeout)
        deadline = time.monotonic() + timeout
        while not self._ready.wait(min(CANCEL_POLL, max(0.0, deadline - time.monotonic()))):
            if cancel.is_set() or time.monotonic() >= deadline:
                return False
        return True

    def _pump_stdout(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").strip()
            if self.address is None and line.startswith("ready "):
                self.address = line.split(None, 1)[1]
                self._ready.set()
        self._ready.set()  # end of output: whoever waits for ready learns it will not come

    def _pump_stderr(self, stream: IO[bytes], forward: bool) -> None:
        for raw in stream:
            self._tail.append(raw.decode(errors="replace").rstrip("\n"))
            if forward:
                try:
                    os.write(2, raw)
                except OSError:
                    forward = False  # our own stderr is gone: keep draining, keep the tail

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self) -> str:
        """The last lines the child wrote on stderr."""
        return "\n".join(self._tail)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The child's return code once it has ended (``subprocess.TimeoutExpired`` after ``timeout``);
        what it wrote up to its end is then in :meth:`stderr_tail`."""
        code = self.proc.wait(timeout)
        self._join_pumps()
        return code

    def send_signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL: the child gets no chance to clean up (what a crash looks like from outside)."""
        self.proc.kill()

    def stop(self, timeout: float = 10.0, signum: int = signal.SIGTERM) -> int:
        """``signum`` (SIGTERM: a graceful stop; SIGINT: at once), then SIGKILL if it has not ended within
        ``timeout`` seconds; its return code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                try:
                    self.proc.wait(5.0)
                except subprocess.TimeoutExpired as exc:
                    raise ChildError(f"{self.name} (pid {self.pid}) did not end after SIGKILL") from exc
        self._join_pumps()
        return self.proc.returncode

    def _join_pumps(self) -> None:
        for pump in self._pumps:
            if pump is not threading.current_thread():
                pump.join(timeout=1.0)
