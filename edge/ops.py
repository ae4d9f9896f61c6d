"""The operator's pages of an edge: ``/health`` (every slot server, free slots, live latency percentiles),
``/health/ready`` and ``/health/live`` (Kubernetes probes) and ``/metrics`` (Prometheus).

They answer from live state -- the agent port's links and heartbeats, the edge's metrics -- read when asked, so a
verdict is current; nothing here changes that state.  The router names these paths with a
:class:`~edgepath.edge.http.StateQuery` and the lifecycle hands it here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from edgepath.dpu.link_state import LinkHealth, LinkState, Readiness, readiness
from edgepath.dpu.port import AgentPort, SlotServerStatus
from edgepath.edge.http import LIVE, METRICS, READY, HttpError, Response, StateQuery, error_response, json_response
from edgepath.edge.metrics import EdgeMetrics

#: the verdict of an edge that is stopping (SIGTERM): unready, so the Service sends new requests elsewhere
DRAINING = Readiness(False, "draining", "this edge is stopping: it takes no new requests")


class OpsPages:
    """The ops routes of one edge, answered from its agent port and its metrics."""

    def __init__(self, port: AgentPort, metrics: EdgeMetrics) -> None:
        self.port = port
        self.metrics = metrics

    def answer(self, query: StateQuery, now: int, draining: bool) -> Response:
        """The page ``query`` asks for (``now``: the lifecycle's monotonic ns; ``draining``: the edge is stopping)."""
        if query.route == METRICS:
            return Response(200, [(b"content-type", self.metrics.content_type.encode())], self.metrics.exposition())
        if query.route == LIVE:
            return live_response()
        port = self.port
        listed = port.servers()  # reads the servers' heartbeats too: the verdict is current
        verdict = DRAINING if draining else readiness(port.links_health(), now / 1e9)
        if query.route == READY:
            return ready_response(verdict)
        counts = [(s.free_slots, s.total_slots) for s in listed]
        if listed and all(free is not None and total is not None for free, total in counts):
            free, total = sum(f for f, _ in counts), sum(t for _, t in counts)  # type: ignore[misc]  # the same READs
        else:
            free, total = port.free_slots()
        windows = self.metrics
        return health_response(
            free,
            total,
            verdict,
            query.query,
            lambda pct: windows.window.percentile(pct, now),
            [slot_server_entry(server, now / 1e9) for server in listed],
            {
                "ttft": lambda pct: windows.ttft_window.percentile(pct, now),
                "wait": lambda pct: windows.wait_window.percentile(pct, now),
            },
        )


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


def ready_response(verdict: Readiness) -> Response:
    """``/health/ready`` (a readiness probe): 200 when a slot server is up -- free slots or not: a full
    server answers 429 at once, which is serving -- else 503 with the reason."""
    payload = {"status": verdict.status} if verdict.ready else {"status": verdict.status, "reason": verdict.reason}
    return json_response(200 if verdict.ready else 503, payload)


def live_response() -> Response:
    """``/health/live`` (a liveness probe): 200 whenever the edge answers at all.  A frozen slot server
    makes the edge unready, never dead: restarting the edge would not help (``serve`` restarts the slot
    server itself)."""
    return json_response(200, {"status": "ok"})


def slot_server_entry(server: SlotServerStatus, now: float) -> dict[str, Any]:
    """One slot server in ``/health``: where it is, whether its link is up, its state (up, unresponsive,
    down), why and for how long (``now``: the port's clock, seconds), its slots and what this edge's
    agent claimed there."""
    health = server.health
    entry: dict[str, Any] = {
        "address": health.address,
        "state": health.state.value,
        "link": "down" if health.state is LinkState.DOWN else "up",
        "reason": "" if health.up else health.describe(now),
        "for_s": round(max(0.0, now - health.since), 3),
    }
    counts = {
        "free_slots": server.free_slots,
        "total_slots": server.total_slots,
        "claims": server.claims,
        "reattaches": server.reattaches,
    }
    entry.update((key, value) for key, value in counts.items() if value is not None)  # None: not known here
    return entry


def unresponsive(links: Sequence[LinkHealth], now: int) -> str:
    """Why requests on unresponsive slot servers get no result: each such server and its state (``now``:
    monotonic ns), for the 504 that answers them."""
    stuck = [h for h in links if h.state is LinkState.UNRESPONSIVE]
    named = "; ".join(f"slot server {h.address}: {h.describe(now / 1e9)}" for h in stuck)
    return named or "its slot server stopped responding"
