"""``edgepath bench stream``: streamed responses under open-loop load, with the paced echo as the model.

One ``serve --transport tcp --handler paced-echo`` (one token per ``--token-delay``, the first at once) is
driven with open-loop (Poisson) streamed ``/v1/generate`` requests from this process (h11 over asyncio,
one connection per request, latency from each request's *scheduled* send time).  Per request: time to
first token and the gaps between token events as the client reads them, and the edge's own
``Server-Timing: return`` -- the return path of the first token, from the slot server's stamp when the
handler produced it to the edge handing its event to the transport (same host clock).  Every run is
bounded in requests and seconds; a run whose sends fall behind schedule says so.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import socket
import time
from pathlib import Path
from typing import Any

import h11
import numpy as np

from edgepath.bench.readme import rewrite_block
from edgepath.children import Child, free_port

PROMPT = " ".join(f"word{i}" for i in range(12))  # ~25 tokens with Tekken: a stream of that many events


async def one(port: int, due: float, out: dict[str, Any]) -> None:
    """One streamed request, sent at ``due`` (monotonic seconds); fills ``out``."""
    await asyncio.sleep(max(0.0, due - time.monotonic()))
    out["lag"] = time.monotonic() - due
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    body = json.dumps({"prompt": PROMPT, "stream": True}).encode()
    headers = [("host", "x"), ("content-type", "application/json"), ("content-length", str(len(body)))]
    writer.write(
        conn.send(h11.Request(method="POST", target="/v1/generate", headers=headers)) + conn.send(h11.Data(data=body))
    )
    writer.write(conn.send(h11.EndOfMessage()))
    events: list[float] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(65536)
            if not data:
                break
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Response):
            out["status"] = event.status_code
            timing = dict(event.headers).get(b"server-timing", b"").decode()
            found = re.search(r"return;dur=([0-9.]+)", timing)
            out["return_ms"] = float(found.group(1)) if found else None
        elif isinstance(event, h11.Data):
            now = time.monotonic()
            events.extend(now for _ in range(event.data.count(b'data: {"token"')))
        elif isinstance(event, h11.EndOfMessage):
            break
    writer.close()
    out["ttft_ms"] = (events[0] - due) * 1e3 if events else None
    out["gaps_ms"] = [(b - a) * 1e3 for a, b in itertools.pairwise(events)]


async def drive(port: int, rate: float, count: int, seconds: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    start, t = time.monotonic() + 0.2, 0.0
    offsets: list[float] = []
    while len(offsets) < count and t < seconds:
        offsets.append(t)
        t += rng.expovariate(rate)
    outs: list[dict[str, Any]] = [{} for _ in offsets]
    await asyncio.wait_for(
        asyncio.gather(*(one(port, start + o, r) for o, r in zip(offsets, outs, strict=True))), seconds + 60
    )
    return outs


def summarize(rate: float, outs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [o for o in outs if o.get("status") == 200 and o.get("ttft_ms") is not None]
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 2) if xs else None  # noqa: E731
    ttft = [o["ttft_ms"] for o in ok]
    gaps = [g for o in ok for g in o["gaps_ms"]]
    ret = [o["return_ms"] * 1e3 for o in ok if o.get("return_ms") is not None]  # µs
    lags = [o.get("lag", 0.0) * 1e3 for o in outs]
    return {
        "rate": rate,
        "sent": len(outs),
        "ok": len(ok),
        "429": sum(o.get("status") == 429 for o in outs),
        "ttft_ms": (pct(ttft, 50), pct(ttft, 99)),
        "itl_ms": (pct(gaps, 50), pct(gaps, 99)),
        "return_us": (pct(ret, 50), pct(ret, 99)),
        "client_bound": bool(lags) and float(np.percentile(lags, 99)) > 20.0,
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on 2 cores (`edgepath bench stream`): "
        f"paced echo, one token every {args.token_delay * 1e3:g} ms, {args.slots} slots, streamed `/v1/generate` "
        "over HTTP/1.1, open loop.",
        "",
        "| offered/s | sent | answered | 429 | TTFT p50 / p99 ms | inter-token p50 / p99 ms "
        "| return path p50 / p99 µs | client |",
        "|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']:g} | {r['sent']} | {r['ok']} | {r['429']} | {r['ttft_ms'][0]} / {r['ttft_ms'][1]} | "
            f"{r['itl_ms'][0]} / {r['itl_ms'][1]} | {r['return_us'][0]} / {r['return_us'][1]} | "
            f"{'client-bound' if r['client_bound'] else 'kept up'} |"
        )
    lines += [
        "",
        "Return path: the slot server's stamp when the handler produced the first token -> the edge hands its event "
        "to the transport (`Server-Timing: return`); target p50 ≤ 100 µs.",
    ]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="20,50,100", help="offered requests/s, comma-separated")
    p.add_argument("--requests", type=int, default=300, help="requests per rate at most")
    p.add_argument("--seconds", type=float, default=10.0, help="no request starts after this long in a run")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--token-delay", type=float, default=0.005, help="seconds between the paced echo's tokens")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="out/stream", help="folder for results.json")
    p.add_argument(
        "--doc",
        "--readme",
        dest="doc",
        type=Path,
        default=None,
        help="rewrite this page's stream block between its markers (docs/PERFORMANCE.md; --readme: its old name)",
    )


def main(args: argparse.Namespace) -> int:
    rates = [float(r) for r in args.rates.split(",")]
    if not rates or min(rates) <= 0 or args.requests < 1 or args.seconds <= 0:
        raise ValueError("--rates must be positive numbers, --requests >= 1 and --seconds > 0")
    port = free_port(socket.SOCK_STREAM)
    serve = Child.start(
        ["serve", "--transport", "tcp", "--port", str(port), "--slots", str(args.slots), "--handler", "paced-echo",
         "--handler-option", f"token_delay={args.token_delay}", "--input-capacity", "256", "--output-capacity", "256"]
    )  # fmt: skip
    try:
        rows = [
            summarize(rate, asyncio.run(drive(port, rate, args.requests, args.seconds, args.seed))) for rate in rates
        ]
    finally:
        serve.stop()
    text = table(rows, args)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    if args.doc is not None:
        rewrite_block(args.doc, "stream", text)
    return 0 if all(r["ok"] for r in rows) else 1
