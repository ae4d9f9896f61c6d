"""``edgepath serve``: edge + in-process agent + its slot servers (running ones at ``--slot-server``,
and unless only those are given, a supervised local one).

The local slot server runs as a child process, exactly as it would run alone (``edgepath slot-server``,
its command line made from the same configuration), and is restarted with bounded back-off when it
dies.  The agent has one link per slot server; a link that fails is out of admission at once and is
re-attached with bounded back-off when its slot server is back where it listens, started here or
not.  The agent lives in the edge's process, so the edge writes token ids straight into the agent's
registered frames.  The process prints ``ready <url>`` on stdout once it accepts requests, and stops
everything it started on SIGINT -- and on SIGTERM once the edge has drained: no new requests, those under way
answered, within ``--grace-period`` (a second SIGTERM stops at once).

With ``--workers N`` this process only supervises: N edge processes (each this same command with its
own in-process agent, on the shared port with SO_REUSEPORT) and the slot servers they all use -- and keeps the
quota ledger the workers count the tenants' quotas in together (:mod:`edgepath.dpu.ledger`; ``--quota-listen``
keeps it where edges of other serve processes reach it too).

This module orchestrates only -- what starts when, who supervises it, signals, the ready line; every
part is made by :mod:`edgepath.builder` from the configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from edgepath.builder import (
    ledger_home,
    plan_serve,
    serve_agent,
    serve_transport,
    slot_server_argv,
    watch_started_slot_server,
    with_peer_secret,
    worker_argv,
)
from edgepath.config import ServeOptions
from edgepath.edge.metrics import SHARED_DIR_ENV
from edgepath.edge_builder import on_sighup, start_edge, with_one_certificate
from edgepath.hangwatch import read_counts
from edgepath.runtime import runtime_dir
from edgepath.supervisor import GaveUp, RestartPolicy, Supervisor

log = logging.getLogger("edgepath.serve")


async def run(options: ServeOptions, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None); :class:`GaveUp` when a
    started child (the slot server, or an edge worker) keeps dying."""
    options, own_secret = with_peer_secret(options)  # a fresh one, when serve starts every peer it talks to
    try:
        await _run(options, ready, stop)
    finally:
        if own_secret is not None:
            own_secret.unlink(missing_ok=True)


