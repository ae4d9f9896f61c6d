"""The FastAPI baselines: what a conventional Python stack puts between HTTP and the slot server.

uvicorn + FastAPI over TLS (HTTP/1.1: uvicorn speaks no HTTP/2 or HTTP/3; the same self-signed
certificate as the edge), the same tokenizer as edgepath's edge, feeding the *same* slot server
through the same agent, in one of two modes:

* ``batch``: an ``asyncio.Queue`` and a dynamic batcher (batch window and max batch size as flags;
  defaults are Ray Serve's ``@serve.batch``: 10 requests, 10 ms).  When no slot is free the request
  waits in the queue for a later batch -- the hidden wait that edgepath replaces with an immediate 429.
* ``direct``: no queue, no batching window: each request claims a slot, writes, rings and awaits its
  completion at once, and gets 429 when no slot is free -- edgepath's semantics, in FastAPI.

``python -m edgepath.bench.baseline --port 8001 --slot-server PATH --mode direct --certificate C --private-key K``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from edgepath.contract.wire import FINISHED
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import FrameError, write_request
from edgepath.native.abi import Status
from edgepath.peer_secret import peer_keys
from edgepath.transports.loopback import LoopbackTransport

Ids = Sequence[int] | np.ndarray  # token ids: a JSON list, or the tokenizer's array
DEFAULT_MAX_BATCH = 10
DEFAULT_WINDOW_MS = 10.0


@dataclass(eq=False)
class _Item:
    ids: Ids
    max_tokens: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Dispatcher:
    """Completion plumbing shared by both modes: the agent's completion queue wakes one future per slot."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._results: dict[int, asyncio.Future] = {}

    def _on_completions(self) -> None:
        cq = self.agent.transport.cq
        while True:
            for index in [d.index for d in self.agent.poll(timeout=0) if d.final]:
                fut = self._results.pop(index, None)
                if fut is not None and not fut.done():
                    fut.set_result(index)
            if not cq.arm():
                return

    def _watch_completions(self) -> None:
        cq = self.agent.transport.cq
        asyncio.get_running_loop().add_reader(cq.fileno(), self._on_completions)
        cq.arm()

    def _dispatch(self, ids: Ids, max_tokens: int) -> tuple[int, asyncio.Future | None]:
        """Claim, write and ring: (slot, completion future), or (HTTP status, None) when it did not go out."""
        index = self.agent.acquire()
        if index is None:
            return 429, None
        try:
            write_request(self.agent.frames, index, ids, request_id=index, max_new_tokens=max_tokens)
        except FrameError:
            self.agent.release(index)
            return 400, None
        status = self.agent.submit(index)
        if status is None:
            fut = asyncio.get_running_loop().create_future()
            self._results[index] = fut
            return index, fut
        self.agent.release(index)
        return (429 if status == Status.NO_SLOT else 503), None

    def _collect(self, index: int) -> tuple[int, list[int]]:
        res = self.agent.frames.results[index]
        out = self.agent.frames.outputs[index, : int(res["output_count"])].tolist()
        code = 200 if int(res["status"]) in FINISHED else 500  # as the edge: OK, LENGTH, STOP, CANCELLED
        self.agent.release(index)
        return code, out


class Direct(_Dispatcher):
    """No queue, no window: each request goes to the slot server as it arrives (429 when no slot is free)."""

    async def run(self) -> None:
        self._watch_completions()
        await asyncio.Event().wait()  # completions arrive through the reader; nothing else to do

    async def submit(self, ids: Ids, max_tokens: int) -> tuple[int, list[int]]:
        index, fut = self._dispatch(ids, max_tokens)
        if fut is None:
            return index, []
        self._on_completions()
        await fut
        return self._collect(index)


class Batcher(_Dispatcher):
    """Collects up to ``max_batch`` queued requests within ``window`` seconds and dispatches them as one batch."""

    def __init__(self, agent: Agent, max_batch: int, window: float) -> None:
        super().__init__(agent)
        self.max_batch = max_batch
        self.window = window
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._backlog: collections.deque[_Item] = collections.deque()  # got no slot: first in the next batch

    async def submit(self, ids: Ids, max_tokens: int) -> tuple[int, list[int]]:
        item = _Item(ids, max_tokens)
        await self.queue.put(item)
        return await item.future

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
        self._watch_completions()
        while True:
            batch = await self._next_batch()
            waits = []
            for item in batch:
                index, fut = self._dispatch(item.ids, item.max_tokens)
                if fut is not None:
                    waits.append((item, index, fut))
                elif index == 429:
                    self._backlog.append(item)  # queue semantics: wait for a later batch
                else:
                    item.future.set_result((index, []))
            self._on_completions()
            for item, index, fut in waits:
                await fut
                item.future.set_result(self._collect(index))
            if not waits and self._backlog:
                await asyncio.sleep(0)  # every slot busy: let completions arrive before retrying


class GenerateBody(BaseModel):
    prompt: str | None = None
    tokens: list[int] | None = None
    max_tokens: int = 16


MODES = ("batch", "direct")


def create_app(slot_server: str, tokenizer_path: str | None, mode: str, max_batch: int, window: float) -> FastAPI:
    from edgepath.edge.text.tokenizer import load_tokenizer

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    tokenizer = load_tokenizer(tokenizer_path)
    state: dict[str, Batcher | Direct] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        agent = Agent(LoopbackTransport(peer_keys(None)), frames=256)
        agent.attach(slot_server)
        dispatcher = state["dispatcher"] = Batcher(agent, max_batch, window) if mode == "batch" else Direct(agent)
        task = asyncio.create_task(dispatcher.run())
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
        code, out = await state["dispatcher"].submit(ids, body.max_tokens)
        if code != 200:
            return JSONResponse({"error": {"type": "unavailable", "message": f"status {code}"}}, status_code=code)
        return JSONResponse({"tokens": out, "count": len(out)})

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--slot-server", required=True)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--mode", choices=MODES, default="batch")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    parser.add_argument("--batch-window-ms", type=float, default=DEFAULT_WINDOW_MS)
    parser.add_argument("--certificate", required=True, help="TLS certificate (PEM): the baselines serve HTTPS only")
    parser.add_argument("--private-key", required=True)
    args = parser.parse_args(argv)
    app = create_app(args.slot_server, args.tokenizer, args.mode, args.max_batch, args.batch_window_ms / 1e3)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        ssl_certfile=args.certificate,
        ssl_keyfile=args.private_key,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
