"""``edgepath bench structured``: structured outputs with Pydantic models, over HTTP/1.1 and HTTP/3, and what
constrained decoding costs in decode speed.

Issue 36's targets, as a benchmark that starts ``edgepath serve`` (SmolLM2 F16 by default) and stops it:

* **parse**: ``--requests`` chats (200 by default), each asking for one of :data:`MODELS` -- Pydantic models with
  nested objects, arrays of objects, enums, ``Optional`` fields, literals, numbers, booleans and a date -- at
  temperature ``--temperature`` with a seed of its own, so the answers differ.  Half go through the ``openai``
  SDK's ``chat.completions.parse(response_format=Model)`` over HTTP/1.1 (``serve --transport tcp``), half through
  libcurl's HTTP/3 (``curl_cffi``, ``V3ONLY``; ``serve --transport quic``) with the very ``response_format`` the SDK
  sends, read back with the same model (``Model.model_validate_json``).  A request counts as *parsed* when its
  answer validates.  docs/API.md promises that every answer that ends by itself (``finish_reason: "stop"``)
  parses against its schema, and that one cut at ``max_tokens`` ends with ``"length"`` (the SDK then raises
  ``LengthFinishReasonError``): such an answer is counted apart, under ``length``, and reported, never hidden.
* **decode**: ``--decode-rounds`` streamed chats each way, alternated on the HTTP/1.1 server, greedy: a question
  answered under a JSON schema and the same question unconstrained; decode speed is the tokens after the first
  over the time from the first content chunk to the last; the figure is the ratio of the medians.

    edgepath bench structured [--requests 200] [--decode-rounds 5] [--out out/structured]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import enum
import http.client
import json
import logging
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, ValidationError

from edgepath.bench.model_compare import machine, model_id, stop, wait_ready
from edgepath.children import free_port

Name = Annotated[str, StringConstraints(max_length=24)]
Word = Annotated[str, StringConstraints(max_length=12)]


class Continent(enum.Enum):
    EUROPE = "Europe"
    ASIA = "Asia"
    AFRICA = "Africa"
    AMERICA = "America"
    OCEANIA = "Oceania"


class Country(BaseModel):
    name: Name
    continent: Continent


class City(BaseModel):
    """Nested object, enum, number, boolean."""

    name: Name
    country: Country
    population_millions: float
    is_capital: bool


class Ingredient(BaseModel):
    name: Name
    quantity: float
    unit: Literal["g", "ml", "pcs", "tbsp"]


class Recipe(BaseModel):
    """An array of objects (bounded), literal, integer, boolean."""

    title: Name
    ingredients: list[Ingredient] = Field(min_length=1, max_length=4)
    minutes: int
    vegetarian: bool


class Role(enum.Enum):
    ENGINEER = "engineer"
    TEACHER = "teacher"
    DOCTOR = "doctor"
    ARTIST = "artist"


class Person(BaseModel):
    """Optional fields, an array of strings, an enum."""

    name: Name
    age: int
    email: Name | None = None
    hobbies: list[Word] = Field(max_length=3)
    role: Role


class Weather(BaseModel):
    """Literal, numbers, an optional integer."""

    city: Name
    temperature_c: float
    condition: Literal["sunny", "cloudy", "rain", "snow", "fog"]
    wind_kmh: int | None = None


class Author(BaseModel):
    first: Word
    last: Word


class Genre(enum.Enum):
    FICTION = "fiction"
    HISTORY = "history"
    SCIENCE = "science"
    POETRY = "poetry"
    MYSTERY = "mystery"


class Book(BaseModel):
    """A nested object, an array of enums, an optional number."""

    title: Name
    author: Author
    year: int
    genres: list[Genre] = Field(min_length=1, max_length=3)
    rating: float | None = None


class Attendee(BaseModel):
    name: Name
    confirmed: bool


class Event(BaseModel):
    """A date, an optional string, an array of objects."""

    event: Name
    date: dt.date
    place: Name | None = None
    attendees: list[Attendee] = Field(max_length=2)


class LineItem(BaseModel):
    sku: Word
    quantity: int
    price: float


class Order(BaseModel):
    """An array of objects, literal status, boolean, optional note."""

    items: list[LineItem] = Field(min_length=1, max_length=3)
    status: Literal["pending", "shipped", "delivered", "cancelled"]
    paid: bool
    note: Name | None = None


class Sentiment(BaseModel):
    """A literal label, a number, an array of short strings."""

    label: Literal["positive", "negative", "neutral"]
    confidence: float
    keywords: list[Word] = Field(max_length=3)


class Grid(BaseModel):
    """Nested arrays."""

    rows: list[Annotated[list[int], Field(min_length=1, max_length=3)]] = Field(min_length=1, max_length=3)
    label: Word


#: each model with the questions asked for it
MODELS: tuple[tuple[type[BaseModel], tuple[str, ...]], ...] = (
    (City, ("Tell me about Paris.", "Describe Tokyo.", "What about Nairobi?")),
    (Recipe, ("Give me a pancake recipe.", "How do I make a tomato soup?")),
    (Person, ("Invent a person who likes music.", "Describe a doctor you know.")),
    (Weather, ("What is the weather in Oslo?", "Describe a rainy day in London.")),
    (Book, ("Tell me about a famous novel.", "Recommend a history book.")),
    (Event, ("When did the Berlin wall fall?", "Plan a birthday party.")),
    (Order, ("I bought two shirts and a hat.", "Summarise an order of books.")),
    (Sentiment, ("I loved this film, it was wonderful!", "The service was slow and rude.")),
    (Grid, ("Give me a small table of numbers.", "Make a 2 by 2 grid.")),
)


@dataclass
class Reply:
    """One parse request: what came back and whether it validated."""

    transport: str
    model: str
    seed: int
    status: int = 0
    finish_reason: str | None = None
    parsed: bool = False
    completion_tokens: int = 0
    seconds: float = 0.0
    retries: int = 0
    error: str | None = None


@dataclass
class Plan:
    requests: int
    temperature: float
    max_tokens: int
    concurrency: int
    seed: int

    def asks(self, transport: str, offset: int) -> list[tuple[type[BaseModel], str, int]]:
        """This transport's half: (model, question, seed), the models taken in turn."""
        half = self.requests // 2 if transport == "http/1.1" else self.requests - self.requests // 2
        out = []
        for k in range(half):
            i = offset + k
            model, questions = MODELS[i % len(MODELS)]
            out.append((model, questions[(i // len(MODELS)) % len(questions)], self.seed + i))
        return out


def response_format(model: type[BaseModel]) -> dict[str, Any]:
    """The ``response_format`` the openai SDK's ``parse`` sends for ``model`` (its strict JSON schema)."""
    from openai.lib._parsing._completions import type_to_response_format_param

    return dict(type_to_response_format_param(model))  # type: ignore[arg-type]


# -- the two clients -----------------------------------------------------------------------------------------
def sdk_parse(base_url: str, served: str, plan: Plan, model: type[BaseModel], question: str, seed: int) -> Reply:
    """One ``chat.completions.parse`` through the openai SDK over HTTP/1.1 (it retries a 429 on its own)."""
    import openai

    reply = Reply("http/1.1", model.__name__, seed)
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=5, timeout=300)
    started = time.perf_counter()
    try:
        done = client.chat.completions.parse(
            model=served, messages=[{"role": "user", "content": question}], response_format=model,
            max_tokens=plan.max_tokens, temperature=plan.temperature, seed=seed,
        )  # fmt: skip
        choice = done.choices[0]
        reply.status, reply.finish_reason = 200, choice.finish_reason
        reply.parsed = isinstance(choice.message.parsed, model)
        reply.completion_tokens = done.usage.completion_tokens if done.usage else 0
    except openai.LengthFinishReasonError as exc:
        reply.status, reply.finish_reason = 200, "length"
        reply.completion_tokens = exc.completion.usage.completion_tokens if exc.completion.usage else 0
    except ValidationError as exc:
        reply.status, reply.finish_reason, reply.error = 200, "stop", f"does not validate: {exc}"[:300]
    except openai.APIStatusError as exc:
        reply.status, reply.error = exc.status_code, str(exc)[:300]
    except openai.APIError as exc:
        reply.error = f"{type(exc).__name__}: {exc}"[:300]
    reply.seconds = time.perf_counter() - started
    return reply


def h3_parse(port: int, served: str, plan: Plan, model: type[BaseModel], question: str, seed: int) -> Reply:
    """The same request over HTTP/3 through libcurl, read back with the same model; a 429 is asked again after
    the server's advice, as the SDK does."""
    from curl_cffi import CurlHttpVersion, requests

    from edgepath.edge.adapters.tls import default_certificate

    reply = Reply("http/3", model.__name__, seed)
    body = {
        "model": served, "messages": [{"role": "user", "content": question}], "max_tokens": plan.max_tokens,
        "temperature": plan.temperature, "seed": seed, "response_format": response_format(model),
    }  # fmt: skip
    started = time.perf_counter()
    try:
        for attempt in range(6):
            with requests.Session() as session:  # a Session's verify takes the CA file (requests.post's: a bool)
                r = session.post(
                    f"https://localhost:{port}/v1/chat/completions", json=body, http_version=CurlHttpVersion.V3ONLY,
                    verify=str(default_certificate()), timeout=300,
                )  # fmt: skip
            reply.status = r.status_code
            if r.status_code != 429 or attempt == 5:
                break
            reply.retries += 1
            time.sleep(min(8.0, int(r.headers.get("retry-after-ms") or 500) / 1e3))
        if reply.status != 200:
            reply.error = r.text[:300]
        else:
            doc = r.json()
            choice = doc["choices"][0]
            reply.finish_reason = choice["finish_reason"]
            reply.completion_tokens = doc["usage"]["completion_tokens"]
            if reply.finish_reason != "length":
                try:
                    model.model_validate_json(choice["message"]["content"])
                    reply.parsed = True
                except ValidationError as exc:
                    reply.error = f"does not validate: {exc}"[:300]
    except Exception as exc:  # a transport failure is a result to report, not a crash of the benchmark
        reply.error = f"{type(exc).__name__}: {exc}"[:300]
    reply.seconds = time.perf_counter() - started
    return reply


def run_half(plan: Plan, asks: list[tuple[type[BaseModel], str, int]], one: Callable[..., Reply]) -> dict[str, Any]:
    started = time.perf_counter()
    with ThreadPoolExecutor(plan.concurrency) as pool:
        replies = list(pool.map(lambda a: one(*a), asks))
    seconds = time.perf_counter() - started
    return summary(replies, seconds)


def summary(replies: list[Reply], seconds: float) -> dict[str, Any]:
    stopped = [r for r in replies if r.finish_reason == "stop"]
    failures = [asdict(r) for r in replies if not r.parsed and r.finish_reason != "length"]
    return {
        "requests": len(replies),
        "parsed": sum(r.parsed for r in replies),
        "ended_by_themselves": len(stopped),
        "parsed_of_ended": f"{sum(r.parsed for r in stopped)}/{len(stopped)}",
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in replies)),
        "statuses": dict(Counter(str(r.status) for r in replies)),
        "per_model": {
            name: f"{sum(r.parsed for r in replies if r.model == name)}/{sum(r.model == name for r in replies)}"
            for name in dict.fromkeys(r.model for r in replies)
        },
        "retries_after_429": sum(r.retries for r in replies),
        "completion_tokens": sum(r.completion_tokens for r in replies),
        "seconds": round(seconds, 1),
        "median_request_s": round(statistics.median(r.seconds for r in replies), 2) if replies else None,
        "failures": failures,
    }


# -- decode speed ---------------------------------------------------------------------------------------------
GROCERIES = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array", "minItems": 8, "maxItems": 12,
            "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                      "quantity": {"type": "integer"}}, "required": ["name", "quantity"]},
        },
    },
    "required": ["items"],
}  # fmt: skip
DECODE_QUESTION = "Write a grocery list for a week of family dinners, with quantities."


