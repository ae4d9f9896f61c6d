"""``edgepath bench refusals``: what a refused request costs the edge, and the model's throughput under a flood of
them (issue 52 item 3, "refusals that cost almost nothing": a refused attempt costs at most 0.5 ms of edge CPU, and
under a flood of 200 refused attempts/s the model's tokens/s stays within 5 % of the same load without the flood).

``edgepath serve`` (its default handler: the real model) with a tenants file of two keys: ``steady``, no limits, and
``refused``, one request a day -- spent before the run, so every later request of it is refused (429
``quota_exceeded``), from its headers.  Per transport (``--transports``: HTTP/1.1, HTTP/3):

* ``idle``: nothing sent for ``--seconds`` -- the edge's CPU at rest (heartbeats, timers);
* ``flood only``: the refused tenant's flood (below) with nothing else running -- the edge's CPU;
* ``alone``: ``--streams`` streamed chats of ``steady`` in a closed loop for ``--seconds`` -- the model's output
  tokens/s (each answer's tokens counted where its chunks arrived in the window), the edge's CPU;
* ``flood``: the same loop while ``--clients`` clients of ``refused`` send chats (of ``--flood-body`` bytes) at
  ``--rate`` attempts/s in all, open loop, on kept connections (HTTP/1.1 keep-alive, one QUIC connection each: as
  retrying clients do), from a process of their own -- the tokens/s again, the edge's CPU, the flood's own CPU.

The edge's CPU per refused attempt is the serve process's CPU (edge and agent, from /proc) in ``flood only`` less
that in ``idle``, over the attempts refused; and, as a second reading, ``flood`` less ``alone`` -- which holds only
while the steady loop costs the same in both windows (on a machine shared with other work it need not: the model's
pace, and so the edge's work for it, moves with what else runs).  Clients are libcurl's (curl_cffi),
HTTP/1.1 in the clear and HTTP/3 over the edge's certificate.  Every process shares the machine's cores: the load
average before each phase is reported.

    edgepath bench refusals [--transports tcp,quic] [--seconds 30] [--rate 200] [--doc docs/PERFORMANCE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgepath.bench.model_compare import machine
from edgepath.bench.proc import cpu_seconds, tree_cpu_seconds
from edgepath.bench.readme import rewrite_block
from edgepath.children import free_port

KEYS = {"steady": "steady-key", "refused": "refused-key"}
#: issue 52's targets: edge CPU per refused attempt, the model's tokens/s under the flood against without it
COST_TARGET_MS, THROUGHPUT_TARGET = 0.5, 0.95
PROMPT = "Count from one to two hundred in words, one number per line."


def tenants_toml() -> str:
    def digest(key: str) -> str:
        return "sha256:" + hashlib.sha256(key.encode()).hexdigest()

    return (
        f'[tenants.steady]\nkeys = ["{digest(KEYS["steady"])}"]\n\n'
        f'[tenants.refused]\nkeys = ["{digest(KEYS["refused"])}"]\nrequests_per_day = 1\n'
    )


@dataclass(frozen=True)
class Target:
    """Where and how to reach the serve under test."""

    transport: str
    port: int
    certificate: str

    @property
    def url(self) -> str:
        scheme = "https" if self.transport == "quic" else "http"
        return f"{scheme}://localhost:{self.port}/v1/chat/completions"

    def options(self) -> dict[str, Any]:
        from curl_cffi import CurlHttpVersion

        version = CurlHttpVersion.V3ONLY if self.transport == "quic" else CurlHttpVersion.V1_1
        return {"http_version": version, "verify": self.certificate, "timeout": 300}


def chat(model: str, key: str, max_tokens: int, pad: int = 0) -> tuple[bytes, dict[str, str]]:
    doc: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": PROMPT}],
    }  # fmt: skip
    body = json.dumps(doc).encode()
    if pad > len(body):  # a longer chat of the same question: the user's turn padded with spaces
        doc["messages"][0]["content"] = PROMPT + " " * (pad - len(body))
        body = json.dumps(doc).encode()
    return body, {"authorization": f"Bearer {key}", "content-type": "application/json"}


# -- the steady tenant: a closed loop of streamed chats ------------------------------------------------------------
@dataclass
class Answer:
    status: int
    tokens: int
    chunks: list[float]


async def steady_loop(target: Target, model: str, streams: int, max_tokens: int, until: float) -> list[Answer]:
    from curl_cffi.requests import AsyncSession

    body, headers = chat(model, KEYS["steady"], max_tokens)
    answers: list[Answer] = []

    async def one(session: AsyncSession[Any]) -> None:
        while time.perf_counter() < until:
            chunks: list[float] = []
            data = bytearray()
            response = await session.post(target.url, data=body, headers=headers, stream=True, **target.options())
            async for chunk in response.aiter_content():
                chunks.append(time.perf_counter())
                data += chunk
            await response.aclose()
            tokens = 0
            for line in bytes(data).split(b"\n"):
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            answers.append(Answer(response.status_code, tokens, chunks))

    async with AsyncSession(max_clients=streams) as session:
        await asyncio.gather(*(one(session) for _ in range(streams)))
    return answers


def tokens_per_second(answers: list[Answer], w0: float, w1: float) -> float:
    """Output tokens that arrived in [w0, w1] a second: each answer's tokens in proportion to its chunks there."""
    total = 0.0
    for a in answers:
        if a.status == 200 and a.chunks:
            total += a.tokens * sum(w0 <= t <= w1 for t in a.chunks) / len(a.chunks)
    return total / (w1 - w0)


