"""``--quic-engine``: how the engine is chosen, and its errors.  The edge's HTTP/3 behaviour on each engine
is tested by tests/system/test_edge_e2e.py and tests/system/test_edge_interop.py, whose edge fixtures run
once per engine."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from edgepath.builder import worker_argv
from edgepath.cli import build_parser
from edgepath.config import EdgeSettings, ServeOptions, Supervision
from edgepath.edge.adapters import quic_engine
from edgepath.edge.adapters.quic import protocol_class
from edgepath.edge.adapters.quic_engine import ENGINES, QuicEngineError, load_engine


def _qh3_or_skip() -> None:
    try:
        load_engine("qh3")
    except QuicEngineError as exc:
        pytest.skip(f"qh3 cannot be imported here: {exc}")


def test_protocol_class_is_one_per_engine_and_recognises_that_engines_events() -> None:
    _qh3_or_skip()
    aio, qh3 = load_engine("aioquic"), load_engine("qh3")
    assert protocol_class(aio) is protocol_class(aio)
    assert issubclass(protocol_class(qh3), qh3.QuicConnectionProtocol)
    assert not issubclass(protocol_class(qh3), aio.QuicConnectionProtocol)
    assert qh3.HeadersReceived is not aio.HeadersReceived  # why the adapter takes names from its engine


def test_unknown_engine_is_refused_naming_the_choices() -> None:
    with pytest.raises(QuicEngineError, match=r"unknown QUIC engine 'quiche': choose from aioquic, qh3"):
        load_engine("quiche")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quic-engine", "quiche"])
    assert build_parser().parse_args(["serve"]).quic_engine == "aioquic"


def test_missing_engine_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_qh3(name: str, package: str | None = None) -> Any:
        if name.split(".")[0] == "qh3":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, package)

    load_engine.cache_clear()
    monkeypatch.setattr(quic_engine.importlib, "import_module", no_qh3)
    try:
        with pytest.raises(QuicEngineError, match=r"edgepath\[qh3\]"):
            load_engine("qh3")
    finally:
        load_engine.cache_clear()


def test_serve_options_check_the_engine_and_hand_it_to_every_worker() -> None:
    options = ServeOptions(edge=EdgeSettings(quic_engine="qh3"), supervision=Supervision(workers=2))
    argv = worker_argv(options, ("/tmp/slots.sock",))
    assert argv[argv.index("--quic-engine") + 1] == "qh3"
    with pytest.raises(ValueError, match=r"quic_engine must be one of aioquic, qh3, got 'quiche'"):
        EdgeSettings(quic_engine="quiche")


@pytest.mark.parametrize("name", ENGINES)
def test_the_servers_http3_encodes_header_fields_without_the_dynamic_table(name: str) -> None:
    """Per-request values (Server-Timing) would each be inserted on the encoder stream and acknowledged by the
    client; the edge's encoder writes literals whatever table the peer's SETTINGS offer."""
    if name == "qh3":
        _qh3_or_skip()
    engine = load_engine(name)
    connection = importlib.import_module(f"{name}.quic.connection").QuicConnection
    offered = {"max_table_capacity": 4096, "blocked_streams": 16}
    if name == "qh3":
        offered["dyn_table_capacity"] = 4096

    def encoder_stream_bytes(h3: object) -> int:
        encoder = h3._encoder  # type: ignore[attr-defined]
        encoder.apply_settings(**offered)
        sent = 0
        for i in range(20):
            headers = [(b":status", b"200"), (b"server", b"edgepath"), (b"server-timing", f"queue;dur={i}".encode())]
            sent += len(encoder.encode(4 * i, headers)[0])
        return sent

    quic = engine.configuration(is_client=True)
    assert encoder_stream_bytes(engine.H3Connection(connection(configuration=quic))) > 0  # what it replaces
    assert encoder_stream_bytes(engine.server_h3(connection(configuration=quic))) == 0
