"""Sans-I/O HTTP request handling: a complete request in, a response or a unit of work out.

Nothing here touches a socket, a thread or a clock: the QUIC and HTTP/1.1 adapters feed
:class:`Request` objects in, and timestamps arrive as arguments.  :meth:`HttpCore.handle`
answers what it can at once (every bad input) with a :class:`Response`, names the live-state
routes (health, metrics) with a :class:`StateQuery`, and turns a valid ``/v1/generate`` or
``/v1/tokenize`` call into a :class:`Work` item; the lifecycle then tokenizes, admits and
dispatches it, and the route's :class:`Formatter` shapes what goes back (one document, or
server-sent events as output arrives).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import SplitResult, parse_qs, urlsplit

import numpy as np
import orjson

from edgepath.contract.wire import Sampling
from edgepath.dpu.link_state import Readiness
from edgepath.edge.auth import ApiKeys
from edgepath.edge.quota import Refused
from edgepath.edge.sampling import FIELDS as SAMPLING_FIELDS
from edgepath.edge.sampling import GENERATE_DEFAULT, SamplingInvalid, parse_sampling
from edgepath.edge.tenants import ANONYMOUS, Tenant, parse_cache_salt

JSON = b"application/json"
SERVER = b"edgepath"  # the Server header of every answer, over either adapter
Headers = list[tuple[bytes, bytes]]

# The API's paths; what each allows and who answers it is the route table, ROUTES.
GENERATE, TOKENIZE = "/v1/generate", "/v1/tokenize"
COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
HEALTH, METRICS = "/health", "/metrics"
#: Kubernetes-style probes: the edge process answers (liveness), and it can serve -- a slot server is up (readiness)
LIVE, READY = "/health/live", "/health/ready"

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
    flags: int = 0  # request flags beyond the stream flag (log probabilities: contract/wire.py); max_tokens then
    # counts output words, a whole number of records
    constraint: np.ndarray | None = None  # a grammar's words, written after the prompt (contract/wire.py)
    choices: int = 1  # OpenAI's n: choices of the one prompt, each on a slot of one slot server (edge/choices.py)


@dataclass(frozen=True, slots=True)
class StateQuery:
    """A GET of a route whose answer needs live state the lifecycle owns (``/health``, ``/metrics``)."""

    route: str
    query: dict[str, list[str]]


#: what :meth:`HttpCore.handle` returns
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


class HttpError(Exception):
    """A request the core refuses; carries the status and the JSON error ``{type, message}``."""

    def __init__(self, status: int, type_: str, message: str, headers: Headers | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers or []


@dataclass(frozen=True, slots=True)
class Route:
    """One path of the API: the methods it allows and who answers it -- ``edgepath`` (the core parses the
    body), ``openai`` (the OpenAI routes, answered in OpenAI's shapes, errors included) or ``ops`` (live
    state from the lifecycle; open without an API key unless ``--protect-ops``)."""

    methods: tuple[str, ...]
    api: str


#: the one route table: routing, ``Allow``, authentication, error shapes and metric labels all read it
ROUTES: dict[str, Route] = {
    GENERATE: Route(("POST",), "edgepath"),
    TOKENIZE: Route(("POST",), "edgepath"),
    COMPLETIONS: Route(("POST",), "openai"),
    CHAT: Route(("POST",), "openai"),
    MODELS: Route(("GET",), "openai"),
    HEALTH: Route(("GET",), "ops"),
    LIVE: Route(("GET",), "ops"),
    READY: Route(("GET",), "ops"),
    METRICS: Route(("GET",), "ops"),
}


def api_of(path: str) -> str | None:
    """Who answers ``path`` (see :class:`Route`); None for a path the API does not have."""
    route = ROUTES.get(path)
    return route.api if route is not None else None


class OpenAIParser(Protocol):
    """The OpenAI routes as the core needs them (implemented by edgepath.edge.openai_routes.OpenAIRoutes)."""

    def models(self) -> Response: ...

    def parse(self, path: str, body: bytes) -> Work | Response: ...

    def error(self, exc: HttpError) -> Response: ...


def body_too_large(size: int, limit: int) -> HttpError:
    """413 for a body of ``size`` bytes (the adapters send it as soon as a body grows past ``limit``)."""
    return HttpError(413, "body_too_large", f"request body is {size} bytes; the limit is {limit}")


def _error_payload(exc: HttpError) -> dict[str, Any]:
    return {"error": {"type": exc.type, "message": exc.message}}


def _split(target: str) -> SplitResult:
    """The request target's parts, or a 400 that says why it cannot be read (``//[``: an unclosed IPv6 host)."""
    try:
        return urlsplit(target)
    except ValueError as exc:
        raise HttpError(
            400,
            "invalid_target",
            f"the request target {target[:80]!r} cannot be read ({exc}); send a path such as {GENERATE}",
        ) from None


