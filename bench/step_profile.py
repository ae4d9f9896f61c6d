"""Where the tokens go at saturation: a per-step profile of a closed loop, the same for edgepath and llama-server.

Issue 52 measured edgepath's streams reading at half llama-server's pace under guidellm's 8-stream closed loop
(128-token prompts, 64 tokens each) and 14 % fewer tokens a second.  This is the instrument that says why, in
the terms a step policy works in:

* **edgepath**: its slot server's per-step debug lines (``edgepath -v serve``; ``model/llama.py`` writes them):
  each step's decoding rows and prompt rows, its micro-batches and threads, its time inside ``llama_decode``,
  sampling and the handler's Python, and the time the loop spent between two steps (polling the completion
  queue, result write-back, progress writes, admissions);
* **llama-server**: its ``/metrics`` (``--metrics``) before and after: ``llama_decode`` calls, the rows each
  decoded, prompt tokens -- the same composition, counted by the peer itself;
* **both**: every process's CPU from ``/proc`` over the window (the edge with its in-process agent, the slot
  server, llama-server, the load generator), as shares of a core.

The load is guidellm's closed loop made by this process (h11, as ``bench model``'s saturation phase):
``--clients`` streams, each sending its next chat of ``--prompt-tokens`` as soon as its last one ended, every
answer ``--max-tokens`` long (``ignore_eos``); a 429 is sent again at once, as guidellm does.

    python -m edgepath.bench.step_profile --system edgepath|llama-server [--seconds 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepath.bench.proc import cpu_seconds, descendants

#: one step of edgepath's llama handler, as ``LlamaHandler._account`` logs it
STEP = re.compile(
    r"\((\d+) decode, (\d+) prompt\) over (\d+) slots: llama_decode ([0-9.]+) ms, sampling ([0-9.]+) ms, "
    r"python ([0-9.]+) ms; (\d+) micro-batches, (\d+) threads, ([0-9.]+) ms since the last step"
)


@dataclass(frozen=True, slots=True)
class StepLine:
    """One logged step: rows, micro-batches, threads, and where its time went (ms)."""

    decode: int
    prompt: int
    slots: int
    decode_ms: float
    sample_ms: float
    python_ms: float
    ubatches: int
    threads: int
    between_ms: float  # from the end of the step before to the start of this one

    @property
    def busy_ms(self) -> float:
        return self.decode_ms + self.sample_ms + self.python_ms


def parse_steps(lines: Iterable[str]) -> list[StepLine]:
    """The steps in a log, in order (lines that are not step lines are skipped)."""
    out = []
    for line in lines:
        found = STEP.search(line)
        if found:
            d, p, s, dm, sm, pm, u, t, b = found.groups()
            out.append(StepLine(int(d), int(p), int(s), float(dm), float(sm), float(pm), int(u), int(t), float(b)))
    return out


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def profile(steps: list[StepLine]) -> dict[str, Any]:
    """What the steps were made of and where the wall time went.  The first step's gap is the wait before the
    load began, so it is left out of the wall time."""
    if not steps:
        return {"steps": 0}
    pure = [s for s in steps if not s.prompt]
    mixed = [s for s in steps if s.prompt and s.decode]
    alone = [s for s in steps if s.prompt and not s.decode]
    between = [s.between_ms for s in steps[1:]]
    wall_ms = sum(s.busy_ms for s in steps) + sum(between)
    shares = {
        "llama_decode": sum(s.decode_ms for s in steps) / wall_ms,
        "sampling": sum(s.sample_ms for s in steps) / wall_ms,
        "python": sum(s.python_ms for s in steps) / wall_ms,
        "between_steps": sum(between) / wall_ms,
    }
    return {
        "steps": len(steps),
        "wall_s": wall_ms / 1e3,
        "decoded_tok_s": sum(s.decode for s in steps) / wall_ms * 1e3,
        "prompt_tok_s": sum(s.prompt for s in steps) / wall_ms * 1e3,
        "decode_rows_per_step": _mean([float(s.decode) for s in steps]),
        "steps_decode_only": len(pure),
        "steps_prompt_and_decode": len(mixed),
        "steps_prompt_alone": len(alone),
        "prompt_rows_per_prompt_step": _mean([float(s.prompt) for s in mixed + alone]),
        "decode_rows_in_decode_only_steps": _mean([float(s.decode) for s in pure]),
        "decode_rows_in_mixed_steps": _mean([float(s.decode) for s in mixed]),
        "ubatches_decode_only": _mean([float(s.ubatches) for s in pure]),
        "ubatches_mixed": _mean([float(s.ubatches) for s in mixed]),
        "step_ms_p50_decode_only": _p([s.busy_ms for s in pure], 50),
        "step_ms_p50_mixed": _p([s.busy_ms for s in mixed], 50),
        "step_ms_p50_prompt_alone": _p([s.busy_ms for s in alone], 50),
        "between_ms_p50": _p(between, 50),
        "between_ms_p99": _p(between, 99),
        "time_shares": shares,
        "threads": dict(sorted(Counter(s.threads for s in steps).items())),
    }


# -- llama-server: its own counters ------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """llama-server's Prometheus page: ``llamacpp:NAME VALUE`` lines, by NAME."""
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line[len("llamacpp:") :].partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def metrics_profile(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, Any]:
    """The peer's steps over a window from its counters: ``llama_decode`` calls, the rows each decoded (its busy
    slots per call is a running mean, so the window's is recovered from the two means and counts), prompt
    tokens computed."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    calls = delta("n_decode_total")
    busy = after.get("n_busy_slots_per_decode", 0.0) * after.get("n_decode_total", 0.0) - before.get(
        "n_busy_slots_per_decode", 0.0
    ) * before.get("n_decode_total", 0.0)
    return {
        "steps": int(calls),
        "wall_s": wall_s,
        "step_period_ms": wall_s / calls * 1e3 if calls else None,
        "decoded_tok_s": delta("tokens_predicted_total") / wall_s if wall_s else None,
        "prompt_tok_s": delta("prompt_tokens_total") / wall_s if wall_s else None,
        "busy_slots_per_step": busy / calls if calls else None,
        "decode_rows_per_step": delta("tokens_predicted_total") / calls if calls else None,
        "prompt_rows_per_step": delta("prompt_tokens_total") / calls if calls else None,
    }


# -- processes' CPU ---------------------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def role(pid: int, root: int) -> str:
    """A process's part in the run: the server itself (edgepath serve: the edge and its agent) or a child."""
    if pid == root:
        return "server"
    line = _cmdline(pid)
    return "slot-server" if "slot-server" in line else Path(line.split(" ", 1)[0]).name or str(pid)


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and each live descendant, by role."""
    out: dict[str, float] = {}
    for pid in (root, *descendants(root)):
        try:
            name = role(pid, root)
            out[name] = out.get(name, 0.0) + cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def cpu_shares(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Cores each role used over the window (1.0: one core all the time)."""
    return {name: (after[name] - before.get(name, 0.0)) / wall_s for name in after if wall_s > 0}


