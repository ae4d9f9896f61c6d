"""Where the edge's CPU goes per request, without QUIC: the service driven directly, under cProfile.

Requests (the benchmark's 128-token prompt) go through ``EdgeService.handle`` -> tokenizer -> agent ->
a slot server on a thread of this process (echo) -> completion -> response object.  What is left out
is exactly what the QUIC floor measures (aioquic), so this plus the floor explains the edge's cost.

Run: ``.venv/bin/python -m edgepath.bench.profile_edge --requests 3000 [--profile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from edgepath.bench.edge_bench import prompt_of
from edgepath.dma.handlers import echo
from edgepath.dma.loopback import LoopbackTransport
from edgepath.dma.slot_server import SlotServer, SlotServerConfig
from edgepath.dpu.agent import Agent
from edgepath.edge.http import HttpCore, Limits, Request, Response
from edgepath.edge.service import EdgeService
from edgepath.edge.tokenizer import load_tokenizer
from edgepath.native.abi import lib


async def drive(
    service: EdgeService, body: bytes, requests: int, inflight: int, profile: cProfile.Profile | None
) -> None:
    done = asyncio.Event()
    answered = 0

    def respond(response: Response) -> None:
        nonlocal answered
        if response.status != 200:
            raise RuntimeError(f"unexpected {response.status}: {response.body!r}")
        answered += 1
        if answered == requests:
            done.set()

    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    for _ in range(requests):
        while len(service.inflight) >= inflight:
            await asyncio.sleep(0)
        service.handle(Request("POST", "/v1/generate", [], body, lib.ep_now_ns()), respond)
    await done.wait()
    if profile is not None:
        profile.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(f"{requests} requests: {cpu / requests * 1e6:.0f} us CPU and {wall / requests * 1e6:.0f} us wall per request")
    print("(CPU includes the slot-server thread's echo handler and doorbell handling, which share this process)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="print the top functions by own time")
    args = parser.parse_args()

    address = os.path.join(tempfile.mkdtemp(prefix="edgepath-profile-"), "slots.sock")
    server = SlotServer(LoopbackTransport(), address, echo, SlotServerConfig(slots=64))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    tokenizer = load_tokenizer()
    body = json.dumps({"prompt": prompt_of(128), "max_tokens": 128}).encode()

    async def run() -> None:
        agent = Agent(LoopbackTransport(), frames=256)
        agent.attach(address)
        core = HttpCore(Limits(1 << 20, 4096, 4096, tokenizer.vocab_size))
        service = EdgeService(core, tokenizer, agent, asyncio.get_running_loop(), ThreadPoolExecutor(1))
        service.start()
        profile = cProfile.Profile() if args.profile else None
        try:
            await drive(service, body, args.requests, args.inflight, profile)
        finally:
            service.stop()
            agent.transport.close()
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)

    try:
        asyncio.run(run())
    finally:
        server.stop()
        thread.join(timeout=5)
        server.close()


if __name__ == "__main__":
    main()
