"""Keeping the children ``edgepath serve`` starts alive: restart with bounded back-off, give up on a loop,
and kill a slot server that is alive but hung.

:class:`RestartPolicy` is the decision alone (sans-I/O: it is told when a child died and answers how
long to wait before the next start, or that this is a crash loop); :class:`Supervisor` is the thin
thread around it that waits for the child, logs why it ended, sleeps, and starts it again with the
same command line.  Re-attaching is not its business: the agent re-attaches to a slot server at the
same address on its own (``Agent.revive``), so a restarted child is picked up where it listens.

A hung child does not end by itself: :func:`hang_verdict` (sans-I/O) decides from its link's state that
it has been unresponsive too long, and :meth:`Supervisor.kill` ends it, after which it is restarted like
any child that died (and counted in the same crash-loop window).
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from edgepath.children import Child, ChildError, exit_reason
from edgepath.dpu.backoff import Backoff
from edgepath.dpu.link_state import LinkHealth, LinkState

log = logging.getLogger("edgepath.supervisor")


class GaveUp(RuntimeError):
    """A supervised child died too often: not a command-line mistake, so not exit status 2."""


@dataclass
class RestartPolicy:
    """Exponential back-off from ``first_delay`` doubling to at most ``max_delay`` (the agent's re-attach
    shape, :class:`~edgepath.dpu.backoff.Backoff`) counted over the deaths within ``window`` seconds; more
    than ``max_restarts`` of those is a crash loop.  Deaths older than the window are forgotten, so a child
    that has run quietly for a while starts again from ``first_delay``."""

    first_delay: float = 0.1
    max_delay: float = 2.0
    max_restarts: int = 5
    window: float = 60.0
    deaths: collections.deque[float] = field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        self._backoff = Backoff(self.first_delay, self.max_delay)
        if self.max_restarts < 0 or self.window <= 0:
            raise ValueError(f"need max_restarts >= 0 and window > 0, got {self.max_restarts}, {self.window}")

    def after_exit(self, now: float) -> float | None:
        """A child died at ``now`` (seconds, any monotonic clock): the delay before restarting it, or
        None when that would be restart number ``max_restarts + 1`` within the window."""
        while self.deaths and now - self.deaths[0] >= self.window:
            self.deaths.popleft()
        self.deaths.append(now)
        if len(self.deaths) > self.max_restarts:
            return None
        return self._backoff.delay(len(self.deaths))


def hang_verdict(health: LinkHealth, now: float) -> str | None:
    """Why a slot server must be killed, or None: its link has been UNRESPONSIVE for a whole hang timeout
    (its heartbeat stood still for twice that).  The second timeout lets a transient stall -- a swap storm,
    a step far over its budget -- end without losing the model's state; requests are refused meanwhile."""
    if health.state is not LinkState.UNRESPONSIVE or now - health.since < health.hang_timeout:
        return None
    return f"unresponsive for {now - health.since:.1f} s more after {health.describe(health.since)}"


class Supervisor:
    """Runs ``edgepath ARGS`` as a child and restarts it whenever it ends, until :meth:`stop`.

    ``on_give_up(message)`` is called (from the supervisor's thread) when the policy calls it a crash
    loop; the child is then left down."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        policy: RestartPolicy,
        on_give_up: Callable[[str], None],
        ready_timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        env: Mapping[str, str] | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> None:
        """``env``: the child's whole environment (default: this process's); ``stop_signal``: what :meth:`stop`
        sends it (SIGTERM: it stops gracefully; SIGINT: at once)."""
        self.name = name
        self.stop_signal = stop_signal
        self.args = list(args)
        self.env = env
        self.policy = policy
        self.restarts = 0
        self.hangs = 0  # children killed because they were hung
        self._killed: tuple[int, str] | None = None  # (pid, why) of the child killed last
        self._on_give_up = on_give_up
        self._ready_timeout = ready_timeout
        self._clock = clock
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._child: Child | None = None
        self._thread = threading.Thread(target=self._watch, name=f"supervise-{name}", daemon=True)

    @property
    def child(self) -> Child | None:
        """The current child (None before :meth:`start`); it may be a dead one awaiting restart."""
        return self._child

    def start(self) -> Child:
        """Start the child and wait until it is ready (:class:`ChildError` if it is not, or if
        :meth:`stop` was called meanwhile), then watch it."""
        child = self._start_child()
        with self._lock:
            if self._stopping.is_set():
                child.stop()
                raise ChildError(f"{self.name} was stopped while it started")
            self._child = child
        log.info("%s started (pid %d) at %s", self.name, child.pid, child.address)
        self._thread.start()
        return child

    def _start_child(self) -> Child:
        """A new child, once ready; given up at once when :meth:`stop` is called meanwhile (a start may be long:
        a slot server loads its model before it is ready)."""
        return Child.start(self.args, ready_timeout=self._ready_timeout, env=self.env, cancel=self._stopping)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop watching and stop the child (``stop_signal``, then SIGKILL after ``timeout``)."""
        self._stopping.set()
        with self._lock:
            child = self._child
        if child is not None:
            child.stop(timeout, self.stop_signal)
        if self._thread.is_alive():
            self._thread.join(self._ready_timeout + timeout + 5.0)

    def kill(self, why: str) -> bool:
        """SIGKILL the current child, which is alive but not working (``why`` says how); it is then
        restarted like a child that died.  False when there is no live child to kill (stopping, or it has
        ended already)."""
        with self._lock:
            child = self._child
            if child is None or child.poll() is not None or self._stopping.is_set():
                return False
            self._killed = (child.pid, why)
            self.hangs += 1
        log.error("%s (pid %d) is hung: %s; killing it", self.name, child.pid, why)
        child.kill()
        return True

    def _watch(self) -> None:
        assert self._child is not None
        child: Child | None = self._child
        reason = ""
        while True:
            if child is not None:
                reason = f"pid {child.pid} {exit_reason(child.wait())}"
                killed = self._killed
                if killed is not None and killed[0] == child.pid:
                    reason += f", by serve: hung, {killed[1]}"
            if self._stopping.is_set():
                return
            delay = self.policy.after_exit(self._clock())
            if delay is None:
                message = (
                    f"{self.name} died {len(self.policy.deaths)} times within {self.policy.window:g} s "
                    f"(last: {reason}); giving up"
                )
                log.error("%s", message)
                self._on_give_up(message)
                return
            log.warning("%s ended (%s); restart %d in %.2f s", self.name, reason, self.restarts + 1, delay)
            if self._stopping.wait(delay):
                return
            try:
                child = self._start_child()
            except ChildError as exc:
                child, reason = None, f"restart failed: {exc}"
                continue
            with self._lock:
                if self._stopping.is_set():
                    child.stop()
                    return
                self._child = child
            self.restarts += 1
            log.warning("%s restarted (pid %d) at %s", self.name, child.pid, child.address)
