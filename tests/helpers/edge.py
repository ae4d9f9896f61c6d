"""Helpers for the edge tests: an in-process ``edgepath serve`` on its own thread, test handlers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from edgepath.children import free_port as free_port  # the one free-port helper, re-exported for the tests
from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.adapters.quic_engine import QuicEngineError, load_engine
from edgepath.serve import run


@dataclass
class RunningEdge:
    options: ServeOptions
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.options.edge.port


@contextmanager
def running_edge(options: ServeOptions, tmp_path: Path, timeout: float = 60.0) -> Iterator[RunningEdge]:
    """``serve`` (edge, agent, slot-server child) on a thread; stopped and joined on exit."""
    if options.started.listen is None and options.starts_slot_server:
        listen = str(tmp_path / f"slots-{options.edge.port}.sock")
        options = replace(options, started=replace(options.started, listen=listen))
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    errors: list[BaseException] = []
    stop_box: list[asyncio.Event] = []

    async def main() -> None:
        stop = asyncio.Event()
        stop_box.append(stop)
        started = asyncio.Event()
        task = asyncio.ensure_future(run(options, started, stop))
        waiter = asyncio.ensure_future(started.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        ready.set()
        await task

    def target() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            errors.append(exc)
            ready.set()
        finally:
            loop.close()

    thread = threading.Thread(target=target, name=f"edge-{options.edge.port}", daemon=True)
    thread.start()
    if not ready.wait(timeout) or errors:
        raise RuntimeError(f"edge did not start: {errors}")
    try:
        yield RunningEdge(options, loop, thread)
    finally:
        if stop_box and thread.is_alive():
            loop.call_soon_threadsafe(stop_box[0].set)
        thread.join(timeout=30)


@contextmanager
def echo_edge_on(engine: str, tmp_path: Path, sizing: Sizing, frames: int) -> Iterator[RunningEdge]:
    """An echo ``serve`` on QUIC engine ``engine`` of ``sizing`` with ``frames`` agent frames, on a free port
    (the test is skipped where that engine is not installed)."""
    try:
        load_engine(engine)
    except QuicEngineError as exc:
        pytest.skip(str(exc))
    serve_options = ServeOptions(
        edge=EdgeSettings(port_asked=free_port(), quic_engine=engine),
        handler=HandlerSettings("echo"),
        sizing=sizing,
        agent=AgentSettings(frames=frames),
    )
    with running_edge(serve_options, tmp_path) as running:
        yield running
