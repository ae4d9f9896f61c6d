"""Optional API keys: ``x-api-key: KEY`` or ``Authorization: Bearer KEY`` (sans-I/O; no files read here
except by :func:`load_keys`).

Keys are held as SHA-256 digests and compared with ``hmac.compare_digest`` against every key, so
neither a key's length nor which key nearly matched shows in the timing.  Each key stands for a tenant
(:mod:`edgepath.edge.tenancy.tenants`): with a flat list, a tenant of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from edgepath.edge.tenancy.tenants import Tenant, key_tenant
from edgepath.edge.tenancy.tenants_file import TenantsFileError, read_tenants

ENV_VAR = "EDGEPATH_API_KEYS"


class ApiKeys:
    """The accepted keys (each key's tenant), and whether ``/health`` and ``/metrics`` need one too."""

    def __init__(self, keys: Iterable[str], protect_ops: bool = False) -> None:
        self._tenants = _flat_pairs(keys)
        if not self._tenants:
            raise ValueError("API keys are enabled but none was given (empty file or variable)")
        self.protect_ops = protect_ops

    @classmethod
    def of_digests(cls, tenants: Iterable[tuple[bytes, Tenant]], protect_ops: bool = False) -> ApiKeys:
        """Keys given as SHA-256 digests, each with its tenant (a tenants file)."""
        keys = cls.__new__(cls)
        keys._tenants = list(tenants)
        keys.protect_ops = protect_ops
        if not keys._tenants:
            raise ValueError("API keys are enabled but none was given (no key in the tenants file)")
        return keys

    @property
    def tenants(self) -> list[Tenant]:
        """Every tenant a key stands for, each once, in the order first given."""
        seen: dict[str, Tenant] = {}
        for _, tenant in self._tenants:
            seen.setdefault(tenant.name, tenant)
        return list(seen.values())

    def identify(self, presented: bytes | None) -> Tenant | None:
        """The tenant of the key ``presented`` (None: missing or not valid); every known key is compared."""
        if not presented:
            return None
        digest = hashlib.sha256(presented).digest()
        found = None
        for known, tenant in self._tenants:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def allows(self, presented: bytes | None) -> bool:
        return self.identify(presented) is not None

    @staticmethod
    def presented(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
        """The key a request carries, if any."""
        for name, value in headers:
            lname = name.lower()
            if lname == b"x-api-key":
                return value.strip()
            if lname == b"authorization" and value[:7].lower() == b"bearer ":
                return value[7:].strip()
        return None


def load_keys(
    path: str | None,
    protect_ops: bool = False,
    environ: dict[str, str] | None = None,
    tenants_file: str | None = None,
) -> ApiKeys | None:
    """Keys from ``path`` (one per line, ``#`` comments) and/or ``$EDGEPATH_API_KEYS`` (comma-separated), each a
    tenant of its own, and those of ``tenants_file`` (:mod:`edgepath.edge.tenancy.tenants_file`) with their
    tenants; None when none is set (no authentication)."""
    env = (os.environ if environ is None else environ).get(ENV_VAR)
    if path is None and env is None and tenants_file is None:
        if protect_ops:
            raise ValueError(
                "--protect-ops needs API keys: give --api-keys-file or --tenants-file, or set EDGEPATH_API_KEYS"
            )
        return None
    if tenants_file is not None:
        named = read_tenants(tenants_file)
        flat = _flat_pairs(_flat_keys(path, env))
        clash = {digest for digest, _ in named} & {digest for digest, _ in flat}
        if clash:
            raise TenantsFileError(
                f"tenants file {tenants_file}: key sha256:{min(clash).hex()} is also in the flat key list "
                "(--api-keys-file or $EDGEPATH_API_KEYS); a key stands for one tenant"
            )
        return ApiKeys.of_digests([*named, *flat], protect_ops)
    return ApiKeys(_flat_keys(path, env), protect_ops)


def _flat_pairs(keys: Iterable[str]) -> list[tuple[bytes, Tenant]]:
    """Each key of a flat list, as its digest and its own tenant, named by its place in the list (a key given twice
    is the first)."""
    digests = dict.fromkeys(hashlib.sha256(k.encode()).digest() for k in keys if k)
    return [(digest, key_tenant(digest, ordinal)) for ordinal, digest in enumerate(digests, start=1)]


def _flat_keys(path: str | None, env: str | None) -> list[str]:
    keys: list[str] = []
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read API keys from {path}: {exc.strerror}") from exc
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if env is not None:
        keys += [k.strip() for k in env.split(",") if k.strip()]
    return keys