def error_response(exc: HttpError) -> Response:
    """An error in edgepath's own shape, ``{"error": {"type", "message"}}`` (OpenAI's routes have theirs)."""
    body = json.dumps(_error_payload(exc)).encode()
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


class HttpCore:
    """Routing and validation of edgepath's HTTP API, independent of transport."""

    def __init__(self, limits: Limits, api_keys: ApiKeys | None = None, openai: OpenAIParser | None = None) -> None:
        self.limits = limits
        self.api_keys = api_keys
        self.openai = openai

    # -- entry ----------------------------------------------------------------------
    def handle(self, request: Request) -> Handled:
        """A final :class:`Response`, a :class:`Work` item, or a :class:`StateQuery` for
        health/metrics, which need live state the lifecycle owns."""
        try:
            return self._route(request)
        except HttpError as exc:
            return self.refusal(request.target, exc)

    def refusal(self, target: str, exc: HttpError) -> Response:
        """The error answer to a request for ``target``, in the shape of the API that path belongs to
        (OpenAI's on the OpenAI routes, edgepath's elsewhere)."""
        try:
            path = urlsplit(target).path
        except ValueError:  # a target _route refused as unreadable: edgepath's shape
            path = ""
        if self.openai is not None and api_of(path) == "openai":
            return self.openai.error(exc)
        return error_response(exc)

    def _route(self, request: Request) -> Handled:
        parts = _split(request.target)
        tenant = self._authorize(parts.path, request.headers)
        route = ROUTES.get(parts.path)
        if route is None:
            raise HttpError(404, "not_found", f"no such path {parts.path!r}; try POST {GENERATE}")
        methods = route.methods
        if request.method not in methods:
            raise HttpError(
                405,
                "method_not_allowed",
                f"{request.method} is not allowed on {parts.path}; use {', '.join(methods)}",
                [(b"allow", ", ".join(methods).encode())],
            )
        if len(request.body) > self.limits.max_body:  # the adapters refuse it while it arrives: seldom seen here
            raise body_too_large(len(request.body), self.limits.max_body)
        if route.api == "openai":
            if self.openai is None:
                raise HttpError(404, "not_found", f"{parts.path} is not served here (no OpenAI routes configured)")
            if request.method == "GET":
                return self.openai.models()
            work = self.openai.parse(parts.path, request.body)
        elif route.api == "ops":
            return StateQuery(parts.path, parse_qs(parts.query))
        else:
            work = self._parse_body(parts.path, request.body)
        if isinstance(work, Work) and work.kind == "generate":
            work.max_wait_ms = max_wait_of(request.headers)
            work.tenant = tenant
            work.salt = tenant.salt(work.cache_salt)
        return work

    def _authorize(self, path: str, headers: Headers) -> Tenant:
        """The request's tenant; 401 unless the request carries a valid key (when keys are configured).
        Unknown paths are checked too, so an unauthenticated client learns nothing about the routes."""
        keys = self.api_keys
        if keys is None or (api_of(path) == "ops" and not keys.protect_ops):
            return ANONYMOUS
        presented = keys.presented(headers)
        tenant = keys.identify(presented)
        if tenant is None:
            why = "is not valid" if presented else "is missing"
            raise HttpError(
                401,
                "unauthorized",
                f"API key {why}: send it as 'x-api-key: KEY' or 'Authorization: Bearer KEY'",
                [(b"www-authenticate", b"Bearer")],
            )
        return tenant

    def _parse_body(self, path: str, body: bytes) -> Work:
        try:
            doc = load_json(body)
        except UnicodeDecodeError as exc:
            raise HttpError(400, "invalid_utf8", f"request body is not valid UTF-8 (byte {exc.start})") from None
        except ValueError as exc:
            raise HttpError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise HttpError(400, "invalid_request", f"request body must be a JSON object, got {type(doc).__name__}")
        kind = "generate" if path == GENERATE else "tokenize"
        generating = {"max_tokens", "stream", "cache_salt", *SAMPLING_FIELDS}
        allowed = {"prompt", "tokens"} | (generating if kind == "generate" else set())
        unknown = sorted(set(doc) - allowed)
        if unknown:
            raise HttpError(400, "invalid_request", f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        prompt, tokens = self._input(doc)
        if kind == "tokenize":
            return Work(kind, prompt, tokens, 0, False, route=path)
        work = Work(kind, prompt, tokens, self._max_tokens(doc), self._stream(doc), self._sampling(doc), route=path)
        try:
            work.cache_salt = parse_cache_salt(doc)
        except SamplingInvalid as exc:
            raise HttpError(400, "invalid_request", exc.message) from None
        return work

    def _input(self, doc: dict[str, Any]) -> tuple[str | None, list[int] | None]:
        has_prompt, has_tokens = "prompt" in doc, "tokens" in doc
        if has_prompt == has_tokens:
            raise HttpError(400, "invalid_request", "give exactly one of 'prompt' (a string) or 'tokens' (token ids)")
        if has_prompt:
            prompt = doc["prompt"]
            if not isinstance(prompt, str):
                raise HttpError(400, "invalid_request", f"'prompt' must be a string, got {json_type(prompt)}")
            if not prompt:
                raise HttpError(400, "invalid_request", "'prompt' is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise HttpError(
                    400, "invalid_utf8", "'prompt' contains an unpaired surrogate escape, which is not valid UTF-8"
                ) from None
            return prompt, None
        tokens = doc["tokens"]
        vocab = self.limits.vocab_size
        if not isinstance(tokens, list) or not tokens or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise HttpError(400, "invalid_request", f"'tokens' must be a non-empty list of token ids in 0..{vocab - 1}")
        return None, tokens

    def _max_tokens(self, doc: dict[str, Any]) -> int:
        cap = self.limits.output_capacity
        value = doc.get("max_tokens", cap)
        if type(value) is not int or not 1 <= value <= cap:
            raise HttpError(400, "invalid_max_tokens", f"'max_tokens' must be an integer in 1..{cap}, got {value!r}")
        return value

    @staticmethod
    def _sampling(doc: dict[str, Any]) -> Sampling:
        """The sampling fields, parsed and refused exactly as on the OpenAI routes (greedy by default)."""
        try:
            return parse_sampling(doc, GENERATE_DEFAULT)
        except SamplingInvalid as exc:
            raise HttpError(400, "invalid_request", exc.message) from None

    @staticmethod
    def _stream(doc: dict[str, Any]) -> bool:
        value = doc.get("stream", False)
        if not isinstance(value, bool):
            raise HttpError(400, "invalid_request", f"'stream' must be true or false, got {json_type(value)}")
        return value

    # -- after tokenization ---------------------------------------------------------------
    def check_length(self, count: int, constraint: int = 0) -> None:
        """400 with the exact count and the limit when a prompt (and the ``constraint`` words after it: a
        ``response_format``'s grammar) does not fit one slot."""
        cap = self.limits.input_capacity
        if count > cap:
            raise HttpError(
                400,
                "prompt_too_long",
                f"prompt is {count} tokens; a slot holds at most {cap}",
            )
        if count + constraint > cap:
            raise HttpError(
                400,
                "prompt_too_long",
                f"prompt is {count} tokens and the response_format's grammar takes {constraint} words after it; a "
                f"slot holds at most {cap} (a simpler schema, a shorter prompt, or a server with larger "
                "--input-capacity)",
            )

    @staticmethod
    def tokenize_response(ids: Sequence[int]) -> Response:
        return json_response(200, {"tokens": list(ids), "count": len(ids)})

    def no_slot(self, retry_ms: float = 0.0) -> HttpError:
        """429 at once: nothing is queued, the client retries -- when the agent predicts the first slot frees
        (``retry_ms``; 0: no estimate, the default ``Retry-After``)."""
        return self._retry_later("no_slot", "every slot is busy; this server does not queue requests", retry_ms)

    def busy(self) -> HttpError:
        """429 at once when every tokenizer worker is busy with a large prompt: no waiting line."""
        return self._retry_later(
            "tokenizer_busy", "every tokenizer worker is busy with a large prompt; this server does not queue", 0.0
        )

    def over_bound(self, wait_ms: float, bound_ms: float, retry_ms: float) -> HttpError:
        """429 at once: every slot server's predicted wait for a first token is over the request's bound;
        ``retry_ms``: when the agent predicts the wait will be back within it."""
        return self._retry_later(
            "over_bound",
            f"the predicted wait for a first token is {wait_ms / 1e3:.2f} s, over this request's bound of "
            f"{bound_ms / 1e3:.2f} s (X-Max-Wait, at most the server's); this server does not queue requests",
            retry_ms,
        )

    def over_cap(self, cap: int) -> HttpError:
        """429 ``slot_cap`` at once: the tenant already has ``cap`` requests in flight at this edge, its most."""
        why = f"this API key's tenant has {cap} requests in flight at this edge, its slot_cap"
        return self._retry_later("slot_cap", why, 0.0)

    def over_quota(self, refused: Refused) -> HttpError:
        """429 ``quota_exceeded`` at once, before any work: the request's prompt and ``max_tokens`` (or the request
        itself) do not fit what is left of its tenant's quota; ``retry-after-ms`` says when enough will have
        refilled (none when the request alone is more than the whole quota: it never fits)."""
        unit, limit, window = refused.unit, refused.limit, refused.window
        if unit == "tokens":
            need = f"this request needs {refused.need} tokens (its prompt and max_tokens)"
        else:
            need = "this request is 1 request"
        if math.isinf(refused.retry_after):
            why = f"{need}, more than the whole {limit}-token quota per {window}: lower max_tokens"
            return HttpError(429, "quota_exceeded", why)
        quota = f"{limit}-{unit[:-1]} quota per {window}"
        why = f"{need}; {refused.remaining} of the {quota} {'is' if refused.remaining == 1 else 'are'} left"
        return self._retry_later("quota_exceeded", why, max(1.0, refused.retry_after * 1e3))

    def quota_unavailable(self, why: str) -> HttpError:
        """503 ``quota_unavailable`` at once: the tenant has a quota and the ledger that counts it cannot be reached
        -- quotas fail closed (nothing is served uncounted); ``Retry-After`` the default."""
        return HttpError(
            503,
            "quota_unavailable",
            f"this API key's tenant has a quota and its ledger cannot be reached ({why}); retry later",
            [(b"retry-after", str(self.limits.retry_after_s).encode())],
        )

    def _retry_later(self, type_: str, why: str, retry_ms: float) -> HttpError:
        """A 429 that says when to come back: ``retry-after-ms`` (what the openai SDK reads first) and
        ``Retry-After`` in whole seconds, rounded up (every other client); without an estimate, the default."""
        if retry_ms > 0:
            ms = math.ceil(retry_ms)
            headers = [(b"retry-after-ms", str(ms).encode()), (b"retry-after", str(math.ceil(ms / 1e3)).encode())]
        else:
            headers = [(b"retry-after", str(self.limits.retry_after_s).encode())]
        return HttpError(429, type_, f"{why}, retry later", headers)

    @staticmethod
    def health_response(
        free: int,
        total: int,
        verdict: Readiness,
        query: dict[str, list[str]],
        window: Callable[[float], tuple[float, int, float]],
        slot_servers: Sequence[Mapping[str, Any]] = (),
        first_token: Mapping[str, Callable[[float], tuple[float, int, float]]] | None = None,
    ) -> Response:
        """``/health``: 200 when a slot server is up, else 503 naming the reason; every slot server listed
        (``slot_servers``: address, state, ...); ``?latency=P`` adds the live P-th percentile of edge-internal
        latency, and with ``first_token`` ({"ttft": ..., "wait": ...}) of time to first token and of the wait
        for it."""
        payload: dict[str, Any] = {"status": verdict.status, "free_slots": free, "total_slots": total}
        if not verdict.ready:
            payload["reason"] = verdict.reason
        payload["slot_servers"] = list(slot_servers)
        if "latency" in query:
            raw = query["latency"][-1]
            try:
                pct = float(raw)
            except ValueError:
                pct = math.nan
            if not 0 < pct <= 100:
                return error_response(
                    HttpError(400, "invalid_request", f"latency percentile must be in (0, 100], got {raw!r}")
                )
            value_us, count, seconds = window(pct)
            payload["latency"] = {"percentile": pct, "edge_us": value_us, "samples": count, "window_s": seconds}
            for name, read in (first_token or {}).items():
                value_us, count, _ = read(pct)
                payload["latency"][f"{name}_us"] = value_us
                payload["latency"][f"{name}_samples"] = count
        return json_response(200 if verdict.ready else 503, payload)

    @staticmethod
    def ready_response(verdict: Readiness) -> Response:
        """``/health/ready`` (a readiness probe): 200 when a slot server is up -- free slots or not: a full
        server answers 429 at once, which is serving -- else 503 with the reason."""
        payload = {"status": verdict.status} if verdict.ready else {"status": verdict.status, "reason": verdict.reason}
        return json_response(200 if verdict.ready else 503, payload)

    @staticmethod
    def live_response() -> Response:
        """``/health/live`` (a liveness probe): 200 whenever the edge answers at all.  A frozen slot server
        makes the edge unready, never dead: restarting the edge would not help (``serve`` restarts the slot
        server itself)."""
        return json_response(200, {"status": "ok"})


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


class GenerateFormatter:
    """``/v1/generate``: one JSON document, or one ``data: {"token": id}`` event per token then
    ``event: done`` with the summary and the first-token time when streamed."""

    def __init__(self, decode: Callable[[np.ndarray], str], model: str | None = None) -> None:
        """``model``: the served model's name, for the usage log (the answer itself names none)."""
        self._decode = decode
        self.watch: bool = False  # /v1/generate has no stop strings: the model decides when it is done
        self.done: bool = False
        self.answer_id: str | None = None  # its answer's id is the edge's request id
        self.model = model

    @staticmethod
    def _summary(outcome: Outcome) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "id": outcome.request_id,
            "input_count": outcome.input_count,
            "output_count": len(outcome.tokens),
            "cached_tokens": outcome.cached_tokens,
        }
        if outcome.status == "RECLAIMED":
            summary["finish_details"] = dict(RECLAIMED)
        return summary

    def complete(self, outcome: Outcome) -> Response:
        summary = self._summary(outcome)
        return json_response(200, {**summary, "tokens": outcome.tokens, "text": self._decode(outcome.tokens)})

    def start(self) -> tuple[int, Headers]:
        return 200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    def tokens(self, ids: np.ndarray) -> bytes:
        return b"".join(b'data: {"token": %d}\n\n' % t for t in ids.tolist())

    def end(self, outcome: Outcome) -> bytes:
        doc = {
            **self._summary(outcome),
            "text": self._decode(outcome.tokens),
            "first_token_ms": round(outcome.first_token_ns / 1e6, 3),
        }
        return f"event: done\ndata: {json.dumps(doc)}\n\n".encode()

    @staticmethod
    def failure(error: HttpError) -> Response:
        return error_response(error)

    def error(self, error: HttpError) -> bytes:
        return f"event: error\ndata: {json.dumps(_error_payload(error))}\n\n".encode()
