"""The edge's HTTP vocabulary, sans I/O: what a request, a response, a unit of work, an outcome and an error are,
the API's paths, and the helpers every route shares (JSON bodies, error shapes, ``Server-Timing``).

Nothing here touches a socket, a thread or a clock: the adapters (:mod:`edgepath.edge.adapters`) feed
:class:`Request` objects in with their timestamps; the router (:mod:`edgepath.edge.routes`) answers what it can at
once or hands an API shape's :class:`Work` item to the lifecycle, which tokenizes, admits and dispatches it; the
route's :class:`Formatter` shapes what goes back (one document, or server-sent events as output arrives).
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import orjson

from edgepath.contract.wire import Sampling
from edgepath.edge.tenancy.tenants import ANONYMOUS, Tenant

JSON = b"application/json"
SERVER = b"edgepath"  # the Server header of every answer, over either adapter
Headers = list[tuple[bytes, bytes]]

# The API's paths; what each allows and who answers it is the route table, ROUTES.
GENERATE, TOKENIZE = "/v1/generate", "/v1/tokenize"
LLAMA_TOKENIZE, LLAMA_DETOKENIZE = "/tokenize", "/detokenize"  # llama-server's shapes (edge/apis/llama_utils.py)
COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"  # Anthropic's Messages API
RESPONSES = "/v1/responses"  # OpenAI's Responses API
HEALTH, METRICS = "/health", "/metrics"
#: Kubernetes-style probes: the edge process answers (liveness), and it can serve -- a slot server is up (readiness)
LIVE, READY = "/health/live", "/health/ready"
#: the OpenAPI document of the routes (edge/openapi.py)
OPENAPI = "/openapi.json"

# Every stage that can appear in Server-Timing, in the order a request passes them.
STAGES = (
    "queue", "parse", "tokenize", "write", "claim", "doorbell", "edge", "return", "first_token",
    "wait", "predicted_ttft", "predicted_wait", "total",
)  # fmt: skip
#: the request header that asks for a tighter bound on waiting for the first token (seconds)
MAX_WAIT_HEADER = b"x-max-wait"


@dataclass(slots=True)
class Request:
    """A complete request as an adapter received it (times: CLOCK_MONOTONIC ns).

    ``t_receive_ns``: the adapter saw the request complete (its last byte parsed).  ``t_arrival_ns``:
    the transport handed the edge the datagram (or read) that completed it -- earlier when several
    requests share one datagram and wait for each other; queue time is measured from it.
    """

    method: str
    target: str
    headers: Headers
    body: bytes
    t_receive_ns: int
    t_arrival_ns: int | None = None
    #: it came in on the ops listener (``--ops-listen``): only the ops routes are served there, without a key
    ops: bool = False


@dataclass(slots=True)
class Response:
    """A complete response (a streamed one is started, chunked and ended by the lifecycle instead)."""

    status: int
    headers: Headers
    body: bytes = b""


@dataclass(slots=True)
class Work:
    """A validated tokenize or generate call; the lifecycle tokenizes and (for generate) dispatches it.

    ``route`` picks the formatter that shapes the answer; ``options`` holds what a route parsed
    beyond the common fields (e.g. stop strings), for its formatter.
    """

    kind: str  # "tokenize" | "generate"
    prompt: str | None
    tokens: list[int] | None
    max_tokens: int
    stream: bool
    sampling: Sampling = field(default_factory=Sampling)
    route: str = GENERATE
    options: dict[str, Any] = field(default_factory=dict)
    max_wait_ms: int = 0  # the request's bound on waiting for its first token (0: the server's)
    cache_salt: str | None = None  # the request's own cache_salt field
    tenant: Tenant = ANONYMOUS  # whose request it is (its API key's)
    salt: int = 0  # the request header's cache_salt: the tenant's namespace and cache_salt (wire.cache_salt)
    flags: int = 0  # request flags beyond the stream flag (logprobs: contract/wire/logprobs.py); max_tokens then
    # counts output words, a whole number of records
    #: the grammar the answer must match, checked and not built yet: the lifecycle takes its words from the tenant's
    #: cache (edge/grammars.py) or has a tokenizer worker build them into :attr:`constraint`
    grammar: Grammar | None = None
    constraint: np.ndarray | None = None  # the words after the prompt: grammar, logit biases (wire.after_prompt)
    choices: int = 1  # OpenAI's n: choices of the one prompt, each on a slot of one slot server (edge/choices.py)
    #: a tokenize call that answers with the count alone, in its API's shape (Anthropic's count_tokens)
    counted: Callable[[int], Response] | None = None


@dataclass(frozen=True, slots=True)
class Grammar:
    """A grammar an answer must match (``response_format``, enforced tool calls), checked when its request was parsed
    and built later: ``digest`` names what it is built from (with the tenant, its cache key: edge/grammars.py);
    ``build`` makes its words -- llama.cpp's schema converter is Python that takes milliseconds, so it runs on a
    tokenizer worker, never on the event loop -- and raises :class:`HttpError` (400 naming the field) when the
    converter refuses the schema or the grammar is too large to travel; ``param``: where the request has it."""

    digest: bytes
    build: Callable[[], np.ndarray]
    param: str


@dataclass(frozen=True, slots=True)
class StateQuery:
    """A GET of a route whose answer needs live state the lifecycle owns (``/health``, ``/metrics``)."""

    route: str
    query: dict[str, list[str]]


#: what :meth:`edgepath.edge.routes.HttpCore.handle` returns
Handled = Response | StateQuery | Work


@dataclass(frozen=True, slots=True)
class Outcome:
    """A generate request that finished on the model side: what its formatter needs for the last word.

    ``tokens``: every output id (capped at the request's ``max_tokens``); ``first_token_ns``: receive
    -> first output token (0 when there was none); ``status``: the result header's status name;
    ``cached_tokens``: prompt tokens the model side reused from its prefix cache instead of computing them.
    """

    request_id: int
    input_count: int
    tokens: np.ndarray
    status: str
    first_token_ns: int
    cached_tokens: int = 0


class Formatter(Protocol):
    """Shapes one route's answer, streamed or not; the lifecycle owns when each piece is sent.

    A route (``/v1/generate`` here; OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` next)
    gives one formatter per request, so it can keep per-request state (an incremental detokenizer,
    stop strings).  ``tokens`` sees output as it arrives -- streamed requests, and whole ones when
    ``watch`` is set (the model side is then asked for streamed output too); setting ``done`` there
    ends the request early: the lifecycle answers with :meth:`end` (or :meth:`complete`) at once
    and abandons the frame, which cancels the slot, so the model stops instead of running on.
    """

    watch: bool
    done: bool
    #: the ``id`` the answer carries when it is not the edge's request id (OpenAI's ``cmpl-…``), so the usage log
    #: can name it; None when the answer carries the request id itself
    answer_id: str | None
    #: the served model's name, as the answer's ``model`` carries it, for the usage log (None: not known)
    model: str | None

    def complete(self, outcome: Outcome) -> Response:
        """The whole answer of a non-streamed request."""
        ...

    def start(self) -> tuple[int, Headers]:
        """Status and headers of a streamed answer."""
        ...

    def tokens(self, ids: np.ndarray) -> bytes:
        """The event chunk for output tokens that just arrived."""
        ...

    def end(self, outcome: Outcome) -> bytes:
        """The last chunk of a streamed answer."""
        ...

    def failure(self, error: HttpError) -> Response:
        """A whole error answer (refused, failed, timed out) in this route's error shape."""
        ...

    def error(self, error: HttpError) -> bytes:
        """The last chunk of a stream that failed after it had started."""
        ...


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for: body size, and the slot ABI's token capacities."""

    max_body: int
    input_capacity: int
    output_capacity: int
    vocab_size: int
    retry_after_s: int = 1  # a 429's Retry-After when the agent has no estimate of when to come back

    def check_length(self, count: int, constraint: int = 0) -> None:
        """400 with the exact count and the limit when a prompt (and the ``constraint`` words after it: a
        ``response_format``'s grammar) does not fit one slot."""
        cap = self.input_capacity
        if count > cap:
            raise HttpError(400, "prompt_too_long", f"prompt is {count} tokens; a slot holds at most {cap}")
        if count + constraint > cap:
            raise HttpError(
                400,
                "prompt_too_long",
                f"prompt is {count} tokens and its grammar (response_format, tools) and logit_bias take {constraint} "
                f"words after it; a slot holds at most {cap} (a simpler schema, fewer biases, a shorter prompt, or a "
                "server with larger --input-capacity)",
            )


class HttpError(Exception):
    """A request the core refuses; carries the status and the JSON error ``{type, message}``."""

    def __init__(
        self, status: int, type_: str, message: str, headers: Headers | None = None, *, param: str | None = None
    ) -> None:
        """``param``: the field it is about, for the shapes that name it apart from the message (OpenAI's)."""
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers or []
        self.param = param


class ApiError(Exception, ABC):
    """An error in one API's own shape (OpenAI's, Anthropic's): its status, its headers and its body, answered by
    :meth:`response` on every route of that API."""

    status: int
    headers: Headers

    @abstractmethod
    def body(self) -> bytes: ...

    def response(self) -> Response:
        return Response(self.status, [(b"content-type", JSON), *self.headers], self.body())


def body_too_large(size: int, limit: int) -> HttpError:
    """413 for a body of ``size`` bytes (the adapters send it as soon as a body grows past ``limit``)."""
    return HttpError(413, "body_too_large", f"request body is {size} bytes; the limit is {limit}")


def error_payload(exc: HttpError) -> dict[str, Any]:
    return {"error": {"type": exc.type, "message": exc.message}}


def error_response(exc: HttpError) -> Response:
    """An error in edgepath's own shape, ``{"error": {"type", "message"}}`` (OpenAI's routes have theirs)."""
    body = json.dumps(error_payload(exc)).encode()
    return Response(exc.status, [(b"content-type", JSON), *exc.headers], body)


def load_json(body: bytes) -> Any:
    """A request body's JSON document, exactly as the standard library reads it, and its errors
    (UnicodeDecodeError, ValueError, RecursionError) with their positions; orjson reads the common case
    at a fifth of the cost, and whatever it refuses (bad UTF-8, NaN, integers past 64 bits, unpaired
    surrogate escapes, deep nesting) is read again by the standard library, so no answer changes."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body.decode("utf-8"))


#: what :func:`json_object` found wrong with a body: not UTF-8, not JSON (or nested too deeply), not an object
BodyProblem = Literal["utf8", "json", "type"]


def json_object(body: bytes | Mapping[str, Any], refuse: Callable[[str, BodyProblem], Exception]) -> Mapping[str, Any]:
    """A request body that must be one JSON object (:func:`load_json`; one already parsed is taken as it is).  What
    is wrong with it is raised as ``refuse(problem, kind)`` -- ``problem`` says it of the body ("is not valid JSON:
    ..."), each API puts it in its own words, status and code, so every route reads bodies alike."""
    if isinstance(body, Mapping):
        return body
    try:
        doc = load_json(bytes(body))
    except UnicodeDecodeError as exc:
        raise refuse(f"is not valid UTF-8 (byte {exc.start})", "utf8") from None
    except ValueError as exc:
        raise refuse(f"is not valid JSON: {exc}", "json") from None
    except RecursionError:
        raise refuse("nests JSON too deeply to parse", "json") from None
    if not isinstance(doc, dict):
        raise refuse(f"must be a JSON object, got {json_type(doc)}", "type")
    return doc


def request_object(body: bytes) -> Mapping[str, Any]:
    """A body of edgepath's own routes (and llama-server's) as the JSON object it must be; else HttpError 400
    ``invalid_utf8``, ``invalid_json`` or ``invalid_request`` (JSON that is no object)."""
    return json_object(body, lambda problem, kind: HttpError(400, _BODY_CODES[kind], f"request body {problem}"))


_BODY_CODES: dict[BodyProblem, str] = {"utf8": "invalid_utf8", "json": "invalid_json", "type": "invalid_request"}


def json_response(status: int, payload: dict[str, Any]) -> Response:
    """A JSON answer, compact and UTF-8; numpy arrays (token ids) are written as arrays without a list copy."""
    body = orjson.dumps(payload, default=_as_list, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(status, [(b"content-type", JSON)], body)


def _as_list(value: Any) -> Any:
    """What orjson cannot write itself: a numpy array that is not contiguous, as a list."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def server_timing(timings: dict[str, int]) -> bytes:
    """``Server-Timing`` value (milliseconds, as the header's ``dur`` wants) of the stages measured."""
    return ", ".join([f"{k};dur={timings[k] / 1e6:.3f}" for k in STAGES if k in timings]).encode()


def timing_headers(timings: dict[str, int]) -> Headers:
    """``Server-Timing`` and ``X-Queue-Time``, in microseconds: the measured wait for the first token when the
    request got one (its time to first token minus its own uncached prompt on an idle server), else the time
    it waited in the edge's event loop."""
    waited = timings.get("wait", timings.get("queue", 0))
    return [
        (b"server-timing", server_timing(timings)),
        (b"x-queue-time", f"{waited / 1e3:.1f}us".encode()),
    ]


def max_wait_of(headers: Headers) -> int:
    """The bound a request asks for in ``X-Max-Wait`` (seconds), in milliseconds; 0 when it asks for none.  The
    agent applies it only when it is below its own (``--max-wait``: the one owner of the server's bound).
    HttpError 400 for a value that is no bound."""
    raw = next((value for name, value in headers if name.lower() == MAX_WAIT_HEADER), None)
    if raw is None:
        return 0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < math.inf):
        raise HttpError(
            400,
            "invalid_request",
            f"X-Max-Wait must be a positive number of seconds (the server's own bound applies when it is smaller), "
            f"got {raw.decode(errors='replace')!r}",
        )
    return max(1, min(round(seconds * 1e3), 0xFFFFFFFF))


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for error messages (``got array``)."""
    if value is None:
        return "null"
    return _JSON_TYPES.get(type(value), type(value).__name__)


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}


#: ``finish_details`` of an answer cut short because its slot was taken back for a tenant under its slot floor
#: (docs/TENANTS.md): its ``finish_reason`` is ``"length"`` -- OpenAI's value for an answer cut before its end,
#: so clients that only know OpenAI's values treat it as incomplete -- and this says why (the name
#: ``finish_details`` with a ``type`` is the one OpenAI's own gpt-4-vision-preview answers used)
RECLAIMED: Mapping[str, str] = {
    "type": "slot_reclaimed",
    "message": (
        "the answer was cut short: it ran on a slot lent to this API key, and a tenant under its slot floor took "
        "the slot back while no other slot was free; send the request again (or continue from this answer) for "
        "the rest"
    ),
}
