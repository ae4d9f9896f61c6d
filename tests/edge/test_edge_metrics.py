"""Edge metrics: the recent-window HDR percentiles behind /health, and the Prometheus exposition."""

from __future__ import annotations

import numpy as np
import pytest
from hdrh.histogram import HdrHistogram
from prometheus_client.parser import text_string_to_metric_families

from edgepath.dpu.link_state import LinkTracker, Reason
from edgepath.dpu.port import DeliveryStats, SlotServerStatus
from edgepath.edge.metrics import EdgeMetrics, LatencyWindow

S = 1_000_000_000


def test_window_percentiles() -> None:
    window = LatencyWindow(interval_ns=10 * S)
    for v in range(1, 101):
        window.record(float(v), now_ns=S)
    p50, count, _ = window.percentile(50, now_ns=S)
    p99, _, _ = window.percentile(99, now_ns=S)
    assert count == 100
    assert p50 == 50 and p99 == 99


def test_window_forgets_old_samples() -> None:
    window = LatencyWindow(interval_ns=10 * S)
    window.record(1500.0, now_ns=0)
    window.record(10.0, now_ns=11 * S)  # one rotation: the old sample is still in "previous"
    assert window.percentile(100, now_ns=11 * S)[:2] == (1500.0, 2)
    window.record(20.0, now_ns=22 * S)  # second rotation: the 1500 µs sample is gone
    value, count, _ = window.percentile(100, now_ns=22 * S)
    assert (value, count) == (20.0, 2)
    assert window.percentile(99, now_ns=100 * S)[1] == 0  # idle long enough: empty


def test_window_batches_give_the_histogram_of_recording_each_value() -> None:
    """The batched window's histogram is the one hdrh builds recording every value itself: clamped, rounded
    (half to even, as round() does) and bucketed alike, from 0.4 µs to past the highest trackable value."""
    rng = np.random.default_rng(7)
    values = np.concatenate(
        [
            rng.lognormal(7, 3, 5000),  # ~1 ms, spread over every bucket size
            [0.0, 0.4, 0.5, 1.5, 2.5, 2047.5, 2048.0, 4095.0, 4097.0, 1e12],
            np.arange(2040, 2060, 0.5),
        ]
    )
    window = LatencyWindow(interval_ns=10 * S)
    direct = HdrHistogram(1, 60_000_000, 3)
    for v in values.tolist():
        window.record(v, now_ns=S)
        direct.record_value(min(max(round(v), 1), 60_000_000))
    window.percentile(50, now_ns=S)  # folds what is still batched
    assert list(window._current.counts) == list(direct.counts)
    assert window._current.get_total_count() == direct.get_total_count() == len(values) > 2 * LatencyWindow.BATCH
    for pct in (1, 50, 90, 99, 99.9, 100):
        assert window.percentile(pct, now_ns=S)[0] == direct.get_value_at_percentile(pct)


def test_prometheus_exposition_has_counts_latency_and_free_slots() -> None:
    stats = DeliveryStats(delivered=3, duplicates=0, unknown=1, abandoned=2, late=2)
    metrics = EdgeMetrics(lambda: 7, lambda: stats)
    metrics.first_token(3_000_000, now_ns=S)
    metrics.inter_token(400_000, 3)
    metrics.answered("/v1/generate", 200, 150_000)
    metrics.answered("/v1/generate", 429, 20_000)
    metrics.edge(120_000, now_ns=S)
    text = metrics.exposition().decode()
    assert 'edgepath_requests_total{route="/v1/generate",status="200"} 1.0' in text
    assert 'edgepath_requests_total{route="/v1/generate",status="429"} 1.0' in text
    assert "edgepath_edge_latency_seconds_count 1.0" in text
    assert 'edgepath_edge_latency_seconds_bucket{le="0.00015"} 1.0' in text
    assert "edgepath_free_slots 7.0" in text
    assert metrics.window.percentile(50, now_ns=S)[0] == 120
    assert 'edgepath_time_to_first_token_seconds_bucket{le="0.0025"} 0.0' in text
    assert 'edgepath_time_to_first_token_seconds_bucket{le="0.005"} 1.0' in text
    assert 'edgepath_inter_token_latency_seconds_bucket{le="0.0005"} 3.0' in text
    assert "edgepath_port_delivered_total 3.0" in text and "edgepath_port_duplicates_total 0.0" in text
    assert "edgepath_port_unknown_total 1.0" in text and "edgepath_port_late_total 2.0" in text


