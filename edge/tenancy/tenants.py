"""Who a request is, for the prefix cache and for quotas: tenants, sans I/O.

A **tenant** is what an API key stands for.  With a flat key list (``--api-keys-file``, ``$EDGEPATH_API_KEYS``)
each key is a tenant of its own; a tenants file (:mod:`edgepath.edge.tenancy.tenants_file`) maps several keys to one
named tenant with its limits.  Without any keys every request is the one anonymous tenant.

Each tenant has a **cache namespace**: the edge turns it and the request's own ``cache_salt`` (a body field, as
vLLM accepts) into the request header's ``cache_salt`` word (:func:`edgepath.contract.wire.cache_salt`), and the
model side reuses KV -- and the agent places a request by prefix -- only from prefixes written under the same
word.  So one tenant never reads another's KV, nor learns from ``cached_tokens``, ``Server-Timing`` or a faster
first token that another sent the same prompt.  Sharing is opt-in (``share_prefix``): the tenants that opt in
share one public namespace among themselves.  Reading it is a separate opt-in (``read_shared_prefix``): such a
tenant reuses the public namespace's prefixes (a public system prompt) while what it writes stays in its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from edgepath.contract import wire

#: the namespace of tenants that opt in to the shared prefix cache (``share_prefix = true``)
PUBLIC_NAMESPACE = wire.PUBLIC_NAMESPACE


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant: its name (in metrics and the usage log), its cache namespace and its limits (0: none)."""

    name: str
    namespace: bytes
    slot_floor: int = 0
    slot_cap: int = 0
    tokens_per_minute: int = 0
    tokens_per_day: int = 0
    requests_per_minute: int = 0
    requests_per_day: int = 0
    share_prefix: bool = False
    read_shared_prefix: bool = False  # reads the public namespace; what it writes stays in its own
    #: its id in the state words, which floors and caps are counted by (1..255; 0: neither): :func:`with_floor_ids`
    floor_id: int = 0

    @property
    def cache_namespace(self) -> bytes:
        """The namespace its requests' prefixes are written and found under."""
        return PUBLIC_NAMESPACE if self.share_prefix else self.namespace

    def salt(self, cache_salt: str | None) -> int:
        """The request header's ``cache_salt`` for one of its requests with this ``cache_salt`` field."""
        return wire.cache_salt(self.cache_namespace, cache_salt)

    @property
    def cache_flags(self) -> int:
        """The request header flags of its namespace: :data:`~edgepath.contract.wire.FLAG_READ_PUBLIC` for a reader
        of the shared prefix."""
        return wire.FLAG_READ_PUBLIC if self.read_shared_prefix else 0


#: every request when no API key is configured: one namespace, no limits -- the server as it was before tenants
ANONYMOUS = Tenant("anonymous", b"")


def with_floor_ids(pairs: Sequence[tuple[bytes, Tenant]]) -> list[tuple[bytes, Tenant]]:
    """``pairs`` with each tenant that has a slot floor or a slot cap given its id in the state words: 1, 2, ... in the
    order of the tenants' names (so every edge derives the same ids from the same file, whatever the order of its
    tables).  The id is what a claim writes into the slot's state word (ABI 10: 8 bits), from which every agent
    counts what a tenant holds, so at most ``wire.TENANT_MAX`` tenants may have either: ValueError beyond, naming
    the limit."""
    counted = sorted({tenant.name for _, tenant in pairs if tenant.slot_floor or tenant.slot_cap})
    if len(counted) > wire.TENANT_MAX:
        raise ValueError(
            f"{len(counted)} tenants have a slot_floor or a slot_cap; at most {wire.TENANT_MAX} may (a tenant's id is "
            "8 bits of the slot state word)"
        )
    ids = {name: at + 1 for at, name in enumerate(counted)}
    numbered: dict[str, Tenant] = {}  # one tenant object per name, as given: its keys share it
    for _, tenant in pairs:
        numbered.setdefault(tenant.name, replace(tenant, floor_id=ids.get(tenant.name, 0)))
    return [(digest, numbered[tenant.name]) for digest, tenant in pairs]


def key_tenant(digest: bytes, ordinal: int) -> Tenant:
    """The tenant of the ``ordinal``-th key (from 1) of a flat list: a namespace of its own (sharing is never the
    default; the cache keys by the key's digest), named ``key-<ordinal>`` -- never by anything computed from the key
    alone, which a metrics page would turn into an offline guessing oracle (an unsalted digest, or part of one,
    checks a guessed key without asking the edge)."""
    return Tenant(f"key-{ordinal}", b"key:" + digest)
