"""How long the llama handler lets the slot server's heartbeat stand still: what ``--hang-timeout`` must exceed.

The handler is driven as the slot server drives it -- every request added, then one step per turn of the loop,
the heartbeat advanced at every turn -- on the workload that makes steps as long as they get: every slot's
prompt arriving at once on an idle handler.  A thread samples the heartbeat word every half millisecond and
keeps the longest silence between two changes.  Two rounds: the loop's beats only (the longest silence is then
the longest step), and with llama.cpp also beating from inside its steps (``BeatsWithinSteps``, issue 20).

    python -m edgepath.bench.heartbeat [--slots 8] [--prompt-tokens 1000] [--tokens 16] [--threads N]

Prints one JSON line.  The figures depend on the machine and on what else runs on it: say where they were taken.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

from edgepath.bench.model_workload import Workload
from edgepath.contract.wire import Sampling
from edgepath.edge.text.tokenizer import GGUFTokenizer
from edgepath.model.gguf import default_model_path
from edgepath.model.llama import LlamaHandler
from edgepath.native.abi import ffi, lib
from edgepath.slots.handlers import HandlerConfig, Heartbeat, SlotRequest


class Silence:
    """The longest time the word at ``word[0]`` stood still, sampled every ``period`` seconds on a thread."""

    def __init__(self, word: np.ndarray, period: float = 0.0005) -> None:
        self.word, self.period, self.longest = word, period, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last, since = int(self.word[0]), time.monotonic()
        while not self._stop.wait(self.period):
            value, now = int(self.word[0]), time.monotonic()
            if value != last:
                self.longest = max(self.longest, now - since)
                last, since = value, now
        self.longest = max(self.longest, time.monotonic() - since)

    def __enter__(self) -> Silence:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def one_round(args: argparse.Namespace, prompts: list[np.ndarray], within_steps: bool) -> dict[str, float]:
    """Run every prompt to ``--tokens`` output tokens from an idle handler; the longest step and silence."""
    in_cap = max(len(p) for p in prompts)
    options = {"threads": str(args.threads)} if args.threads else {}
    handler = LlamaHandler.from_config(HandlerConfig(len(prompts), in_cap, args.tokens, options))
    word = np.zeros(1, dtype=np.uint64)
    word_ptr = ffi.cast("uint64_t *", ffi.from_buffer(word))
    if within_steps:
        tick = int(ffi.cast("uintptr_t", ffi.addressof(lib, "ep_heartbeat_tick")))
        handler.beat_within_steps(Heartbeat(tick, int(ffi.cast("uintptr_t", word_ptr))))
    inputs = np.zeros((len(prompts), in_cap), dtype=np.int32)
    outputs = np.zeros((len(prompts), args.tokens), dtype=np.int32)
    longest_step, steps = 0.0, 0
    try:
        with Silence(word) as silence:
            for slot, prompt in enumerate(prompts):
                inputs[slot, : len(prompt)] = prompt
                tokens = inputs[slot, : len(prompt)]
                request = SlotRequest(slot, slot, args.tokens, 0, tokens, outputs[slot], Sampling())
                handler.add(request, time.monotonic())
            while handler.wake_in(time.monotonic()) is not None and steps < 10_000:
                lib.ep_heartbeat_tick(word_ptr)  # the loop's beat at every turn
                started = time.monotonic()
                handler.step(started)
                longest_step = max(longest_step, time.monotonic() - started)
                steps += 1
    finally:
        handler.close()
    return {"longest_step_s": round(longest_step, 3), "longest_silence_s": round(silence.longest, 3), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=8, help="requests arriving at once (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="tokens per prompt (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per request (default %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: the handler's)")
    args = parser.parse_args(argv)
    tok = GGUFTokenizer(default_model_path())
    workload = Workload(lambda text: len(tok.encode(text)), low=args.prompt_tokens, high=args.prompt_tokens)
    prompts = []
    for chat in workload.chats("heartbeat", args.slots):
        frame = np.zeros(args.prompt_tokens + 64, dtype=np.int32)
        prompts.append(frame[: tok.encode_chat_into(chat, frame)].copy())
    report = {
        "slots": args.slots,
        "prompt_tokens": [min(len(p) for p in prompts), max(len(p) for p in prompts)],
        "threads": args.threads or "default",
        "loop_only": one_round(args, prompts, within_steps=False),
        "within_steps": one_round(args, prompts, within_steps=True),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