def test_every_slot_server_has_its_own_series_read_when_scraped() -> None:
    a, b = LinkTracker("/a.sock", 5.0, 0.0), LinkTracker("/b.sock", 5.0, 0.0)
    a.attached(0, 1.0)
    b.attached(0, 1.0)
    b.lost(Reason.FAILED, 8.0, "a failed read")
    listing = [SlotServerStatus(a.health(), 2, 4, 17, 0), SlotServerStatus(b.health(), 0, 4, 9, 1)]
    metrics = EdgeMetrics(lambda: 2, DeliveryStats, slot_servers=lambda: listing, clock=lambda: 10.0)
    text = metrics.exposition().decode()
    for line in [
        'edgepath_slot_server_state{slot_server="/a.sock",state="up"} 1.0',
        'edgepath_slot_server_state{slot_server="/a.sock",state="down"} 0.0',
        'edgepath_slot_server_state{slot_server="/b.sock",state="down"} 1.0',
        'edgepath_slot_server_state{slot_server="/b.sock",state="unresponsive"} 0.0',
        'edgepath_slot_server_link_up{slot_server="/a.sock"} 1.0',
        'edgepath_slot_server_link_up{slot_server="/b.sock"} 0.0',
        'edgepath_slot_server_state_seconds{slot_server="/a.sock"} 9.0',
        'edgepath_slot_server_state_seconds{slot_server="/b.sock"} 2.0',
        'edgepath_slot_server_free_slots{slot_server="/a.sock"} 2.0',
        'edgepath_slot_server_slots{slot_server="/b.sock"} 4.0',
        'edgepath_slot_server_claims_total{slot_server="/a.sock"} 17.0',
        'edgepath_slot_server_claims_total{slot_server="/b.sock"} 9.0',
        'edgepath_slot_server_reattaches_total{slot_server="/b.sock"} 1.0',
    ]:
        assert line in text, line
    listing.pop()
    assert "/b.sock" not in metrics.exposition().decode()  # read at each scrape, not kept


def test_refusals_by_reason_waits_and_predictions_are_exposed_and_windowed() -> None:
    metrics = EdgeMetrics(lambda: 0, DeliveryStats)
    metrics.refused("no_slot")
    metrics.refused("over_bound")
    metrics.refused("over_bound")
    metrics.first_token(900_000_000, now_ns=S)
    metrics.waited(300_000_000, predicted_ns=1_000_000_000, actual_ns=900_000_000, now_ns=S)
    metrics.waited(5_000_000, predicted_ns=0, actual_ns=50_000_000, now_ns=S)  # no prediction: no ratio
    text = metrics.exposition().decode()
    assert 'edgepath_refusals_total{reason="no_slot"} 1.0' in text
    assert 'edgepath_refusals_total{reason="over_bound"} 2.0' in text
    assert "edgepath_wait_seconds_count 2.0" in text
    assert "edgepath_predicted_time_to_first_token_seconds_count 1.0" in text
    assert 'edgepath_time_to_first_token_prediction_ratio_bucket{le="0.9"} 1.0' in text
    assert 'edgepath_time_to_first_token_prediction_ratio_bucket{le="0.8"} 0.0' in text
    value, count, _ = metrics.wait_window.percentile(100, now_ns=S)
    assert value == pytest.approx(300_000, rel=1e-3) and count == 2  # HDR: 3 significant digits
    value, count, _ = metrics.ttft_window.percentile(100, now_ns=S)
    assert value == pytest.approx(900_000, rel=1e-3) and count == 1


def test_an_inference_gateway_reads_the_model_server_protocol_gauges() -> None:
    """The Gateway API Inference Extension's endpoint picker reads vLLM's names: requests running, waiting (none,
    ever: 429 at claim time) and KV-cache usage (slots taken, 0..1)."""
    seen = {"running": 5, "free": 3, "total": 8}
    metrics = EdgeMetrics(lambda: 3, DeliveryStats, gateway=lambda: (seen["running"], seen["free"], seen["total"]))

    def gauges() -> dict[str, tuple[str, float]]:
        families = text_string_to_metric_families(metrics.exposition().decode())
        return {f.name: (f.type, f.samples[0].value) for f in families if f.name.startswith("vllm:")}

    assert gauges() == {
        "vllm:num_requests_running": ("gauge", 5.0),
        "vllm:num_requests_waiting": ("gauge", 0.0),
        "vllm:kv_cache_usage_perc": ("gauge", 1.0 - 3 / 8),
    }
    seen.update(running=0, free=8)  # read when scraped
    assert gauges()["vllm:num_requests_running"] == ("gauge", 0.0)
    assert gauges()["vllm:kv_cache_usage_perc"] == ("gauge", 0.0)
    seen.update(total=0, free=0)  # no slot server: nothing to be had
    assert gauges()["vllm:kv_cache_usage_perc"] == ("gauge", 1.0)
    assert "vllm:" not in EdgeMetrics(lambda: 3, DeliveryStats).exposition().decode()  # only when asked for
