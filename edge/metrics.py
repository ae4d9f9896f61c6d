"""Edge metrics: Prometheus counters/histograms for scraping, and a live HDR window for ``/health``.

``/health?latency=P`` wants a percentile over *recent* traffic, which cumulative Prometheus
buckets cannot give: :class:`LatencyWindow` keeps two HDR histograms (current and previous
interval) and rotates them, so a query covers between one and two intervals of samples.
Time is passed in by the caller (nanoseconds, monotonic), never read here.

The edge workers of one ``serve --workers N`` share their counters and histograms through
prometheus_client's multiprocess files (the directory ``$PROMETHEUS_MULTIPROC_DIR``, set by ``serve``
for its workers), so whichever worker answers ``/metrics`` shows the sum of all of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import ClassVar

import numpy as np
from hdrh.histogram import HdrHistogram
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from edgepath.dpu.link_state import LinkState
from edgepath.dpu.port import DeliveryStats, SlotServerStatus
from edgepath.edge.connections import ConnectionLimits
from edgepath.edge.overload import MemoryGuard

SHARED_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

_US_HIGHEST = 60_000_000  # one minute, in microseconds
_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 150e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0)
# Token timing spans model speeds (a paced echo, a 135M model on 2 cores, a GPU): up to tens of seconds.
_TOKEN_BUCKETS = (100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 2.5, 10.0, 30.0)
# actual / predicted time to first token: 1 is a perfect prediction
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.75, 0.8, 0.9, 1.0, 1.1, 1.25, 1.33, 1.5, 2.0, 4.0)
# How late the event loop runs a timer: every tenant's requests wait that long (target: under 50 ms, issue 49)
_LAG_BUCKETS = (1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 2.5, 10.0)
#: the reasons a request is refused 429 at claim time (edgepath_refusals_total's label)
REFUSAL_REASONS = ("no_slot", "over_bound", "quota_exceeded", "slot_cap", "body_rate")


class LatencyWindow:
    """Percentiles of values (microseconds) recorded over the last one to two ``interval_ns``.

    A request records three values here (edge latency, time to first token, wait); one call of hdrh's
    pure-Python ``record_value`` each cost more than a microsecond of the edge's CPU per request.  So a value
    is appended to a batch, and the batch goes into the current histogram (before a query, a rotation, or at
    ``BATCH`` values) with each HDR bucket recorded once with its count: the same histogram, far fewer calls.
    """

    #: values held before they go into the histogram (memory stays bounded at any rate)
    BATCH = 1024

    def __init__(self, interval_ns: int = 10_000_000_000) -> None:
        self.interval_ns = interval_ns
        self._current = HdrHistogram(1, _US_HIGHEST, 3)
        self._previous = HdrHistogram(1, _US_HIGHEST, 3)
        self._started_ns: int | None = None
        self._batch: list[float] = []
        #: below 2**exact a value is its own bucket; above, the low (bit length - exact) bits are dropped
        self._exact = self._current.sub_bucket_count.bit_length() - 1

    def _fold(self) -> None:
        """The batch into the current histogram: each value as ``record_value`` would clamp and bucket it
        (its bucket's lowest value, as hdrh's ``get_lowest_equivalent_value``), each bucket once."""
        if not self._batch:
            return
        values = np.clip(np.rint(np.asarray(self._batch)), 1, _US_HIGHEST).astype(np.int64)
        self._batch.clear()
        shift = np.maximum(np.frexp(values)[1] - self._exact, 0)  # frexp's exponent: the bit length
        buckets, counts = np.unique((values >> shift) << shift, return_counts=True)
        record = self._current.record_value
        for value, count in zip(buckets.tolist(), counts.tolist(), strict=True):
            record(value, count)

    def _rotate(self, now_ns: int) -> None:
        self._fold()
        if self._started_ns is None:
            self._started_ns = now_ns
        elapsed = now_ns - self._started_ns
        if elapsed >= 2 * self.interval_ns:
            self._previous.reset()
            self._current.reset()
            self._started_ns = now_ns
        elif elapsed >= self.interval_ns:
            self._previous, self._current = self._current, self._previous
            self._current.reset()
            self._started_ns = now_ns

    def record(self, value_us: float, now_ns: int) -> None:
        started = self._started_ns
        if started is None or now_ns - started >= self.interval_ns:
            self._rotate(now_ns)
        batch = self._batch
        batch.append(value_us)
        if len(batch) >= self.BATCH:
            self._fold()

    def percentile(self, pct: float, now_ns: int) -> tuple[float, int, float]:
        """(value in µs at ``pct``, samples, seconds the window spans)."""
        self._rotate(now_ns)
        merged = HdrHistogram(1, _US_HIGHEST, 3)
        merged.add(self._previous)
        merged.add(self._current)
        span = (self.interval_ns + now_ns - (self._started_ns or now_ns)) / 1e9
        count = merged.get_total_count()
        return (float(merged.get_value_at_percentile(pct)) if count else 0.0), count, span


class EdgeMetrics:
    """The edge's Prometheus registry (one per edge, so tests can run several)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        free_slots: Callable[[], float],
        delivery_stats: Callable[[], DeliveryStats],
        window: LatencyWindow | None = None,
        supervision: Callable[[], tuple[int, int] | None] | None = None,
        slot_servers: Callable[[], Sequence[SlotServerStatus]] = tuple,
        clock: Callable[[], float] | None = None,
        gateway: Callable[[], tuple[int, int, int]] | None = None,
    ) -> None:
        """``supervision``: (restarts, hangs) of the supervised slot server, read when scraped (None: nothing
        supervised, no such metrics); ``slot_servers``: the port's per-server listing, read when scraped;
        ``clock``: the time of the port's clock (seconds), to say how long each link has been in its state;
        ``gateway``: (requests under way, free slots, all slots), read when scraped, for an inference gateway's
        metrics (:class:`_Gateway`; None: none)."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "edgepath_requests", "Requests answered, by route and status", ["route", "status"], registry=self.registry
        )
        self.resets = Counter(
            "edgepath_streams_reset", "Requests whose stream the client reset before the answer", registry=self.registry
        )
        latency = partial(Histogram, buckets=_LATENCY_BUCKETS, registry=self.registry)
        token_time = partial(Histogram, buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.edge_latency = latency(
            "edgepath_edge_latency_seconds", "Request complete at the edge -> doorbell seen by the slot poller"
        )
        self.total_latency = latency(
            "edgepath_request_seconds", "Request complete at the edge -> response ready", ["route"]
        )
        self.first_token_latency = token_time(
            "edgepath_time_to_first_token_seconds",
            "Request complete at the edge -> its first output token seen by the edge",
        )
        self.return_path_latency = latency(
            "edgepath_return_path_seconds",
            "The model side produced a stream's first token -> the edge hands its event to the transport",
        )
        self.inter_token_latency = token_time(
            "edgepath_inter_token_latency_seconds",
            "Time between output tokens seen by the edge (a delivery of k tokens counts k, spread evenly)",
        )
        self.prompt_tokens = Counter(
            "edgepath_prompt_tokens", "Prompt tokens of requests the model side answered", registry=self.registry
        )
        self.cache_requests = Counter(
            "edgepath_prefix_cache_requests",
            "Answered requests by whether the model side reused a cached prefix of their prompt (hit) or not (miss)",
            ["result"],
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "edgepath_prefix_cache_tokens",
            "Prompt tokens the model side reused from its prefix cache instead of computing them",
            registry=self.registry,
        )
        self.tenant_requests = Counter(
            "edgepath_tenant_requests",
            "Requests that ran on a slot, by tenant (the configuration's: a tenants file's names, key-<n> for the "
            "n-th key of a flat key list, anonymous without keys) and how they ended",
            ["tenant", "finish"],
            registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "edgepath_tenant_tokens",
            "Tokens of requests that ran, by tenant and kind: prompt (cached ones included), cached, completion -- "
            "what each was charged, and for an answer with usage exactly its usage",
            ["tenant", "kind"],
            registry=self.registry,
        )
        self._hit = self.cache_requests.labels("hit")
        self._miss = self.cache_requests.labels("miss")
        self.refusals = Counter(
            "edgepath_refusals",
            "Requests refused 429 at claim time, by reason: no free slot (no_slot), or every server's predicted "
            "wait for a first token over the request's bound (over_bound), its tenant's token quota spent "
            "(quota_exceeded) or its slot_cap reached (slot_cap: at this edge, or across every edge)",
            ["reason"],
            registry=self.registry,
        )
        self._refused = {reason: self.refusals.labels(reason) for reason in REFUSAL_REASONS}
        self.predicted_first_token = token_time(
            "edgepath_predicted_time_to_first_token_seconds",
            "The agent's prediction of an admitted request's time to first token, made at claim time",
        )
        self.wait = token_time(
            "edgepath_wait_seconds",
            "An admitted request's measured wait: its time to first token minus what its own uncached prompt "
            "takes on an idle server (the model side's step cost model)",
        )
        self.prediction_ratio = Histogram(
            "edgepath_time_to_first_token_prediction_ratio",
            "Actual / predicted time to first token of admitted requests with a prediction",
            buckets=_RATIO_BUCKETS,
            registry=self.registry,
        )
        #: live windows for /health?latency=P: time to first token and wait (microseconds)
        self.ttft_window = LatencyWindow(self.window_interval(window))
        self.wait_window = LatencyWindow(self.window_interval(window))
        self.delivery_stats = _DeliveryCollector(delivery_stats)
        self.registry.register(self.delivery_stats)
        self.free_slots = _FreeSlots(free_slots)
        self.registry.register(self.free_slots)
        self.supervision = _Supervision(supervision) if supervision is not None else None
        if self.supervision is not None:
            self.registry.register(self.supervision)
        self.slot_servers = _SlotServers(slot_servers, clock or (lambda: 0.0))
        self.registry.register(self.slot_servers)
        self.gateway = _Gateway(gateway) if gateway is not None else None
        if self.gateway is not None:
            self.registry.register(self.gateway)
        self.window = window or LatencyWindow()
        self.loop_lag = Histogram(
            "edgepath_event_loop_lag_seconds",
            "How late the edge's event loop ran a timer due every 50 ms: what every request waited meanwhile",
            buckets=_LAG_BUCKETS,
            registry=self.registry,
        )
        self._shared_dir = os.environ.get(SHARED_DIR_ENV)
        self._answered: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    def watch_memory(self, guard: MemoryGuard) -> None:
        """Show ``guard``'s latest reading and whether it sheds new work."""
        self.registry.register(_Memory(guard))

    def watch_connections(self, limits: ConnectionLimits) -> None:
        """Show ``limits``' open and refused connections (the service's, once it has them)."""
        self.registry.register(_Connections(limits))

    def answered(self, route: str, status: int, total_ns: int) -> None:
        children = self._answered.get((route, status))
        if children is None:  # labels() looks the child up under a lock: once per (route, status)
            children = self._answered[route, status] = (
                self.requests.labels(route, str(status)),
                self.total_latency.labels(route),
            )
        children[0].inc()
        children[1].observe(total_ns / 1e9)

    def tenant_usage(self, tenant: str, finish: str, prompt: int, cached: int, completion: int) -> None:
        """A request of ``tenant`` that ran has ended (``finish``) with these token counts."""
        self.tenant_requests.labels(tenant, finish).inc()
        for kind, tokens in (("prompt", prompt), ("cached", cached), ("completion", completion)):
            self.tenant_tokens.labels(tenant, kind).inc(tokens)

    def prompt(self, tokens: int, cached: int) -> None:
        """A request the model side answered: ``tokens`` prompt tokens, ``cached`` of them from its cache."""
        self.prompt_tokens.inc(tokens)
        if cached:
            self._hit.inc()
            self.cached_tokens.inc(cached)
        else:
            self._miss.inc()

    def edge(self, latency_ns: int, now_ns: int) -> None:
        self.edge_latency.observe(latency_ns / 1e9)
        self.window.record(latency_ns / 1e3, now_ns)

    def return_path(self, latency_ns: int) -> None:
        self.return_path_latency.observe(latency_ns / 1e9)

    def first_token(self, latency_ns: int, now_ns: int) -> None:
        self.first_token_latency.observe(latency_ns / 1e9)
        self.ttft_window.record(latency_ns / 1e3, now_ns)

    def waited(self, wait_ns: int, predicted_ns: int, actual_ns: int, now_ns: int) -> None:
        """An admitted request's measured wait, and its first token's predicted and actual times (predicted 0:
        the agent made no prediction)."""
        self.wait.observe(wait_ns / 1e9)
        self.wait_window.record(wait_ns / 1e3, now_ns)
        if predicted_ns > 0:
            self.predicted_first_token.observe(predicted_ns / 1e9)
            self.prediction_ratio.observe(actual_ns / predicted_ns)

    def refused(self, reason: str) -> None:
        """A 429 at claim time (``reason``: one of :data:`REFUSAL_REASONS`)."""
        self._refused[reason].inc()

    @staticmethod
    def window_interval(window: LatencyWindow | None) -> int:
        return window.interval_ns if window is not None else LatencyWindow().interval_ns

    def inter_token(self, gap_ns: float, tokens: int) -> None:
        """``tokens`` tokens arrived ``gap_ns`` apart each (one delivery after the previous one)."""
        for _ in range(tokens):
            self.inter_token_latency.observe(gap_ns / 1e9)

    def exposition(self) -> bytes:
        if self._shared_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, self._shared_dir)
        merged.register(self.free_slots)  # read live: the slot server's count, the same from every worker
        merged.register(self.delivery_stats)  # the port of the worker that answers the scrape
        if self.supervision is not None:
            merged.register(self.supervision)  # the supervising parent's counts, one for all workers
        merged.register(self.slot_servers)  # that worker's agent's links and claims
        if self.gateway is not None:
            merged.register(self.gateway)  # that worker's requests, its agent's view of the slots
        return generate_latest(merged)


