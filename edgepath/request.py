"""``edgepath request``: one request to an edge over HTTP/3, then the answer and where the time went."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

from edgepath.config import RequestSettings
from edgepath.edge.client import h3_client
from edgepath.edge.tls import default_certificate


async def request(settings: RequestSettings) -> int:
    """Send ``settings.prompt``; print the status, the answer and the server's timings; 0 for a 200."""
    logging.getLogger("quic").setLevel(logging.WARNING)
    host, port = settings.host, settings.port
    cafile = settings.cacert
    if cafile is None and not settings.insecure and default_certificate().is_file():
        cafile = str(default_certificate())
    server_name = "localhost" if host in ("127.0.0.1", "::1") else host
    api_key = settings.api_key or os.environ.get("EDGEPATH_API_KEY")
    try:
        async with (
            asyncio.timeout(settings.timeout),
            h3_client(host, port, cafile, settings.insecure, server_name, api_key) as c,
        ):
            if settings.tokenize:
                response = await c.request("POST", "/v1/tokenize", {"prompt": settings.prompt})
            else:
                response = await c.generate(settings.prompt, settings.max_tokens, settings.stream)
    except (ConnectionError, OSError, TimeoutError) as exc:
        reason = str(exc) or f"no answer within {settings.timeout:g} s"
        print(f"edgepath request: cannot reach https://{host}:{port}: {reason}", file=sys.stderr)
        return 2
    print(f"HTTP/3 {response.status}")
    if settings.stream and response.status == 200:
        print(response.body.decode(), end="")
    else:
        print(json.dumps(response.json(), indent=2, ensure_ascii=False))
    timings = response.timings()
    if timings:
        print("server timing (ms): " + "  ".join(f"{k} {v:.3f}" for k, v in timings.items()))
    print(f"queue time: {response.headers.get('x-queue-time', '?')}")
    return 0 if response.status == 200 else 1
