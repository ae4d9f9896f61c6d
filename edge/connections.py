"""How many client connections an edge keeps, sans I/O: one count for both adapters, in total and per client address.

A connection costs the edge memory and a file descriptor before it sends anything, so connections are a resource
to bound like any other (nginx's ``limit_conn``, Envoy's per-listener connection limit): past ``--max-connections``
in all, or ``--max-connections-per-address`` from one address, a new connection is refused at once -- HTTP/1.1 with
a 503 and ``Retry-After`` and a clean close, HTTP/3 with QUIC's CONNECTION_REFUSED -- and the ones already open go
on.  How long an open one may stay silent is the adapters' (``--body-timeout`` from accept for its first request,
``--idle-timeout`` between requests).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

#: the defaults of ``--max-connections``, ``--max-connections-per-address`` and ``--idle-timeout`` (seconds): well
#: inside the file descriptors a process gets here (20,000), and QUIC's idle timeout as aioquic has it
DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, DEFAULT_IDLE_TIMEOUT = 8192, 1024, 60.0


@dataclass(frozen=True, slots=True)
class ConnectionRefused:
    """Why a connection was refused: ``reason`` for the metrics (``total`` | ``per_address``), ``message`` for it."""

    reason: str
    message: str


class ConnectionLimits:
    """Open connections counted in total and by client address (``per_address`` 0: no cap per address)."""

    def __init__(self, total: int, per_address: int, idle_timeout: float) -> None:
        if total < 1 or per_address < 0:
            raise ValueError(f"connection limits: total must be >= 1 and per address >= 0, got {total}, {per_address}")
        if not idle_timeout > 0:
            raise ValueError(f"the idle timeout must be positive, got {idle_timeout} s")
        self.total = total
        self.per_address = per_address
        self.idle_timeout = idle_timeout
        self.open = 0
        self._by_address: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # refusals by reason, for the metrics

    def admit(self, address: str) -> ConnectionRefused | None:
        """Count a new connection from ``address``, or say why it is refused (then nothing is counted)."""
        if self.open >= self.total:
            refusal = ConnectionRefused("total", f"this edge holds {self.open} connections, its limit")
        elif self.per_address and self._by_address[address] >= self.per_address:
            refusal = ConnectionRefused(
                "per_address", f"{address} holds {self._by_address[address]} connections, the limit per address"
            )
        else:
            self.open += 1
            self._by_address[address] += 1
            return None
        self.refused[refusal.reason] += 1
        return refusal

    def release(self, address: str) -> None:
        """A connection :meth:`admit` counted has closed."""
        left = self._by_address[address] - 1
        if left < 0:
            raise ValueError(f"release of a connection from {address}, which holds none")
        if left:
            self._by_address[address] = left
        else:
            del self._by_address[address]
        self.open -= 1

    def held(self, address: str) -> int:
        """Connections open from ``address``."""
        return self._by_address[address]