# -- the refused tenant: an open loop in a process of its own --------------------------------------------------------
def _flood(
    target: Target, model: str, clients: int, rate: float, window: tuple[float, float], pad: int, out: Any
) -> None:
    asyncio.run(_flood_async(target, model, clients, rate, window, pad, out))


async def _flood_async(
    target: Target, model: str, clients: int, rate: float, window: tuple[float, float], pad: int, out: Any
) -> None:
    """``rate`` attempts a second over ``window`` (perf_counter times: CLOCK_MONOTONIC, the parent's clock too),
    spread over ``clients`` kept connections opened before it."""
    from curl_cffi.requests import AsyncSession

    body, headers = chat(model, KEYS["refused"], 8, pad)
    statuses: dict[str, int] = {}
    late: list[float] = []
    sessions: list[AsyncSession[Any]] = [AsyncSession(max_clients=1) for _ in range(clients)]

    async def attempt(session: AsyncSession[Any]) -> None:
        try:
            response = await session.post(target.url, data=body, headers=headers, **target.options())
            key = str(response.status_code)
        except Exception as exc:  # a failed attempt is counted by its kind, never lost
            key = type(exc).__name__
        statuses[key] = statuses.get(key, 0) + 1

    for session in sessions:  # the connections, opened before the window
        await attempt(session)
    statuses.clear()
    start, end = window
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    cpu0 = time.process_time()
    tasks = []
    for i in range(int(rate * (end - start))):
        due = start + i / rate
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        late.append(max(0.0, time.perf_counter() - due))
        tasks.append(asyncio.ensure_future(attempt(sessions[i % clients])))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    for session in sessions:
        await session.close()
    out.put({"statuses": statuses, "wall_s": wall, "cpu_s": cpu, "late_p90_ms": _p90(late) * 1e3, "bytes": len(body)})


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))] if values else 0.0


# -- the run -------------------------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    loadavg: float
    wall_s: float = 0.0
    edge_cpu_s: float = 0.0
    model_cpu_s: float = 0.0
    tokens_per_s: float = 0.0
    answers: int = 0
    flood: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    transport: str
    alone: Phase
    flooded: Phase
    idle: Phase
    flood_only: Phase
    refused: int = 0
    ms_per_refusal: float | None = None  # the flood's CPU with the steady load, over its refusals
    ms_per_refusal_only: float | None = None  # the flood's CPU with nothing else running, over its refusals
    throughput_ratio: float | None = None


