"""How the edge should pick up completions: ``loop.add_reader`` on the CQ eventfd (what ``EdgeService``
does) or a dedicated thread blocking in the CQ wait that hands batches over with
``call_soon_threadsafe`` (the alternative, built here only to measure it).

Both drive the same ``EdgeService`` with the benchmark's 128-token prompt against a slot-server child
process, 1 and 16 requests in flight, and print edge-process CPU and wall time per request.
Run: ``.venv/bin/python -m edgepath.bench.completion_pickup --requests 2000`` (alternates the modes twice).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from edgepath.bench.edge_bench import prompt_of
from edgepath.dma.loopback import LoopbackTransport
from edgepath.dma.transport import Completion
from edgepath.dpu.agent import Agent
from edgepath.edge.http import HttpCore, Limits, Request, Response
from edgepath.edge.service import EdgeService
from edgepath.edge.tokenizer import Tokenizer, load_tokenizer
from edgepath.native.abi import lib


class ThreadPickupService(EdgeService):
    """EdgeService whose completions arrive from a thread blocked in the CQ wait."""

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._wait_loop, daemon=True)
        self._thread.start()

    def _wait_loop(self) -> None:
        while self._running:
            completions = self._cq.wait(0.2, max_entries=256)
            if completions:
                self.loop.call_soon_threadsafe(self._apply, completions)

    def _apply(self, completions: list[Completion]) -> None:
        for c in completions:
            index = self.agent.complete(c.conn_id, c.imm)
            if index is not None:
                self._finish(index)

    def stop(self) -> None:
        self._running = False
        self._thread.join()


async def measure(mode: str, address: str, tokenizer: Tokenizer, body: bytes, requests: int) -> list[str]:
    agent = Agent(LoopbackTransport(), frames=64)
    agent.attach(address)
    await asyncio.sleep(0.2)  # let the slot server admit this agent before the first doorbell
    cls = EdgeService if mode == "reader" else ThreadPickupService
    core = HttpCore(Limits(1 << 20, 4096, 4096, tokenizer.vocab_size))
    service = cls(core, tokenizer, agent, asyncio.get_running_loop(), ThreadPoolExecutor(1))
    service.start()
    lines = []
    try:
        for inflight in (1, 16):
            gate = asyncio.Semaphore(inflight)
            done = asyncio.Event()
            answered = 0

            def respond(response: Response, gate: asyncio.Semaphore = gate, done: asyncio.Event = done) -> None:
                nonlocal answered
                if response.status != 200:
                    raise RuntimeError(f"unexpected {response.status}")
                gate.release()
                answered += 1
                if answered == requests:
                    done.set()

            answered = 0
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(requests):
                await gate.acquire()
                service.handle(Request("POST", "/v1/generate", [], body, lib.ep_now_ns()), respond)
            await done.wait()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            lines.append(
                f"{mode:7} {inflight:2} in flight: {cpu / requests * 1e6:5.0f} us CPU, "
                f"{wall / requests * 1e6:5.0f} us wall per request"
            )
    finally:
        service.stop()
        agent.transport.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    address = os.path.join(tempfile.mkdtemp(prefix="edgepath-pickup-"), "slots.sock")
    child = subprocess.Popen(
        [sys.executable, "-m", "edgepath", "slot-server", "--listen", address, "--slots", "64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        if not child.stdout.readline().startswith("ready"):
            raise RuntimeError("slot server did not start")
        tokenizer = load_tokenizer()
        body = json.dumps({"prompt": prompt_of(128), "max_tokens": 128}).encode()
        for mode in ("reader", "thread", "reader", "thread"):
            for line in asyncio.run(measure(mode, address, tokenizer, body, args.requests)):
                print(line, flush=True)
    finally:
        child.terminate()
        child.wait(timeout=10)


if __name__ == "__main__":
    main()
