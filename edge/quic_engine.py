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


@cache
def load_engine(name: str = DEFAULT_ENGINE) -> QuicEngine:
    """The engine ``name`` (one of :data:`ENGINES`); a clear error naming the extra when it is missing."""
    if name not in ENGINES:
        raise QuicEngineError(f"unknown QUIC engine {name!r}: choose from {', '.join(ENGINES)}")
    try:
        aio = importlib.import_module(f"{name}.asyncio")
        server = importlib.import_module(f"{name}.asyncio.server")
        h3 = importlib.import_module(f"{name}.h3.connection")
        h3_events = importlib.import_module(f"{name}.h3.events")
        config = importlib.import_module(f"{name}.quic.configuration")
        events = importlib.import_module(f"{name}.quic.events")
    except ImportError as exc:
        hint = _EXTRAS.get(name, f"pip install {name}")
        raise QuicEngineError(f"QUIC engine {name!r} is not installed ({exc}); install it with: {hint}") from exc
    return QuicEngine(
        name=name,
        QuicConnectionProtocol=aio.QuicConnectionProtocol,
        QuicServer=server.QuicServer,
        serve=aio.serve,
        connect=aio.connect,
        QuicConfiguration=config.QuicConfiguration,
        H3Connection=h3.H3Connection,
        H3_ALPN=tuple(h3.H3_ALPN),
        HeadersReceived=h3_events.HeadersReceived,
        DataReceived=h3_events.DataReceived,
        ProtocolNegotiated=events.ProtocolNegotiated,
        StreamReset=events.StreamReset,
        StopSendingReceived=events.StopSendingReceived,
        ConnectionTerminated=events.ConnectionTerminated,
        configuration_defaults=_CONFIGURATION_DEFAULTS.get(name, ()),
    )