class Served:
    """``edgepath serve`` with the two tenants over one transport."""

    def __init__(self, transport: str, out: Path, extra: list[str]) -> None:
        state = Path(tempfile.mkdtemp())
        tenants = state / "tenants.toml"
        tenants.write_text(tenants_toml())
        self.port = free_port(kind=socket.SOCK_DGRAM if transport == "quic" else socket.SOCK_STREAM)
        env = dict(os.environ, XDG_STATE_HOME=str(state))
        env.pop("EDGEPATH_API_KEYS", None)
        argv = [sys.executable, "-m", "edgepath.cli", "serve", "--transport", transport, "--port", str(self.port),
                "--tenants-file", str(tenants), *extra]  # fmt: skip
        log = (out / f"serve-{transport}.log").open("w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            raise RuntimeError(f"serve did not start ({line!r}); see {log.name}")
        self.target = Target(transport, self.port, str(state / "edgepath" / "edge-cert.pem"))  # where serve made it

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def phase(
    served: Served, model: str, args: argparse.Namespace, name: str, flood: bool, steady: bool = True
) -> tuple[Phase, list[Answer]]:
    """One window of ``--seconds``: with ``steady`` the steady loop (which runs on past it to its answers' ends),
    with ``flood`` the refused tenant's attempts over the same window; CPU read at its two ends."""
    pid = served.proc.pid
    result = Phase(name, round(os.getloadavg()[0], 2))
    t0 = time.perf_counter() + args.warmup  # the flood's connections are open by then
    window = (t0, t0 + args.seconds)
    queue: Any = None
    flooder = None
    if flood:
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        flooder = context.Process(
            target=_flood, args=(served.target, model, args.clients, args.rate, window, args.flood_body, queue)
        )
        flooder.start()
    load = steady_loop(served.target, model, args.streams, args.max_tokens, window[1]) if steady else _nothing()
    running = asyncio.ensure_future(load)
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    edge0, tree0 = cpu_seconds(pid), tree_cpu_seconds(pid)
    await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
    edge1, tree1, w1 = cpu_seconds(pid), tree_cpu_seconds(pid), time.perf_counter()
    answers = await running
    result.wall_s = round(w1 - t0, 2)
    result.edge_cpu_s = round(edge1 - edge0, 3)
    result.model_cpu_s = round((tree1 - tree0) - (edge1 - edge0), 2)
    result.tokens_per_s = round(tokens_per_second(answers, t0, w1), 2)
    result.answers = sum(1 for a in answers if a.status == 200)
    if flooder is not None:
        result.flood = await asyncio.to_thread(queue.get, True, 600)
        flooder.join(60)
    return result, answers


async def _nothing() -> list[Answer]:
    return []


async def run_transport(transport: str, args: argparse.Namespace, out: Path) -> Result:
    from curl_cffi.requests import AsyncSession

    extra = ["--start-timeout", str(args.start_timeout), *(["--handler", args.handler] if args.handler else [])]
    served = Served(transport, out, extra)
    try:
        async with AsyncSession() as session:
            models_url = served.target.url.replace("/v1/chat/completions", "/v1/models")
            auth = {"authorization": f"Bearer {KEYS['steady']}"}
            listing = await session.get(models_url, headers=auth, **served.target.options())
            model = listing.json()["data"][0]["id"]
            body, headers = chat(model, KEYS["refused"], 2)
            spent = await session.post(served.target.url, data=body, headers=headers, **served.target.options())
            if spent.status_code != 200:
                raise RuntimeError(f"the refused tenant's one request got {spent.status_code}: {spent.text[:200]}")
        await steady_loop(served.target, model, args.streams, args.max_tokens, time.perf_counter() + 5)  # warm
        idle, _ = await phase(served, model, args, "idle", flood=False, steady=False)
        only, _ = await phase(served, model, args, "flood only", flood=True, steady=False)
        alone, _ = await phase(served, model, args, "alone", flood=False)
        flooded, _ = await phase(served, model, args, "flood", flood=True)
    finally:
        served.close()
    result = Result(transport, alone, flooded, idle, only)
    refused_only = only.flood.get("statuses", {}).get("429", 0)
    if refused_only:  # the flood's CPU with nothing else running: no steady load whose own CPU varies to subtract
        added = only.edge_cpu_s - idle.edge_cpu_s * only.wall_s / idle.wall_s
        result.ms_per_refusal_only = round(added / refused_only * 1e3, 3)
    result.refused = flooded.flood.get("statuses", {}).get("429", 0)
    if result.refused:  # the flood's CPU: the window's edge CPU less the same window's without it
        added = flooded.edge_cpu_s - alone.edge_cpu_s * flooded.wall_s / alone.wall_s
        result.ms_per_refusal = round(added / result.refused * 1e3, 3)
    if alone.tokens_per_s:
        result.throughput_ratio = round(flooded.tokens_per_s / alone.tokens_per_s, 3)
    return result


def markdown(results: list[Result], args: argparse.Namespace, when: str) -> str:
    lines = [
        f"`edgepath bench refusals` ({when}; {machine()}; {args.streams} steady streams of {args.max_tokens} tokens, "
        f"{args.seconds:g} s a phase; the flood: {args.clients} clients, {args.rate:g} attempts/s, "
        f"{results[0].flooded.flood.get('bytes', 0) if results else 0}-byte chats; targets: <= {COST_TARGET_MS} ms "
        f"of edge CPU a refusal, tokens/s >= {THROUGHPUT_TARGET}x without the flood)",
        "",
        "| transport | load avg before (idle / flood only / alone / flood) | refused (statuses) | edge CPU idle / "
        "flood only / alone / flood (cores) | edge CPU a refusal (ms): flood only less idle; flood less alone | "
        "model tokens/s alone / flood (x) | flood generator (cores) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, f, i, o = r.alone, r.flooded, r.idle, r.flood_only
        lines.append(
            f"| {r.transport} | {i.loadavg} / {o.loadavg} / {a.loadavg} / {f.loadavg} | {r.refused} "
            f"({f.flood.get('statuses')}) | {i.edge_cpu_s / i.wall_s:.3f} / {o.edge_cpu_s / o.wall_s:.3f} / "
            f"{a.edge_cpu_s / a.wall_s:.3f} / {f.edge_cpu_s / f.wall_s:.3f} | {r.ms_per_refusal_only}; "
            f"{r.ms_per_refusal} | {a.tokens_per_s} / {f.tokens_per_s} ({r.throughput_ratio}) | "
            f"{f.flood.get('cpu_s', 0) / max(f.flood.get('wall_s', 1), 1e-9):.2f} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default="tcp,quic", help="comma-separated: tcp, quic (default both)")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each phase (default 30)")
    p.add_argument("--streams", type=int, default=2, help="the steady tenant's chats in flight (default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="the steady tenant's max_tokens (default 64)")
    p.add_argument("--rate", type=float, default=200.0, help="refused attempts a second (default 200)")
    p.add_argument("--clients", type=int, default=8, help="the flood's clients, a connection each (default 8)")
    p.add_argument("--flood-body", type=int, default=0, help="bytes of each flood chat (default: a short chat)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds from a phase's start to its window (default 3)")
    p.add_argument("--handler", default=None, help="serve's --handler (default: serve's own, the real model)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds serve's slot server may take to start")
    p.add_argument("--out", default="out/refusals", help="folder for refusals.json and the servers' logs")
    p.add_argument("--doc", default=None, help="rewrite this page's refusals block (docs/PERFORMANCE.md)")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d", time.gmtime())
    results = [asyncio.run(run_transport(t, args, out)) for t in args.transports.split(",")]
    report = {"machine": machine(), "args": vars(args), "results": [asdict(r) for r in results]}
    (out / "refusals.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(results, args, when)
    print(text)
    if args.doc:
        rewrite_block(Path(args.doc), "refusals", text)
    return 0 if all(r.refused for r in results) else 1
