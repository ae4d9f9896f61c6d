"""The router, sans I/O: a complete request in; an answer, a unit of work or a live-state query out.

Every path of the API is in one table, :data:`ROUTES`: the methods it allows and which API *shape* answers it --
``edgepath`` (:mod:`edgepath.edge.apis.generate`), ``openai`` (:mod:`edgepath.edge.apis.openai_routes`),
``responses`` (:mod:`edgepath.edge.apis.responses_answers`), ``anthropic``
(:mod:`edgepath.edge.apis.anthropic_answers`), ``llama`` (llama-server's utility routes:
:mod:`edgepath.edge.apis.llama_utils`) or ``ops``
(live state the lifecycle owns: :mod:`edgepath.edge.ops`).  Routing, ``Allow``, authentication, error shapes and
metric labels all read it.  :class:`HttpCore` checks the path, the method, the body's size and the API key, then
hands the body -- nested no deeper than ``JSON_DEPTH_MAX``, with at most ``JSON_CONTAINERS_MAX`` arrays and objects
(:mod:`edgepath.edge.apis.limits`) -- to its shape,
which parses it into a :class:`~edgepath.edge.http.Work` item or refuses it in its own error shape; every bad input
is answered here, at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import SplitResult, parse_qs, urlsplit

from edgepath.edge.apis.generate import GenerateRoutes
from edgepath.edge.apis.limits import LimitExceeded, check_json
from edgepath.edge.http import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    GENERATE,
    HEALTH,
    LIVE,
    LLAMA_DETOKENIZE,
    LLAMA_TOKENIZE,
    MESSAGES,
    METRICS,
    MODELS,
    OPENAPI,
    READY,
    RESPONSES,
    TOKENIZE,
    Handled,
    Headers,
    HttpError,
    Limits,
    Request,
    Response,
    StateQuery,
    Work,
    body_too_large,
    error_response,
    json_response,
    max_wait_of,
)
from edgepath.edge.openapi import document
from edgepath.edge.refusals import Refusals
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.tenancy.tenants import ANONYMOUS, Tenant


@dataclass(frozen=True, slots=True)
class Route:
    """One path of the API: the methods it allows and the API shape that answers it (``ops``: live state from the
    lifecycle; open without an API key unless ops are protected); ``admits``: its requests ask for a slot, so they
    may be refused from their headers alone, before their body is read (:meth:`HttpCore.head`)."""

    methods: tuple[str, ...]
    api: str
    admits: bool = False


#: the one route table: routing, ``Allow``, authentication, error shapes and metric labels all read it
ROUTES: dict[str, Route] = {
    GENERATE: Route(("POST",), "edgepath", admits=True),
    TOKENIZE: Route(("POST",), "edgepath"),
    COMPLETIONS: Route(("POST",), "openai", admits=True),
    CHAT: Route(("POST",), "openai", admits=True),
    MODELS: Route(("GET",), "openai"),
    RESPONSES: Route(("POST",), "responses", admits=True),
    MESSAGES: Route(("POST",), "anthropic", admits=True),
    COUNT_TOKENS: Route(("POST",), "anthropic"),
    LLAMA_TOKENIZE: Route(("POST",), "llama"),
    LLAMA_DETOKENIZE: Route(("POST",), "llama"),
    HEALTH: Route(("GET",), "ops"),
    LIVE: Route(("GET",), "ops"),
    READY: Route(("GET",), "ops"),
    METRICS: Route(("GET",), "ops"),
    OPENAPI: Route(("GET",), "openapi"),
}
#: the APIs the router answers itself (no shape): the ops pages and the OpenAPI document
OWN_APIS = ("ops", "openapi")


#: the ops routes a probe asks (Kubernetes' kubelet): open without a key unless ``--protect-ops``, on every listener;
#: they say only up or not (and why not)
PROBES = frozenset({LIVE, READY})


def api_of(path: str) -> str | None:
    """Who answers ``path`` (see :class:`Route`); None for a path the API does not have."""
    route = ROUTES.get(path)
    return route.api if route is not None else None


def route_label(request: Request) -> str:
    """The metrics label of a request: its path if it is one of the API's, else "other" (bounded cardinality)."""
    path = request.target.split("?", 1)[0]
    return path if path in ROUTES else "other"


class ApiShape(Protocol):
    """One API's routes as the router needs them: a body into work (or an answer), and an error in its shape."""

    def handle(self, path: str, method: str, body: bytes) -> Work | Response:
        """The work a request asks for, or its whole answer (a listing; an error in this API's shape).  May raise
        :class:`HttpError`, which :meth:`error` shapes."""
        ...

    def error(self, exc: HttpError) -> Response: ...