def decode_rate(port: int, served: str, constrained: bool, max_tokens: int) -> tuple[float, int]:
    """Tokens per second after the first (streamed, greedy), and the completion's tokens."""
    body: dict[str, Any] = {
        "model": served, "messages": [{"role": "user", "content": DECODE_QUESTION}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "groceries", "schema": GROCERIES}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"decode request: HTTP {response.status}: {response.read()[:300]!r}")
        first = last = None
        tokens = 0
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                tokens = doc["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in doc.get("choices", ())):
                last = time.perf_counter()
                first = first or last
        if first is None or last is None or tokens < 2 or last <= first:
            raise RuntimeError(f"decode request: too short an answer to time ({tokens} tokens)")
        return (tokens - 1) / (last - first), tokens
    finally:
        conn.close()


def decode_phase(port: int, served: str, rounds: int, max_tokens: int) -> dict[str, Any]:
    decode_rate(port, served, True, 8)  # warm-up: both paths once
    decode_rate(port, served, False, 8)
    constrained, plain, tokens_c, tokens_p = [], [], [], []
    for _ in range(rounds):
        rate, n = decode_rate(port, served, True, max_tokens)
        constrained.append(rate)
        tokens_c.append(n)
        rate, n = decode_rate(port, served, False, max_tokens)
        plain.append(rate)
        tokens_p.append(n)
    ratio = statistics.median(constrained) / statistics.median(plain)
    return {
        "rounds": rounds,
        "constrained_tokens_per_s": [round(r, 1) for r in constrained],
        "unconstrained_tokens_per_s": [round(r, 1) for r in plain],
        "constrained_tokens": tokens_c,
        "unconstrained_tokens": tokens_p,
        "median_constrained": round(statistics.median(constrained), 1),
        "median_unconstrained": round(statistics.median(plain), 1),
        "ratio_of_medians": round(ratio, 3),
        "cost_percent": round((1 - ratio) * 100, 1),
    }


# -- the servers -----------------------------------------------------------------------------------------------
def serve_argv(args: argparse.Namespace, transport: str, port: int) -> list[str]:
    from edgepath.model.gguf import default_model_path

    argv = [
        sys.executable, "-m", "edgepath.cli", "serve", "--transport", transport, "--host", "127.0.0.1",
        "--port", str(port), "--slots", str(args.concurrency), "--input-capacity", "2048",
        "--output-capacity", str(args.max_tokens), "--max-wait", "60", "--handler", "llama",
        "--model", args.model or str(default_model_path()), "--handler-option", f"threads={args.threads}",
    ]  # fmt: skip
    return argv


async def _h3_ready(proc: subprocess.Popen[bytes], port: int, timeout: float) -> str:
    """Wait until an HTTP/3 ``serve`` answers ``/v1/models``; the model it lists."""
    from curl_cffi import CurlHttpVersion, requests

    from edgepath.edge.adapters.tls import default_certificate

    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before serving")
        try:
            with requests.Session() as session:
                r = session.get(
                    f"https://localhost:{port}/v1/models", http_version=CurlHttpVersion.V3ONLY,
                    verify=str(default_certificate()), timeout=5,
                )  # fmt: skip
            if r.status_code == 200:
                return str(r.json()["data"][0]["id"])
        except Exception:  # not listening yet (or its certificate not written yet)
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"serve did not answer over HTTP/3 on port {port} after {timeout:g} s")


