"""Helpers for the edge tests: an in-process ``edgepath serve`` on its own thread, test handlers."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from edgepath.children import free_port as free_port  # the one free-port helper, re-exported for the tests
from edgepath.config import ServeOptions
from edgepath.dma.handlers import SlotRequest
from edgepath.edge.serve import run


@dataclass
class RunningEdge:
    options: ServeOptions
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.options.port


@contextmanager
def running_edge(options: ServeOptions, tmp_path: Path, timeout: float = 60.0) -> Iterator[RunningEdge]:
    """``serve`` (edge, agent, slot-server child) on a thread; stopped and joined on exit."""
    if options.slot_server_listen is None:
        options = replace(options, slot_server_listen=str(tmp_path / f"slots-{options.port}.sock"))
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

    thread = threading.Thread(target=target, name=f"edge-{options.port}", daemon=True)
    thread.start()
    if not ready.wait(timeout) or errors:
        raise RuntimeError(f"edge did not start: {errors}")
    try:
        yield RunningEdge(options, loop, thread)
    finally:
        if stop_box and thread.is_alive():
            loop.call_soon_threadsafe(stop_box[0].set)
        thread.join(timeout=30)


def slow_echo(request: SlotRequest) -> int:
    """Echo after 0.2 s of pretend model time, so a burst of requests outnumbers free slots."""
    time.sleep(0.2)
    n = min(len(request.tokens), len(request.output))
    request.output[:n] = request.tokens[:n]
    return n


def paced_echo(request: SlotRequest) -> int:
    """Echo after 10 ms: a slot server with a known capacity (about 100 requests/s, one at a time)."""
    time.sleep(0.01)
    n = min(len(request.tokens), len(request.output))
    request.output[:n] = request.tokens[:n]
    return n
