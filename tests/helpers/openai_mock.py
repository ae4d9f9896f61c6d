"""An ``openai`` client whose every request is answered with fixed bytes: what the SDK makes of edgepath's
bodies and streams, without a server."""

from __future__ import annotations

from typing import Any

import pytest


def client_answering(
    status: int, body: bytes, content_type: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> Any:
    """An ``openai.OpenAI`` that gets ``status``, ``body`` (of ``content_type``) and ``headers`` for any request."""
    openai = pytest.importorskip("openai")
    # The HTTP library the installed openai is built on (httpx, or httpx2 in recent releases).
    base = pytest.importorskip("openai._base_client")
    httpx = getattr(base, "httpx2", None) or base.httpx

    def handler(request: Any) -> Any:
        hdrs = [(b"content-type", content_type), *(headers or [])]
        return httpx.Response(status, headers=hdrs, content=body)

    return openai.OpenAI(
        api_key="k",
        base_url="http://edgepath.test/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