@contextmanager
def serving(args: argparse.Namespace, transport: str, log: Path) -> Iterator[tuple[int, str]]:
    """``edgepath serve`` over ``transport`` (tcp or quic), stopped on exit: its port and served model."""
    kind = socket.SOCK_STREAM if transport == "tcp" else socket.SOCK_DGRAM
    port = free_port(kind)
    with log.open("wb") as out:
        proc = subprocess.Popen(serve_argv(args, transport, port), stdout=out, stderr=subprocess.STDOUT)
    try:
        if transport == "tcp":
            asyncio.run(wait_ready(proc, port, "/health", args.start_timeout))
            served = asyncio.run(model_id(port))
        else:
            served = asyncio.run(_h3_ready(proc, port, args.start_timeout))
        yield port, served
    finally:
        stop(proc)


OPTIONS = ("requests", "temperature", "max_tokens", "concurrency", "decode_rounds", "decode_tokens", "threads",
           "model", "seed")  # fmt: skip
"""The options the command line names (``edgepath.bench.cli.add_structured_arguments``) that say what ran."""


def main(args: argparse.Namespace) -> int:
    """0 when every parse request that ended by itself parsed (none failed otherwise), else 1."""
    if args.requests < 2 or args.concurrency < 1 or args.decode_tokens > args.max_tokens:
        raise SystemExit("--requests >= 2, --concurrency >= 1 and --decode-tokens <= --max-tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("httpx", "httpx2"):  # the SDK's HTTP client logs each request at INFO: 200 lines of noise
        logging.getLogger(name).setLevel(logging.WARNING)
    plan = Plan(args.requests, args.temperature, args.max_tokens, args.concurrency, args.seed)
    report: dict[str, Any] = {
        "measured_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "command": "edgepath bench structured "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k in OPTIONS and v is not None),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))},
        "models": [m.__name__ for m, _ in MODELS],
    }
    with serving(args, "tcp", out / "serve-tcp.log") as (port, served):
        report["serve_tcp"] = " ".join(serve_argv(args, "tcp", port))
        base = f"http://127.0.0.1:{port}/v1"
        report["http/1.1"] = run_half(
            plan, plan.asks("http/1.1", 0), lambda m, q, s: sdk_parse(base, served, plan, m, q, s)
        )
        if args.decode_rounds > 0:
            report["decode"] = decode_phase(port, served, args.decode_rounds, args.decode_tokens)
    with serving(args, "quic", out / "serve-quic.log") as (port, served):
        asks = plan.asks("http/3", args.requests // 2)
        report["http/3"] = run_half(plan, asks, lambda m, q, s: h3_parse(port, served, plan, m, q, s))
    (out / "structured.json").write_text(json.dumps(report, indent=2))
    for transport in ("http/1.1", "http/3"):
        s = report[transport]
        print(
            f"{transport}: {s['parsed']}/{s['requests']} parsed, finish reasons {s['finish_reasons']}, "
            f"statuses {s['statuses']}, {s['seconds']} s ({s['completion_tokens']} completion tokens)"
        )
    if "decode" in report:
        d = report["decode"]
        print(
            f"decode: constrained {d['median_constrained']} vs unconstrained {d['median_unconstrained']} tokens/s "
            f"after the first (medians of {d['rounds']}): ratio {d['ratio_of_medians']}"
        )
    print(f"report {out / 'structured.json'}")
    failed = sum(len(report[t]["failures"]) for t in ("http/1.1", "http/3"))
    return 0 if failed == 0 else 1
