"""Choosing a transport by name, loudly: no silent fallback from one to another."""

from __future__ import annotations

from typing import Any

from edgepath.dma.transport import Transport, TransportUnavailable

NAMES = ("loopback", "verbs")


def make_transport(name: str, **options: Any) -> Transport:
    """A transport endpoint; raises TransportUnavailable naming the alternative when it cannot be had."""
    if name == "loopback":
        from edgepath.dma.loopback import LoopbackTransport

        return LoopbackTransport(**options)
    if name == "verbs":
        try:
            from edgepath.dma.verbs import VerbsTransport
        except ImportError as exc:
            raise TransportUnavailable(
                f"verbs transport: not available in this build ({exc}); use --transport loopback"
            ) from exc
        return VerbsTransport(**options)
    raise ValueError(f"unknown transport {name!r}: choose one of {', '.join(NAMES)}")
