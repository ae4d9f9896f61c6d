"""``edgepath bench edge-cpu``: the edge process's own CPU per request, without the QUIC engine.

What edgepath adds on top of an HTTP/3 engine, isolated: a request object goes through the edge
service (parse, route, tokenize into the frame, claim, write, doorbell), an echo slot server in its
own process answers over the loopback data path, and the delivery is formatted into the response
that an adapter would send.  The load is closed (``--concurrency`` requests always in flight) and
bounded in count; this process's CPU (user + system, from /proc/self/stat) is read around the
measured requests only, after a warm-up.  After ``--runs`` measured runs, one more run is profiled
(cProfile) and its time is split into the stages below: the shares say where the time goes (cProfile
inflates Python-heavy parts, so the figure is the unprofiled runs' median, never the profiled one).
``--doc docs/PERFORMANCE.md`` rewrites that page's ``bench:edge-cpu`` block; ``--profile FILE`` keeps the profile.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import platform
import pstats
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from edgepath.bench.proc import cpu_seconds
from edgepath.bench.readme import rewrite_block
from edgepath.children import Child
from edgepath.config import AgentSettings, HandlerSettings, ServeOptions, Sizing
from edgepath.edge.http import Headers, Request, Response
from edgepath.edge.text.tokenizer import load_tokenizer
from edgepath.native.abi import lib
from edgepath.peer_secret import PEER_SECRET_ENV

PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 10)
MAX_TOKENS = 128


@dataclass
class EdgeCpu:
    requests: int
    concurrency: int
    seconds: float
    cpu_us_per_request: float
    statuses: dict[int, int]

    def line(self) -> str:
        return (
            f"{self.requests} requests, {self.concurrency} in flight: {self.requests / self.seconds:,.0f} req/s, "
            f"edge process {self.cpu_us_per_request:.0f} µs CPU per request, statuses {self.statuses}"
        )


class _Reply:
    """Counts the answer and starts the next request (a closed loop)."""

    __slots__ = ("_done",)

    def __init__(self, done: _Done) -> None:
        self._done = done

    def respond(self, response: Response) -> None:
        self._done(response.status)

    def start(self, status: int, headers: Headers) -> None:
        raise AssertionError("the benchmark does not stream")

    def send(self, data: bytes) -> None:
        raise AssertionError("the benchmark does not stream")

    def end(self, data: bytes) -> None:
        raise AssertionError("the benchmark does not stream")


class _Done:
    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[], None], total: int) -> None:
        self.loop = loop
        self.send = send
        self.total = total
        self.answered = 0
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.finished = loop.create_future()

    def __call__(self, status: int) -> None:
        self.answered += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if self.sent < self.total:
            self.sent += 1
            self.loop.call_soon(self.send)
        elif self.answered == self.total and not self.finished.done():
            self.finished.set_result(None)


async def _drive(service: object, requests: int, concurrency: int, profile: cProfile.Profile | None) -> EdgeCpu:
    from edgepath.edge.service import EdgeService

    assert isinstance(service, EdgeService)
    loop = asyncio.get_running_loop()
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
    headers = [(b"content-type", b"application/json")]

    def send() -> None:
        now = lib.ep_now_ns()
        service.handle(Request("POST", "/v1/generate", headers, body, now, now), _Reply(done))

    done = _Done(loop, send, requests)
    for _ in range(min(concurrency, requests)):
        done.sent += 1
        send()
    t0, c0 = time.perf_counter(), cpu_seconds()
    if profile is not None:
        profile.enable()
    await done.finished
    if profile is not None:
        profile.disable()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    # the first `concurrency` requests were sent before the clock started; all were answered inside it
    return EdgeCpu(requests, concurrency, seconds, 1e6 * cpu / requests, done.statuses)


async def measure(
    requests: int, concurrency: int, warmup: int, runs: int, profile: bool
) -> tuple[list[EdgeCpu], cProfile.Profile | None]:
    """``runs`` measured runs, then (``profile``) one profiled run, on one edge and one slot server."""
    from edgepath.builder import build_agent, serve_transport, slot_server_argv, started_slot_server
    from edgepath.edge_builder import build_edge

    with tempfile.TemporaryDirectory(prefix="edgepath-edge-cpu-") as tmp:
        listen = str(Path(tmp) / "slots.sock")
        options = ServeOptions(
            handler=HandlerSettings("echo"),
            sizing=Sizing(slots=max(64, 2 * concurrency)),
            agent=AgentSettings(frames=max(256, 4 * concurrency)),
        )
        os.environ.setdefault(PEER_SECRET_ENV, secrets.token_hex(32))  # the slot server's and the agent's, this run's
        child = Child.start(slot_server_argv(started_slot_server(options, listen)))
        transport = serve_transport(options)
        assert transport is not None
        executor = ThreadPoolExecutor(max_workers=2)
        try:
            capacity = options.sizes.capacity
            agent = build_agent(options.agent, capacity, transport, (child.address or listen,))
            loop = asyncio.get_running_loop()
            tokenizer = load_tokenizer(None)
            service = build_edge(options.edge, capacity, tokenizer, agent, None, loop, executor)
            service.start()
            try:
                await _drive(service, warmup, concurrency, None)
                results = [await _drive(service, requests, concurrency, None) for _ in range(runs)]
                profiler = cProfile.Profile() if profile else None
                if profiler is not None:
                    await _drive(service, requests, concurrency, profiler)
                return results, profiler
            finally:
                service.stop()
        finally:
            executor.shutdown(wait=False)
            transport.close()
            child.stop()


def _cumulative(stats: dict, path: str, name: str) -> float:
    return sum(v[3] for (file, _, func), v in stats.items() if func == name and file.endswith(path))


def _own(stats: dict, name: str) -> float:
    return sum(v[2] for (_, _, func), v in stats.items() if name in func)


def breakdown(profiler: cProfile.Profile) -> list[tuple[float, str]]:
    """Shares of the profiled run's time by stage (the rest: the lifecycle, the service and the event loop)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = max(v[3] for v in stats.values())
    doorbell = _own(stats, "ep_write_imm") + _own(stats, "ep_write_then_imm")
    stages = [
        (_cumulative(stats, "edge/text/tokenizer.py", "encode_into"), "tokenizing the prompt into the frame"),
        (_cumulative(stats, "dpu/agent.py", "submit") - doorbell, "claim + send in Python (`Agent.submit`)"),
        (
            sum(_cumulative(stats, "edge/metrics.py", n) for n in ("answered", "edge", "first_token")),
            "metrics (prometheus_client, the HDR window of `/health?latency`)",
        ),
        (_cumulative(stats, "edge/http.py", "handle"), "parse + route (`HttpCore.handle`)"),
        (doorbell, "the doorbell: eventfd write to a sleeping slot-server poller (none while it is awake)"),
        (_cumulative(stats, "edge/text/tokenizer.py", "decode"), "detokenizing the answer's `text`"),
        (_cumulative(stats, "dpu/agent.py", "poll"), "taking deliveries (CQ poll, `Agent.deliver`)"),
        (_own(stats, "orjson"), "the answer's JSON (orjson)"),
    ]
    rows = [(100 * t / total, what) for t, what in stages]
    rows.append((100 - sum(share for share, _ in rows), "the rest: lifecycle, service, event loop"))
    return rows


