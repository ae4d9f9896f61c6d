"""The command-line clients over HTTP/3: ``edgepath request`` (edgepath's own route, the text continued as it
is, with the server's timings) and ``edgepath chat`` (OpenAI's chat route, the answer printed as it streams)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from edgepath.client_config import ChatSettings, RequestSettings, ServerAddress
from edgepath.edge.adapters.tls import default_certificate
from edgepath.edge.client import EventReader, H3Client, H3Response, h3_client
from edgepath.edge.retry import advised_wait, retry_delay


class Unreachable(Exception):
    """No answer from the server: the connection failed, or nothing came within ``--timeout``."""


@asynccontextmanager
async def _connected(server: ServerAddress) -> AsyncIterator[H3Client]:
    """A connection to ``server`` that trusts the local self-signed certificate unless told otherwise; the
    whole exchange is bounded by ``server.timeout``."""
    logging.getLogger("quic").setLevel(logging.WARNING)
    cafile = server.cacert
    if cafile is None and not server.insecure and default_certificate().is_file():
        cafile = str(default_certificate())
    server_name = "localhost" if server.host in ("127.0.0.1", "::1") else server.host
    api_key = server.api_key or os.environ.get("EDGEPATH_API_KEY")
    try:
        async with (
            asyncio.timeout(server.timeout),
            h3_client(server.host, server.port, cafile, server.insecure, server_name, api_key) as client,
        ):
            yield client
    except (ConnectionError, OSError, TimeoutError) as exc:
        reason = str(exc) or f"no answer within {server.timeout:g} s"
        raise Unreachable(f"cannot reach https://{server.host}:{server.port}: {reason}") from None


def _error_text(response: H3Response) -> str:
    """An error answer in one line: its message (both APIs put one in ``error.message``), else its body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.body.decode(errors="replace").strip()


def _print_timings(response: H3Response, out: Any) -> None:
    timings = response.timings()
    if timings:
        print("server timing (ms): " + "  ".join(f"{k} {v:.3f}" for k, v in timings.items()), file=out)
    print(f"queue time: {response.headers.get('x-queue-time', '?')}", file=out)


async def request(settings: RequestSettings) -> int:
    """Send ``settings.prompt`` to ``/v1/generate`` (or ``/v1/tokenize``); print the status, the text (the ids
    when asked) and the server's timings; 0 for a 200, 1 for another status, 2 when the server cannot be had."""

    streamed: list[int] = []  # the status, once a streamed answer's first events are printed

    def show(status: int, data: bytes) -> None:
        if status != 200:
            return
        if not streamed:
            print(f"HTTP/3 {status}")
            streamed.append(status)
        sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()

    try:
        async with _connected(settings.server) as client:
            if settings.tokenize:
                response = await client.request(
                    "POST", "/v1/tokenize", {"prompt": settings.prompt}, timeout=settings.server.timeout
                )
            else:
                payload = {"prompt": settings.prompt, "max_tokens": settings.max_tokens, "stream": settings.stream}
                on_data = show if settings.stream else None
                response = await client.request(
                    "POST", "/v1/generate", payload, timeout=settings.server.timeout, on_data=on_data
                )
    except Unreachable as exc:
        print(f"edgepath request: {exc}", file=sys.stderr)
        return 2
    if not streamed:
        print(f"HTTP/3 {response.status}")
    if response.status != 200:
        print(_error_text(response))
    elif settings.tokenize:
        doc = response.json()
        print(f"{doc['count']} tokens: {' '.join(map(str, doc['tokens']))}")
    elif not settings.stream:
        doc = response.json()
        print(doc["text"])
        print(
            f"tokens: {doc['input_count']} in ({doc['cached_tokens']} of them cached), {doc['output_count']} out"
            + (f": {' '.join(map(str, doc['tokens']))}" if settings.ids else "")
        )
    _print_timings(response, sys.stdout)
    return 0 if response.status == 200 else 1


async def chat(settings: ChatSettings) -> int:
    """Send ``settings.prompt`` as a user message to ``/v1/chat/completions`` with ``stream: true`` and print the
    answer's text as it arrives, asking again after a 429 as the openai SDK does (``--retries``); 0 when it was
    answered, 1 for an error answer, 2 when the server cannot be had (within ``--timeout``, retries included)."""
    messages = [{"role": "user", "content": settings.prompt}]
    if settings.system is not None:
        messages.insert(0, {"role": "system", "content": settings.system})
    printer = _ChatPrinter()
    try:
        async with _connected(settings.server) as client:
            model = settings.model or await _first_model(client, settings.server.timeout)
            payload: dict[str, Any] = {
                "model": model,
                "messages": messages,
                "max_tokens": settings.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if settings.temperature is not None:
                payload["temperature"] = settings.temperature
            if settings.seed is not None:
                payload["seed"] = settings.seed
            rng = random.Random()
            for retries_so_far in range(settings.retries + 1):
                response = await client.request(
                    "POST", "/v1/chat/completions", payload, timeout=settings.server.timeout, on_data=printer.feed
                )
                if response.status != 429 or retries_so_far == settings.retries:
                    break
                delay, _ = retry_delay(advised_wait(response.headers), retries_so_far, rng)
                print(
                    f"edgepath chat: HTTP/3 429: {_error_text(response)}; asking again in {delay:.2f} s "
                    f"({retries_so_far + 1} of --retries {settings.retries})",
                    file=sys.stderr,
                )
                await asyncio.sleep(delay)
    except (Unreachable, _NoModel) as exc:
        print(f"edgepath chat: {exc}", file=sys.stderr)
        return 2
    if printer.printed:
        print()
    if response.status != 200 or printer.error is not None:
        message = printer.error if response.status == 200 else _error_text(response)
        print(f"edgepath chat: HTTP/3 {response.status}: {message}", file=sys.stderr)
        return 1
    if printer.finish == "length":
        print(f"edgepath chat: (the answer was cut at --max-tokens {settings.max_tokens})", file=sys.stderr)
    if settings.usage:
        usage = printer.usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        print(
            f"tokens: {usage.get('prompt_tokens', '?')} in ({cached} of them cached), "
            f"{usage.get('completion_tokens', '?')} out; finish: {printer.finish}",
            file=sys.stderr,
        )
        _print_timings(response, sys.stderr)
    return 0


class _ChatPrinter:
    """Prints a streamed chat answer's text as its chunks arrive, and keeps how it ended: the finish reason,
    the usage chunk, an error event (a stream that failed after it had started)."""

    def __init__(self) -> None:
        self.events = EventReader()
        self.printed = False
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}
        self.error: str | None = None

    def feed(self, status: int, data: bytes) -> None:
        if status != 200:
            return  # an error answer: one JSON body, read when complete
        for event in self.events.feed(data):
            if event == "[DONE]":
                continue
            chunk = json.loads(event)
            if "error" in chunk:
                self.error = str(chunk["error"].get("message", event))
                continue
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content")
                if text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    self.printed = True
                self.finish = choice.get("finish_reason") or self.finish


class _NoModel(Exception):
    """The server lists no model to ask."""


async def _first_model(client: H3Client, timeout: float) -> str:
    """The model the server lists first at ``GET /v1/models`` (an edge serves one)."""
    response = await client.request("GET", "/v1/models", timeout=timeout)
    if response.status != 200:
        raise _NoModel(f"GET /v1/models answered {response.status}: {_error_text(response)}; give --model")
    models = [m["id"] for m in response.json().get("data", [])]
    if not models:
        raise _NoModel("the server lists no model at /v1/models; give --model")
    return str(models[0])