class _FreeSlots:
    """``edgepath_free_slots``, read when scraped (a collector, so it is never one of the shared files)."""

    def __init__(self, read: Callable[[], float]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("edgepath_free_slots", "Free slots on attached slot servers", value=float(self.read()))


class _Memory:
    """The edge's memory against its limit (edge/overload.py), as last read on the lifecycle's tick."""

    def __init__(self, guard: MemoryGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        reading = self.guard.reading
        yield GaugeMetricFamily("edgepath_memory_bytes", "Resident memory of this edge process", value=reading.used)
        if reading.limit is not None:
            yield GaugeMetricFamily(
                "edgepath_memory_limit_bytes", "The memory limit new work is shed against", value=reading.limit
            )
        yield GaugeMetricFamily(
            "edgepath_overloaded",
            "1 while new requests are shed with 503 overloaded (memory over its high-water mark), else 0",
            value=int(self.guard.shedding),
        )


class _Connections:
    """The client connections of this edge (edge/connections.py), read when scraped: open now, and refused since it
    started, by reason (``total``, ``per_address``)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("edgepath_connections_open", "Client connections open", value=self.limits.open)
        refused = CounterMetricFamily(
            "edgepath_connections_refused", "Client connections refused past a limit, by reason", labels=["reason"]
        )
        for reason in ("total", "per_address"):
            refused.add_metric([reason], self.limits.refused[reason])
        yield refused


class _Gateway:
    """What an inference gateway's endpoint picker reads of a model server (the Gateway API Inference Extension's
    model-server protocol, under vLLM's names, so an InferencePool fronts edges unchanged), read when scraped:

    * ``vllm:num_requests_running`` (gauge): requests this edge has under way;
    * ``vllm:num_requests_waiting`` (gauge): always 0 -- admission is decided at claim time, a request that finds
      no free slot (or is predicted to wait over its bound) is answered 429 at once, so nothing ever waits in a
      queue here;
    * ``vllm:kv_cache_usage_perc`` (gauge, 0..1 as vLLM's): the share of slots behind this edge that are taken --
      each slot is one KV-cache sequence (``ctx_per_slot`` cells), so slot occupancy is KV occupancy; slots of a
      server that is not up count as taken, and with no slot server at all it is 1 (nothing to be had)."""

    def __init__(self, read: Callable[[], tuple[int, int, int]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        running, free, total = self.read()
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests under way at this edge", value=running)
        yield GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting in a queue: none, ever (429 at claim time)", value=0
        )
        usage = 1.0 - free / total if total else 1.0
        yield GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "Share of slots (KV-cache sequences) taken, 0..1", value=usage
        )


class _Supervision:
    """How often ``serve`` restarted its slot server, and how many of those it killed for hanging."""

    def __init__(self, read: Callable[[], tuple[int, int] | None]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        counts = self.read()
        if counts is None:
            return
        restarts, hangs = counts
        yield CounterMetricFamily(
            "edgepath_slot_server_restarts", "Restarts of the slot server serve supervises (any cause)", value=restarts
        )
        yield CounterMetricFamily(
            "edgepath_slot_server_hangs",
            "Slot servers serve killed (then restarted) because they stayed unresponsive past --hang-timeout",
            value=hangs,
        )


class _SlotServers:
    """One series per slot server (label ``slot_server``: its address), read from the port when scraped:
    its state (one ``state`` label per possible state, 1 for the current one), whether its link is up, how
    long it has been in its state, its free and total slots, and this agent's claims and re-attaches there."""

    def __init__(self, read: Callable[[], Sequence[SlotServerStatus]], clock: Callable[[], float]) -> None:
        self.read = read
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        servers = self.read()
        now = self.clock()
        labels = ["slot_server"]
        state = GaugeMetricFamily(
            "edgepath_slot_server_state",
            "1 for the state the link to this slot server is in",
            labels=[*labels, "state"],
        )
        link = GaugeMetricFamily("edgepath_slot_server_link_up", "1 while attached (up or unresponsive)", labels=labels)
        since = GaugeMetricFamily("edgepath_slot_server_state_seconds", "Seconds in the current state", labels=labels)
        free = GaugeMetricFamily("edgepath_slot_server_free_slots", "Free slots (0 while not up)", labels=labels)
        total = GaugeMetricFamily("edgepath_slot_server_slots", "Slots of this slot server", labels=labels)
        claims = CounterMetricFamily("edgepath_slot_server_claims", "Slots claimed there by this agent", labels=labels)
        back = CounterMetricFamily(
            "edgepath_slot_server_reattaches", "Times it came back and was re-attached", labels=labels
        )
        for server in servers:
            health = server.health
            address = [health.address]
            for each in LinkState:
                state.add_metric([*address, each.value], float(each is health.state))
            link.add_metric(address, float(health.state is not LinkState.DOWN))
            since.add_metric(address, max(0.0, now - health.since))
            for family, value in (
                (free, server.free_slots),
                (total, server.total_slots),
                (claims, server.claims),
                (back, server.reattaches),
            ):
                if value is not None:  # None: not known behind this port (an agent process's own counts)
                    family.add_metric(address, float(value))
        yield from (state, link, since, free, total, claims, back)


class _DeliveryCollector:
    """The port's exactly-once accounting, read at scrape time (the port owns the counts)."""

    _HELP: ClassVar[dict[str, str]] = {
        "delivered": "Final deliveries the agent port handed to the edge",
        "duplicates": "A second final delivery for a frame already answered (must stay 0)",
        "unknown": "Completions naming a frame not in flight, or another generation of it",
        "abandoned": "Frames the edge gave up (deadline passed, client gone)",
        "late": "Completions for abandoned frames, or sent on a slot server link given up on since (or that a "
        "request moved away from), discarded",
        "migrated": "Requests moved to another slot server when theirs went down or unresponsive (each move)",
    }

    def __init__(self, stats: Callable[[], DeliveryStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, help_text in self._HELP.items():
            yield CounterMetricFamily(f"edgepath_port_{name}", help_text, value=getattr(stats, name))