async def _run(options: ServeOptions, ready: asyncio.Event | None, stop: asyncio.Event | None) -> None:
    loop = asyncio.get_running_loop()
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection at INFO
    plan = plan_serve(options)  # every choice checked before anything starts
    options = plan.options
    workers = options.supervision.workers
    drain = asyncio.Event()  # a graceful stop asked (SIGTERM): the edge finishes what it has, then stops
    if stop is None:
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        # An edge drains on a first SIGTERM; a supervising serve (--workers) stops its workers with SIGTERM,
        # which drain themselves.
        loop.add_signal_handler(signal.SIGTERM, drain.set if workers == 1 else stop.set)
    gave_up: list[str] = []

    def give_up(message: str) -> None:  # called on a supervisor's thread
        gave_up.append(message)
        loop.call_soon_threadsafe(stop.set)

    def supervisor(
        name: str, argv: list[str], env: dict[str, str] | None = None, stop_signal: int = signal.SIGTERM
    ) -> Supervisor:
        policy = RestartPolicy(max_restarts=options.supervision.max_restarts, window=options.supervision.restart_window)
        made = Supervisor(
            name,
            argv,
            policy,
            give_up,
            ready_timeout=options.supervision.start_timeout,
            env=env,
            stop_signal=stop_signal,
        )
        cleanup.callback(made.stop)
        return made

    with contextlib.ExitStack() as cleanup:
        transport = serve_transport(options)  # an unusable device fails here, before any child
        if transport is not None:
            cleanup.callback(transport.close)
        shared = _shared_metrics_dir(options, cleanup) if workers > 1 else None
        home = options.edge.quota_listen or (str(runtime_dir() / f"{options.name}.quota.sock") if workers > 1 else None)
        if home is not None:  # a quota ledger kept here: this serve's edges count in it, and so may others
            ledger_home(home, options, cleanup)
            options = replace(options, edge=replace(options.edge, quota_home=home, quota_listen=None))
            plan = replace(plan, options=options)
        slot_servers = options.slot_servers
        counts = _shared_counts()  # this is an edge worker: its parent keeps the counts in the shared directory
        listen = None
        drain_edge: Callable[[], Awaitable[None]] | None = None
        if plan.slot_server is not None:
            # stopped when the edges have: at once (SIGINT), not drained for agents that are gone or going
            local = supervisor("slot server", slot_server_argv(plan.slot_server), stop_signal=signal.SIGINT)
            listen = local.start().address or plan.slot_server.listen
            watch = watch_started_slot_server(options, local, listen, shared)
            cleanup.callback(watch.stop)  # before the supervisor stops: no kill while everything stops
            watch.start()
            counts = lambda: (local.restarts, local.hangs)  # noqa: E731
            slot_servers = (listen, *slot_servers)
        if workers > 1:
            assert shared is not None
            env = dict(os.environ, **{SHARED_DIR_ENV: shared})
            argv = worker_argv(with_one_certificate(options), slot_servers)  # one certificate for all
            children = [supervisor(f"edge worker {i}", argv, env) for i in range(workers)]
            await asyncio.gather(*(asyncio.to_thread(child.start) for child in children))  # they start together
            if on_sighup(loop, functools.partial(_forward, signal.SIGHUP, children)):  # each worker reloads its keys
                cleanup.callback(loop.remove_signal_handler, signal.SIGHUP)
            what = f"{workers} edge workers"
        else:
            agent = serve_agent(options, transport, slot_servers, listen)
            if transport is None:
                cleanup.callback(agent.transport.close)
            drain_edge = await start_edge(plan, agent, loop, cleanup, counts)
            what = "edge"
        protocol = "HTTP/3 over QUIC" if options.edge.transport == "quic" else "HTTP/1.1"
        log.info("%s (%s) listening on %s", what, protocol, options.edge.url)
        print(f"ready {options.edge.url}", flush=True)
        if ready is not None:
            ready.set()
        await _first(stop, drain)
        if drain.is_set() and not stop.is_set() and drain_edge is not None:
            loop.add_signal_handler(signal.SIGTERM, stop.set)  # a second SIGTERM stops at once
            finished = asyncio.ensure_future(drain_edge())
            await _first(stop, finished)
            finished.cancel()
    if gave_up:
        raise GaveUp(gave_up[0])


def _forward(signum: int, supervisors: list[Supervisor]) -> None:
    """Pass ``signum`` on to each supervised child that is running."""
    for made in supervisors:
        child = made.child
        if child is not None:
            child.send_signal(signum)


async def _first(stop: asyncio.Event, other: asyncio.Event | asyncio.Future[None]) -> None:
    """Wait until ``stop`` is set or ``other`` is set (an event) or done (a future)."""
    waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(stop.wait())}
    waits.add(asyncio.ensure_future(other.wait()) if isinstance(other, asyncio.Event) else other)
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        if wait is not other:
            wait.cancel()


def _shared_metrics_dir(options: ServeOptions, cleanup: contextlib.ExitStack) -> str:
    """A fresh directory where the workers keep their metrics (one /metrics view), removed at the end."""
    path = runtime_dir() / f"{options.name}.metrics"
    shutil.rmtree(path, ignore_errors=True)  # counts of an earlier run are not this one's
    path.mkdir(mode=0o700)
    cleanup.callback(shutil.rmtree, path, ignore_errors=True)
    return str(path)


def _shared_counts() -> Callable[[], tuple[int, int] | None] | None:
    """In an edge worker of ``serve --workers``: the supervision counts its parent's hang watch keeps in the
    shared metrics directory; elsewhere None."""
    shared = os.environ.get(SHARED_DIR_ENV)
    return None if shared is None else functools.partial(read_counts, shared)


def serve(options: ServeOptions) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(options))
    return 0