# -- the run ----------------------------------------------------------------------------------------------
def _server_argv(
    system: str, model: str, port: int, slots: int, ctx: int, max_tokens: int, options: list[str]
) -> list[str]:
    from edgepath.bench import llama_server

    if system == "llama-server":
        return [
            str(llama_server.require().server), "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * ctx), "--cont-batching", "--metrics",
        ]  # fmt: skip
    argv = [
        sys.executable, "-m", "edgepath.cli", "-v", "serve", "--transport", "tcp", "--host", "127.0.0.1",
        "--port", str(port), "--slots", str(slots), "--input-capacity", str(ctx - max_tokens),
        "--output-capacity", str(max_tokens), "--handler", "llama", "--model", model,
        "--handler-option", f"ctx_per_slot={ctx}",
    ]  # fmt: skip
    for option in options:
        argv += ["--handler-option", option]
    return argv


async def _own_loop(port: int, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """``clients`` closed-loop streams over chats of ``prompt_tokens``; what they got."""
    from edgepath.bench.model_compare import closed_loop, percentile
    from edgepath.bench.model_workload import Workload
    from edgepath.edge.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer(Path(model))
    try:
        workload = Workload(lambda text: len(tok.encode(text)), args.seed, args.prompt_tokens, args.prompt_tokens)
        chats = workload.chats("saturation", 4000)
    finally:
        tok.close()
    name = await _model_name(port)
    bodies = [
        {
            "model": name, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }
        for messages in chats
    ]  # fmt: skip
    outcomes = await closed_loop(port, bodies, args.clients, args.seconds + 120, args.seconds)
    ok = [o for o in outcomes if o.ok]
    first = min(o.sent for o in outcomes)
    span = max(o.done for o in outcomes) - first
    itl = [(o.chunks[-1] - o.chunks[0]) / (o.tokens - 1) for o in ok if o.tokens > 1]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    return {
        "requests": len(outcomes),
        "answered": len(ok),
        "refused_429": sum(o.status == 429 for o in outcomes),
        "output_tok_s": sum(o.tokens for o in ok) / span if span else None,
        "ttft_p50_ms": 1e3 * (percentile(ttft, 50) or 0.0),
        "itl_p50_ms": 1e3 * (percentile(itl, 50) or 0.0),  # guidellm's measure: each request's mean gap
    }


async def _model_name(port: int) -> str:
    from edgepath.bench.model_compare import model_id

    return await model_id(port)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the system, warm it, run the closed loop with every process's CPU read around it, stop it."""
    from edgepath.bench.model_compare import get, stop, wait_ready
    from edgepath.children import free_port

    if args.model is None:
        from edgepath.model.gguf import default_model_path

        args.model = str(default_model_path())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port(socket.SOCK_STREAM)
    ctx = args.ctx_per_slot or args.prompt_tokens + args.max_tokens + 128
    argv = _server_argv(args.system, args.model, port, args.slots, ctx, args.max_tokens, args.handler_option)
    log_path = out / f"{args.system}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    result: dict[str, Any] = {"system": args.system, "command": " ".join(argv), "loadavg_start": os.getloadavg()}
    try:
        asyncio.run(wait_ready(proc, port, "/health", 300))
        steps_before = len(parse_steps(log_path.read_text(errors="replace").splitlines()))
        peer = args.system != "edgepath"
        metrics_before = parse_metrics(asyncio.run(get(port, "/metrics"))[1].decode()) if peer else {}
        cpu0, self0, t0 = cpu_by_role(proc.pid), time.process_time(), time.perf_counter()
        result["load"] = asyncio.run(_own_loop(port, args.model, args))
        load_cpu = time.process_time() - self0
        wall = time.perf_counter() - t0
        cpu = cpu_shares(cpu0, cpu_by_role(proc.pid), wall)
        cpu["load generator"] = load_cpu / wall
        result["cpu_cores"] = cpu
        result["loadavg_end"] = os.getloadavg()
        if args.system == "edgepath":
            steps = parse_steps(log_path.read_text(errors="replace").splitlines())[steps_before:]
            result["profile"] = profile(steps)
        else:
            metrics_after = parse_metrics(asyncio.run(get(port, "/metrics"))[1].decode())
            result["profile"] = metrics_profile(metrics_before, metrics_after, wall)
    finally:
        stop(proc)
    (out / f"profile-{args.system}.json").write_text(json.dumps(result, indent=2))
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", choices=("edgepath", "llama-server"), default="edgepath")
    p.add_argument("--clients", type=int, default=8, help="closed-loop streams")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument(
        "--ctx-per-slot",
        type=int,
        default=1216,
        help="positions per slot, both systems (edgepath's step holds at most this + slots tokens: 1216, bench "
        "model's for its 128-1024-token prompts, lets eight 140-token prompts share a step; 0: the prompt, the "
        "answer and 128)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default=None, help="GGUF path (default: the F16 SmolLM2 edgepath serves)")
    p.add_argument("--handler-option", action="append", default=[], metavar="KEY=VALUE", help="edgepath's handler")
    p.add_argument("--out", default="out/step_profile")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if min(args.clients, args.slots, args.prompt_tokens, args.max_tokens) < 1 or not args.seconds > 0:
        parser.error("--clients, --slots, --prompt-tokens and --max-tokens must be >= 1 and --seconds > 0")
    if args.ctx_per_slot and args.ctx_per_slot < args.prompt_tokens + args.max_tokens + 64:
        parser.error(
            f"--ctx-per-slot must be 0 or >= --prompt-tokens + --max-tokens + 64 (the chat template's room), got "
            f"{args.ctx_per_slot}"
        )
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