def table(results: list[EdgeCpu], shares: list[tuple[float, str]] | None, command: str) -> str:
    cpu = [r.cpu_us_per_request for r in results]
    rate = statistics.median(r.requests / r.seconds for r in results)
    lines = [
        f"Measured {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f} "
        f"at the end (`{command}`): **{statistics.median(cpu):.0f} µs** of the edge process's CPU per request "
        f"(median of {len(cpu)} runs: {', '.join(f'{c:.0f}' for c in cpu)}), {results[0].requests:,} requests "
        f"each, {results[0].concurrency} in flight, {rate:,.0f} requests/s.",
    ]
    if shares:
        lines += ["", "| share of a profiled run | stage |", "|---:|---|"]
        lines += [f"| {share:.1f}% | {what} |" for share, what in shares]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``edgepath bench edge-cpu`` (arguments defined in bench/cli.py)."""
    for name in ("requests", "concurrency", "runs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {args.warmup}")
    profile = not args.no_profile
    results, profiler = asyncio.run(measure(args.requests, args.concurrency, args.warmup, args.runs, profile))
    for result in results:
        print(result.line())
    if profiler is not None and args.profile:
        profiler.dump_stats(args.profile)
    command = f"edgepath bench edge-cpu --requests {args.requests} --runs {args.runs}"
    text = table(results, breakdown(profiler) if profiler is not None else None, command)
    print(text)
    bad = [r.statuses for r in results if set(r.statuses) != {200}]
    if bad:
        print(f"not every request was answered 200: {bad}")
        return 1
    if args.doc:
        rewrite_block(Path(args.doc), "edge-cpu", text)
    return 0
