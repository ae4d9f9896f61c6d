"""Built grammars kept by tenant and schema digest, sans I/O.

A grammar (``response_format``, enforced tool calls) is checked while its request is parsed and built later
(:class:`~edgepath.edge.http.Grammar`): llama.cpp's schema converter is Python that takes milliseconds (13 ms for a
schema of 100 properties here), so it runs on a tokenizer worker, never on the event loop
(:mod:`edgepath.edge.tokenizing`).  A tenant that sends the same schema again -- the common case: one application, one
schema -- finds its words here and pays nothing.  Entries are kept per tenant and never answer another tenant's
request (a hit says nothing about what another tenant sent, and no tenant's schemas can push another's out but by the
bound on them all).  Bounded: each tenant keeps its :attr:`GrammarCache.per_tenant` most recently used grammars and at
most :attr:`GrammarCache.tenant_bytes` of words; all tenants together at most :attr:`GrammarCache.total_bytes`, past
which the tenant holding the most gives up its least recently used.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

#: grammars one tenant keeps, words one tenant keeps, words all tenants keep together
PER_TENANT, TENANT_BYTES, TOTAL_BYTES = 32, 4 << 20, 64 << 20


class GrammarCache:
    """Grammars' words by (tenant, digest); only the event loop's thread reads or changes it."""

    def __init__(
        self, per_tenant: int = PER_TENANT, tenant_bytes: int = TENANT_BYTES, total_bytes: int = TOTAL_BYTES
    ) -> None:
        if per_tenant < 1 or tenant_bytes < 1 or total_bytes < tenant_bytes:
            raise ValueError(
                f"a grammar cache keeps at least 1 grammar and 1 byte per tenant, and in all at least one tenant's "
                f"bytes; got per_tenant={per_tenant}, tenant_bytes={tenant_bytes}, total_bytes={total_bytes}"
            )
        self.per_tenant = per_tenant
        self.tenant_bytes = tenant_bytes
        self.total_bytes = total_bytes
        self._tenants: dict[str, OrderedDict[bytes, np.ndarray]] = {}
        self._bytes: dict[str, int] = {}
        self.size = 0  # bytes of words kept, all tenants
        self.hits = self.misses = 0

    def get(self, tenant: str, digest: bytes) -> np.ndarray | None:
        """``tenant``'s words for the grammar named ``digest`` (now its most recently used), or None: build them."""
        held = self._tenants.get(tenant)
        words = None if held is None else held.get(digest)
        if words is None:
            self.misses += 1
            return None
        assert held is not None
        held.move_to_end(digest)
        self.hits += 1
        return words

    def put(self, tenant: str, digest: bytes, words: np.ndarray) -> None:
        """Keep ``words`` (read-only from now on) for ``tenant``'s requests that name ``digest``; a grammar larger than
        a tenant's bytes is not kept."""
        size = words.nbytes
        if size > self.tenant_bytes:
            return
        words.flags.writeable = False
        held = self._tenants.setdefault(tenant, OrderedDict())
        old = held.pop(digest, None)
        if old is not None:
            self._account(tenant, -old.nbytes)
        held[digest] = words
        self._account(tenant, size)
        while len(held) > self.per_tenant or self._bytes[tenant] > self.tenant_bytes:
            self._evict(tenant)
        while self.size > self.total_bytes:
            self._evict(max(self._bytes, key=self._bytes.__getitem__))

    def held(self, tenant: str) -> int:
        """How many grammars ``tenant`` keeps."""
        return len(self._tenants.get(tenant, ()))

    def _evict(self, tenant: str) -> None:
        """``tenant``'s least recently used grammar goes."""
        held = self._tenants[tenant]
        _, words = held.popitem(last=False)
        self._account(tenant, -words.nbytes)
        if not held:
            del self._tenants[tenant], self._bytes[tenant]

    def _account(self, tenant: str, delta: int) -> None:
        self._bytes[tenant] = self._bytes.get(tenant, 0) + delta
        self.size += delta
