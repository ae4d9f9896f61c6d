"""The QUIC floor: a bare aioquic HTTP/3 server that answers every request with one fixed response.

No parsing, no tokenizer, no data path: what aioquic alone costs per request on this machine.
``edgepath serve`` is compared against it in the same run (``bench/edge_bench.py``).
Run: ``python -m edgepath.bench.h3_floor --port 4434 --certificate CERT --private-key KEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from functools import partial
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol, serve
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ProtocolNegotiated, QuicEvent


def fixed_response(size: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Headers and a JSON body of ``size`` bytes (the benchmark matches the edge's response size)."""
    body = b'{"pad":"' + b"x" * max(size - 10, 0) + b'"}'
    return [
        (b":status", b"200"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ], body


class FloorProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, response: tuple[list[tuple[bytes, bytes]], bytes], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._h3: H3Connection | None = None
        self._headers, self._body = response

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self._h3 = H3Connection(self._quic)
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._answer(h3_event)

    def _answer(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived | DataReceived) and event.stream_ended and self._h3 is not None:
            self._h3.send_headers(event.stream_id, self._headers)
            self._h3.send_data(event.stream_id, self._body, end_stream=True)


async def main(port: int, certificate: str, private_key: str, body_bytes: int) -> None:
    config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    config.load_cert_chain(certificate, private_key)
    server = await serve(
        "127.0.0.1",
        port,
        configuration=config,
        create_protocol=partial(FloorProtocol, response=fixed_response(body_bytes)),
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
    parser.add_argument("--body-bytes", type=int, default=64, help="size of the fixed response body")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(args.port, args.certificate, args.private_key, args.body_bytes))