class HttpCore:
    """Routing, authentication and validation of edgepath's HTTP API, independent of transport.

    ``openai``: the OpenAI shape (its routes answer 404 without it); ``shapes``: further API shapes by the name
    :data:`ROUTES` gives them.  edgepath's own shape is always served.

    The ops routes (``/metrics`` names tenants and their usage; ``/health`` the slot servers, their addresses and
    load) are the operator's: with ``ops_listener`` (where ``--ops-listen`` serves them) only the probes are
    answered on the clients' listener, the rest 404 naming it; without it they need a key whenever keys are
    configured.  A request that came in on the ops listener (:attr:`Request.ops`) gets the ops routes only, without
    a key.
    """

    def __init__(
        self,
        limits: Limits,
        api_keys: ApiKeys | None = None,
        openai: ApiShape | None = None,
        *,
        shapes: Mapping[str, ApiShape] | None = None,
        ops_listener: str | None = None,
    ) -> None:
        self.limits = limits
        self.api_keys = api_keys
        self.ops_listener = ops_listener
        self.refusals = Refusals(limits.retry_after_s)
        self.shapes: dict[str, ApiShape] = {"edgepath": GenerateRoutes(limits), **(shapes or {})}
        if openai is not None:
            self.shapes["openai"] = openai
        self._openapi: Response | None = None

    def openapi(self) -> Response:
        """``/openapi.json``: the document of the routes this edge serves (written once, on first ask)."""
        if self._openapi is None:
            model = getattr(self.shapes.get("openai"), "model", None)
            routes = {
                path: route.methods
                for path, route in ROUTES.items()
                if route.api != "llama" or "llama" in self.shapes  # llama-server's: with the model's vocabulary
            }
            self._openapi = json_response(200, document(self.limits, routes, model))
        return Response(self._openapi.status, list(self._openapi.headers), self._openapi.body)

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
        api = api_of(path)
        shape = self.shapes.get(api) if api is not None and api not in OWN_APIS else None
        return shape.error(exc) if shape is not None else error_response(exc)

    def head(self, request: Request) -> tuple[Tenant, bool] | None:
        """What a request's head alone decides, before its body is read: its tenant, and whether its route asks for a
        slot -- the edge may refuse it now, for the price of its headers (docs/EDGE.md) -- or None for the routes
        that read no body (the ops pages, the OpenAPI document, a shape not served here); :class:`HttpError` for a
        path, method or API key that is refused whatever the body."""
        _, route, tenant = self._head(request)
        if route.api in OWN_APIS or self.shapes.get(route.api) is None:
            return None
        return tenant, route.admits

    def _head(self, request: Request) -> tuple[SplitResult, Route, Tenant]:
        """The path, method and API key checked (raises the refusal)."""
        parts = _split(request.target)
        route = ROUTES.get(parts.path)
        if request.ops and (route is None or route.api != "ops"):
            raise HttpError(
                404, "not_found", f"no such path {parts.path!r} on the ops listener; it serves {_OPS_PATHS}"
            )
        tenant = self._authorize(parts.path, request.headers, request.ops)
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
        return parts, route, tenant

    def _route(self, request: Request) -> Handled:
        parts, route, tenant = self._head(request)
        if len(request.body) > self.limits.max_body:  # the adapters refuse it while it arrives: seldom seen here
            raise body_too_large(len(request.body), self.limits.max_body)
        if route.api == "ops":
            return StateQuery(parts.path, parse_qs(parts.query))
        if route.api == "openapi":
            return self.openapi()
        shape = self.shapes.get(route.api)
        if shape is None:
            raise HttpError(404, "not_found", f"{parts.path} is not served here (no {route.api} routes configured)")
        try:  # before any shape parses it: no parser or walk of the document recurses or allocates past the limits
            check_json(request.body)
        except LimitExceeded as exc:
            raise HttpError(400, exc.code, exc.message) from None
        work = shape.handle(parts.path, request.method, request.body)
        if isinstance(work, Work) and work.kind == "generate":
            work.max_wait_ms = max_wait_of(request.headers)
            work.tenant = tenant
            work.salt = tenant.salt(work.cache_salt)
        return work

    def tenant_of(self, request: Request) -> str:
        """The name of the tenant ``request`` is from, without reading its body ("": none yet -- its answer says
        why, when it is read)."""
        try:
            return self._authorize(_split(request.target).path, request.headers).name
        except HttpError:
            return ""

    def _authorize(self, path: str, headers: Headers, on_ops_listener: bool = False) -> Tenant:
        """The request's tenant; 401 unless the request carries a valid key (when keys are configured).
        Unknown paths are checked too, so an unauthenticated client learns nothing about the routes.  The ops
        routes: see the class."""
        keys = self.api_keys
        if api_of(path) == "ops":
            if on_ops_listener or (path in PROBES and (keys is None or not keys.protect_ops)):
                return ANONYMOUS
            if self.ops_listener is not None:
                raise HttpError(404, "not_found", f"{path} is served on the ops listener ({self.ops_listener})")
        if keys is None or (api_of(path) == "openapi" and not keys.protect_ops):
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


_OPS_PATHS = ", ".join(sorted(path for path, route in ROUTES.items() if route.api == "ops"))


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
