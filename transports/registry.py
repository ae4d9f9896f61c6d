"""The transport registry: ``--data-path NAME`` -> a transport endpoint.

Apart from the interface (:mod:`edgepath.transports.base`), so the interface never imports its own
implementations; each implementation is imported only when it is asked for (verbs needs pyverbs).
"""

from __future__ import annotations

from typing import Any

from edgepath.transports.base import Transport, TransportUnavailable
from edgepath.transports.peer_auth import PeerKeys

#: The transports :func:`make_transport` knows, as ``--data-path`` names them.
TRANSPORTS = ("loopback", "verbs")


def make_transport(name: str, keys: PeerKeys, **options: Any) -> Transport:
    """A transport endpoint by name whose peers must prove they hold ``keys``' secret; raises TransportUnavailable
    naming the alternative when it cannot be had (never a silent fallback to another transport)."""
    if name == "loopback":
        from edgepath.transports.loopback import LoopbackTransport

        return LoopbackTransport(keys, **options)
    if name == "verbs":
        try:
            from edgepath.transports.verbs import VerbsTransport
        except ImportError as exc:
            raise TransportUnavailable(
                f"verbs transport: not available in this build ({exc}); use --data-path loopback"
            ) from exc
        return VerbsTransport(keys, **options)
    raise ValueError(f"unknown transport {name!r}: choose one of {', '.join(TRANSPORTS)}")
