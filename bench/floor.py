"""The QUIC floor: a bare aioquic HTTP/3 server that answers every request with a fixed response.

What edgepath's edge adds is measured against this: same QUIC stack, same client, no parsing,
tokenizing or data path.  ``python -m edgepath.bench.floor --port 4434 --certificate C --private-key K``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys

from aioquic.asyncio import serve
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ProtocolNegotiated, QuicEvent

FIXED = json.dumps({"tokens": list(range(128)), "count": 128}).encode()


class FloorProtocol(QuicConnectionProtocol):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._http: H3Connection | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated):
            self._http = H3Connection(self._quic)
        if self._http is None:
            return
        for ev in self._http.handle_event(event):
            if isinstance(ev, HeadersReceived | DataReceived) and ev.stream_ended:
                self._http.send_headers(
                    ev.stream_id,
                    [
                        (b":status", b"200"),
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(FIXED)).encode()),
                    ],
                )
                self._http.send_data(ev.stream_id, FIXED, end_stream=True)
        self.transmit()


async def main_async(host: str, port: int, certificate: str, private_key: str) -> None:
    config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536)
    config.load_cert_chain(certificate, private_key)
    await serve(host, port, configuration=config, create_protocol=FloorProtocol)
    print(f"ready h3://{host}:{port}", flush=True)
    await asyncio.Future()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4434)
    parser.add_argument("--certificate", required=True)
    parser.add_argument("--private-key", required=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main_async(args.host, args.port, args.certificate, args.private_key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
