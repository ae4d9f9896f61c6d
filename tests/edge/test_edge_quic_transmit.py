"""When the HTTP/3 adapter transmits: a datagram that completed a request defers its transmit to the
answer (one transmit per request instead of an empty one first), bounded by DEFERRED_TRANSMIT_S."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from edgepath.edge.adapters.quic import DEFERRED_TRANSMIT_S, EdgeProtocol
from edgepath.edge.connections import ConnectionLimits


class _EngineProtocol:
    """The engine's protocol reduced to what the deferral touches: a datagram is processed (which may
    complete a request, or answer one at once) and then transmitted, as the engines' datagram_received does."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transmits = 0

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if data in (b"request", b"request answered at once"):
            self._completed = True  # what EdgeProtocol._h3_event sets when a request is complete
        if data == b"request answered at once":  # a 429, /health: answered while the datagram is processed
            self.schedule_transmit()  # type: ignore[attr-defined]
        self.transmit()

    def transmit(self) -> None:
        self.transmits += 1


class _Protocol(EdgeProtocol, _EngineProtocol):  # type: ignore[misc]
    pass


def _run(body: Any) -> None:
    async def main() -> None:
        await body(_Protocol(service=SimpleNamespace(connections=ConnectionLimits(10, 10, 30.0))))

    asyncio.run(asyncio.wait_for(main(), 30))


async def _until(check: Any) -> None:
    while not check():
        await asyncio.sleep(DEFERRED_TRANSMIT_S / 4)


def test_a_completed_request_transmits_once_with_its_answer() -> None:
    async def body(p: _Protocol) -> None:
        p.datagram_received(b"request", None)
        assert p.transmits == 0  # nothing due yet: the answer will carry what is
        p.schedule_transmit()  # the answer, produced on a later loop iteration
        await _until(lambda: p.transmits)
        await asyncio.sleep(3 * DEFERRED_TRANSMIT_S)
        assert p.transmits == 1 and p._deferred is None  # the deferred transmit was cancelled by the answer

    _run(body)


def test_an_unanswered_request_still_transmits_after_the_deferral() -> None:
    async def body(p: _Protocol) -> None:
        p.datagram_received(b"request", None)
        p.datagram_received(b"request", None)  # a second one does not add a second deferred transmit
        assert p.transmits == 0
        await _until(lambda: p.transmits)
        await asyncio.sleep(3 * DEFERRED_TRANSMIT_S)
        assert p.transmits == 1

    _run(body)


def test_other_datagrams_and_answers_given_at_once_transmit_at_once() -> None:
    async def body(p: _Protocol) -> None:
        p.datagram_received(b"ack", None)
        assert p.transmits == 1
        p.datagram_received(b"request answered at once", None)
        assert p.transmits == 2 and p._deferred is None

    _run(body)
