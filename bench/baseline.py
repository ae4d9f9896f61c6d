"""The queue-and-batch baseline: what a conventional stack puts between HTTP and the GPU.

uvicorn + FastAPI (HTTP/1.1, as vLLM's API server), the same tokenizer as edgepath's edge, an
``asyncio.Queue`` and a dynamic batcher (batch window and max batch size as flags; defaults are Ray
Serve's ``@serve.batch``: 10 requests, 10 ms), feeding the *same* slot server through the same
agent.  When no slot is free the request waits in the queue for a later batch -- the hidden wait
that edgepath replaces with an immediate 429.

``python -m edgepath.bench.baseline --port 8001 --slot-server PATH``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from edgepath.dma.loopback import LoopbackTransport
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import FrameError, write_request
from edgepath.native.abi import Status

DEFAULT_MAX_BATCH = 10
DEFAULT_WINDOW_MS = 10.0


@dataclass(eq=False)
class _Item:
    ids: list[int]
    max_tokens: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Batcher:
    """Collects up to ``max_batch`` queued requests within ``window`` seconds and dispatches them as one batch."""

    def __init__(self, agent: Agent, max_batch: int, window: float) -> None:
        self.agent = agent
        self.max_batch = max_batch
        self.window = window
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._backlog: collections.deque[_Item] = collections.deque()  # got no slot: first in the next batch
        self._results: dict[int, asyncio.Future] = {}

    async def submit(self, ids: list[int], max_tokens: int) -> tuple[int, list[int]]:
        item = _Item(ids, max_tokens)
        await self.queue.put(item)
        return await item.future

    def _on_completions(self) -> None:
        cq = self.agent.transport.cq
        while True:
            for index in [d.index for d in self.agent.poll(timeout=0) if d.final]:
                fut = self._results.pop(index, None)
                if fut is not None and not fut.done():
                    fut.set_result(index)
            if not cq.arm():
                return

    async def _next_batch(self) -> list[_Item]:
        loop = asyncio.get_running_loop()
        batch = [self._backlog.popleft() for _ in range(min(len(self._backlog), self.max_batch))]
        if not batch:
            batch.append(await self.queue.get())
        deadline = loop.time() + self.window
        while len(batch) < self.max_batch:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        cq = self.agent.transport.cq
        loop.add_reader(cq.fileno(), self._on_completions)
        cq.arm()
        while True:
            batch = await self._next_batch()
            waits = []
            for item in batch:
                index = self.agent.acquire()
                if index is None:
                    self._backlog.append(item)
                    continue
                try:
                    write_request(self.agent.frames, index, item.ids, request_id=index, max_new_tokens=item.max_tokens)
                except FrameError:
                    self.agent.release(index)
                    item.future.set_result((400, []))
                    continue
                status = self.agent.submit(index)
                if status is None:
                    fut = loop.create_future()
                    self._results[index] = fut
                    waits.append((item, index, fut))
                    continue
                self.agent.release(index)
                if status == Status.NO_SLOT:
                    self._backlog.append(item)  # queue semantics: wait for a later batch
                else:
                    item.future.set_result((503, []))
            self._on_completions()
            for item, index, fut in waits:
                await fut
                res = self.agent.frames.results[index]
                out = self.agent.frames.outputs[index, : int(res["output_count"])].tolist()
                code = 200 if int(res["status"]) == Status.OK else 500
                self.agent.release(index)
                item.future.set_result((code, out))
            if not waits and self._backlog:
                await asyncio.sleep(0)  # every slot busy: let completions arrive before retrying


class GenerateBody(BaseModel):
    prompt: str | None = None
    tokens: list[int] | None = None
    max_tokens: int = 16


def create_app(slot_server: str, tokenizer_path: str | None, max_batch: int, window: float) -> FastAPI:
    from edgepath.edge.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    state: dict[str, Batcher] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        agent = Agent(LoopbackTransport(), frames=256)
        agent.attach(slot_server)
        batcher = state["batcher"] = Batcher(agent, max_batch, window)
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        agent.transport.close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/generate")
    async def generate(body: GenerateBody) -> JSONResponse:
        ids = body.tokens if body.tokens is not None else tokenizer.encode(body.prompt or "")
        code, out = await state["batcher"].submit(ids, body.max_tokens)
        if code != 200:
            return JSONResponse({"error": {"type": "unavailable", "message": f"status {code}"}}, status_code=code)
        return JSONResponse({"tokens": out, "count": len(out)})

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--slot-server", required=True)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    parser.add_argument("--batch-window-ms", type=float, default=DEFAULT_WINDOW_MS)
    args = parser.parse_args(argv)
    app = create_app(args.slot_server, args.tokenizer, args.max_batch, args.batch_window_ms / 1e3)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
