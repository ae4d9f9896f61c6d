"""The QUIC engine behind the HTTP/3 adapter: aioquic (the reference, always installed) or qh3.

qh3 is aioquic's fork with native (Rust) crypto and packet protection; it keeps aioquic's module
layout and class names under the ``qh3`` package (``qh3.asyncio``, ``qh3.h3.connection``,
``qh3.h3.events``, ``qh3.quic.configuration``, ``qh3.quic.events`` -- checked against qh3 2.1).
The classes of the two engines are distinct, so an adapter built for one does not recognise the
events of the other: this module is the one place that says which package each name comes from.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any

ENGINES = ("aioquic", "qh3")
DEFAULT_ENGINE = "aioquic"
_EXTRAS = {"qh3": "pip install 'edgepath[qh3]'"}
# qh3's H3Connection always sends SETTINGS_H3_DATAGRAM=1, which RFC 9297 allows only with the QUIC
# max_datagram_frame_size transport parameter; without it aioquic (and any strict peer) closes the
# connection with H3_SETTINGS_ERROR.  Advertising datagram support makes the two consistent.
_CONFIGURATION_DEFAULTS: dict[str, tuple[tuple[str, Any], ...]] = {"qh3": (("max_datagram_frame_size", 65536),)}


#: where each name of :class:`QuicEngine` lives in an engine's package (the same on both)
_LAYOUT = {
    "asyncio": ("QuicConnectionProtocol", "serve", "connect"),
    "asyncio.server": ("QuicServer",),
    "h3.connection": ("H3Connection", "H3_ALPN"),
    "h3.events": ("HeadersReceived", "DataReceived"),
    "quic.configuration": ("QuicConfiguration",),
    "quic.events": ("ProtocolNegotiated", "StreamReset", "StopSendingReceived", "ConnectionTerminated"),
}


class QuicEngineError(RuntimeError):
    """The requested engine is unknown or not installed."""


@dataclass(frozen=True)
class QuicEngine:
    """The names the edge adapter, the floor and clients use, taken from one engine's package."""

    name: str
    QuicConnectionProtocol: type[Any]
    QuicServer: type[Any]
    serve: Any  # coroutine function: (host, port, *, configuration, create_protocol) -> QuicServer
    connect: Any  # async context manager factory: (host, port, *, configuration, create_protocol)
    QuicConfiguration: type[Any]
    H3Connection: type[Any]
    H3_ALPN: tuple[str, ...]
    HeadersReceived: type[Any]
    DataReceived: type[Any]
    ProtocolNegotiated: type[Any]
    StreamReset: type[Any]
    StopSendingReceived: type[Any]
    ConnectionTerminated: type[Any]
    configuration_defaults: tuple[tuple[str, Any], ...] = ()

    def configuration(self, *, is_client: bool) -> Any:
        """An HTTP/3 ``QuicConfiguration`` of this engine, with the settings it needs to interoperate."""
        return self.QuicConfiguration(
            is_client=is_client, alpn_protocols=list(self.H3_ALPN), **dict(self.configuration_defaults)
        )

    def server_h3(self, quic: Any) -> Any:
        """The server's HTTP/3 connection over ``quic``, encoding header fields without QPACK's dynamic table.

        edgepath's answers carry values that are new on every response (``Server-Timing``, ``X-Queue-Time``);
        with a dynamic table the encoder inserts each one on its encoder stream and the client acknowledges
        each field section on its decoder stream -- frames both ways for entries never used again.  Literal
        field lines cost a few bytes per repeated header instead (RFC 9204 allows an encoder to use less
        dynamic table than the peer's decoder offers).  The engines keep the encoder in ``_encoder``
        (checked here, on both)."""
        h3 = self.H3Connection(quic)
        if not hasattr(h3, "_encoder"):
            raise QuicEngineError(
                f"{self.name}: its H3Connection has no _encoder (an engine version edgepath does not know)"
            )
        h3._encoder = _LiteralEncoder(h3._encoder)
        return h3


class _LiteralEncoder:
    """A QPACK encoder told that the dynamic table has no room, whatever the peer's SETTINGS offer."""

    _NO_TABLE = ("max_table_capacity", "dyn_table_capacity", "blocked_streams")

    def __init__(self, encoder: Any) -> None:
        self._encoder = encoder

    def apply_settings(self, **settings: int) -> bytes:
        return self._encoder.apply_settings(**{k: 0 if k in self._NO_TABLE else v for k, v in settings.items()})

    def encode(self, stream_id: int, headers: Any) -> tuple[bytes, bytes]:
        return self._encoder.encode(stream_id, headers)

    def feed_decoder(self, data: bytes) -> Any:
        return self._encoder.feed_decoder(data)


@cache
def load_engine(name: str = DEFAULT_ENGINE) -> QuicEngine:
    """The engine ``name`` (one of :data:`ENGINES`); a clear error naming the extra when it is missing."""
    if name not in ENGINES:
        raise QuicEngineError(f"unknown QUIC engine {name!r}: choose from {', '.join(ENGINES)}")
    try:
        modules = {module: importlib.import_module(f"{name}.{module}") for module in _LAYOUT}
    except ImportError as exc:
        hint = _EXTRAS.get(name, f"pip install {name}")
        raise QuicEngineError(f"QUIC engine {name!r} is not installed ({exc}); install it with: {hint}") from exc
    names = {attr: getattr(modules[module], attr) for module, attrs in _LAYOUT.items() for attr in attrs}
    names["H3_ALPN"] = tuple(names["H3_ALPN"])
    return QuicEngine(name=name, configuration_defaults=_CONFIGURATION_DEFAULTS.get(name, ()), **names)
