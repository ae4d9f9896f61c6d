"""The QUIC floor: a bare HTTP/3 server (aioquic or qh3) that answers every request with one fixed response.

No parsing, no tokenizer, no data path: what the QUIC engine alone costs per request on this machine.
``edgepath bench ingress`` compares ``edgepath serve`` on each engine against the same engine's floor.
Run: ``python -m edgepath.bench.h3_floor --engine qh3 --port 4434 --certificate CERT --private-key KEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from functools import partial
from typing import Any, ClassVar

from edgepath.edge.adapters.quic_engine import DEFAULT_ENGINE, ENGINES, QuicEngine, load_engine


def fixed_response(size: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Headers and a JSON body of ``size`` bytes (the benchmark matches the edge's response size)."""
    body = b'{"pad":"' + b"x" * max(size - 10, 0) + b'"}'
    return [
        (b":status", b"200"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ], body


class FloorProtocol:
    """One connection; mixed into the engine's ``QuicConnectionProtocol`` by :func:`floor_protocol`."""

    engine: ClassVar[QuicEngine]

    def __init__(self, *args: Any, response: tuple[list[tuple[bytes, bytes]], bytes], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._h3: Any = None
        self._headers, self._body = response

    def quic_event_received(self, event: Any) -> None:
        if isinstance(event, self.engine.ProtocolNegotiated) and event.alpn_protocol in self.engine.H3_ALPN:
            self._h3 = self.engine.H3Connection(self._quic)  # type: ignore[attr-defined]
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._answer(h3_event)

    def _answer(self, event: Any) -> None:
        done = isinstance(event, self.engine.HeadersReceived | self.engine.DataReceived) and event.stream_ended
        if done and self._h3 is not None:
            self._h3.send_headers(event.stream_id, self._headers)
            self._h3.send_data(event.stream_id, self._body, end_stream=True)


def floor_protocol(engine: QuicEngine) -> type:
    return type(f"FloorProtocol_{engine.name}", (FloorProtocol, engine.QuicConnectionProtocol), {"engine": engine})


async def main(port: int, certificate: str, private_key: str, body_bytes: int, engine_name: str) -> None:
    engine = load_engine(engine_name)
    config = engine.configuration(is_client=False)
    config.load_cert_chain(certificate, private_key)
    server = await engine.serve(
        "127.0.0.1",
        port,
        configuration=config,
        create_protocol=partial(floor_protocol(engine), response=fixed_response(body_bytes)),
    )
    print(f"ready https://127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=4434)
    parser.add_argument("--certificate", required=True)
    parser.add_argument("--private-key", required=True)
    parser.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE, help="QUIC engine")
    parser.add_argument("--body-bytes", type=int, default=64, help="size of the fixed response body")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(args.port, args.certificate, args.private_key, args.body_bytes, args.engine))
