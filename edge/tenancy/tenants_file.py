"""The tenants file (``--tenants-file PATH``, TOML): API keys, as SHA-256 digests, mapped to named tenants with
their limits.  Sans I/O but for :func:`read_tenants`; every mistake is one :class:`TenantsFileError` line naming
the file, the entry and what is allowed.

::

    [tenants.acme]
    keys = ["sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"]  # printf %s KEY | sha256sum
    slot_floor = 2              # slots it can always have: lent out when idle, taken back (docs/TENANTS.md)
    slot_cap = 6                # requests in flight at once at this edge (0: no cap)
    tokens_per_minute = 20000   # prompt + max_tokens reserved at admission (0: no quota)
    tokens_per_day = 1000000
    requests_per_minute = 600   # one request reserved at admission (0: no quota)
    requests_per_day = 100000
    share_prefix = false        # true: share one public prefix-cache namespace with the other tenants that opt in
    read_shared_prefix = false  # true: read that namespace (a public system prompt); its own prompts stay its own
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from edgepath.contract.wire import QUOTA_MAX
from edgepath.edge.tenancy.tenants import Tenant, with_floor_ids

#: a tenant's name: a metric label and a usage-log field, so short and plain
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DIGEST = re.compile(r"(?:sha256:)?([0-9a-fA-F]{64})")
SLOTS = ("slot_floor", "slot_cap")
QUOTAS = ("tokens_per_minute", "tokens_per_day", "requests_per_minute", "requests_per_day")
LIMITS = (*SLOTS, *QUOTAS)
SWITCHES = ("share_prefix", "read_shared_prefix")
FIELDS = ("keys", *LIMITS, *SWITCHES)
LIMIT_MAX = 2**53  # integers beyond are no quota anyone means (and stay exact in JSON)


class TenantsFileError(ValueError):
    """A tenants file that cannot be used: the message names the file, the entry and what is allowed."""


def read_tenants(path: str) -> list[tuple[bytes, Tenant]]:
    """Every key digest of the tenants file at ``path`` with its tenant."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8"
        raise TenantsFileError(f"tenants file {path}: cannot read it: {why}") from None
    return parse_tenants(text, path)


def parse_tenants(text: str, path: str = "<tenants>") -> list[tuple[bytes, Tenant]]:
    """The tenants file's content: each key's SHA-256 digest with its tenant, in the file's order."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"tenants file {path}: not valid TOML: {exc}") from None
    extra = sorted(set(doc) - {"tenants"})
    if extra:
        raise TenantsFileError(f"tenants file {path}: unknown top-level key(s) {extra}; allowed: [tenants.NAME] tables")
    tenants = doc.get("tenants")
    if not isinstance(tenants, dict) or not tenants:
        raise TenantsFileError(f"tenants file {path}: no tenant; add at least one [tenants.NAME] table with its keys")
    owner: dict[bytes, str] = {}
    out: list[tuple[bytes, Tenant]] = []
    for name, entry in tenants.items():
        where = f"tenants file {path}: tenant {name!r}"
        if not NAME.fullmatch(name):
            raise TenantsFileError(f"{where}: a name is 1 to 64 of A-Z a-z 0-9 _ . -")
        if not isinstance(entry, dict):
            raise TenantsFileError(f"{where}: must be a table ([tenants.{name}]) of {', '.join(FIELDS)}")
        tenant = _tenant(name, entry, where)
        for digest in _digests(entry, where):
            if digest in owner:
                raise TenantsFileError(f"{where}: key sha256:{digest.hex()} is also tenant {owner[digest]!r}'s")
            owner[digest] = name
            out.append((digest, tenant))
    try:
        return with_floor_ids(out)
    except ValueError as exc:
        raise TenantsFileError(f"tenants file {path}: {exc}") from None


def _tenant(name: str, entry: dict[str, Any], where: str) -> Tenant:
    unknown = sorted(set(entry) - set(FIELDS))
    if unknown:
        raise TenantsFileError(f"{where}: unknown field(s) {unknown}; allowed: {', '.join(FIELDS)}")
    limits: dict[str, int] = {}
    for field in LIMITS:
        value, most = entry.get(field, 0), QUOTA_MAX if field in QUOTAS else LIMIT_MAX
        if type(value) is not int or not 0 <= value <= most:
            raise TenantsFileError(f"{where}: {field!r} must be an integer in 0..{most} (0: none), got {value!r}")
        limits[field] = value
    if limits["slot_cap"] and limits["slot_floor"] > limits["slot_cap"]:
        raise TenantsFileError(
            f"{where}: 'slot_floor' ({limits['slot_floor']}) must not exceed 'slot_cap' ({limits['slot_cap']})"
        )
    switches: dict[str, bool] = {}
    for field in SWITCHES:
        value = entry.get(field, False)
        if not isinstance(value, bool):
            raise TenantsFileError(f"{where}: {field!r} must be true or false, got {value!r}")
        switches[field] = value
    if switches["share_prefix"] and switches["read_shared_prefix"]:
        raise TenantsFileError(
            f"{where}: 'share_prefix' already reads the shared prefix (and writes it); 'read_shared_prefix' reads it "
            "only: give one of them"
        )
    share, read = switches["share_prefix"], switches["read_shared_prefix"]
    return Tenant(name, b"tenant:" + name.encode(), share_prefix=share, read_shared_prefix=read, **limits)


def _digests(entry: dict[str, Any], where: str) -> list[bytes]:
    keys = entry.get("keys")
    if not isinstance(keys, list) or not keys:
        raise TenantsFileError(
            f"{where}: 'keys' must be a non-empty list of SHA-256 digests of its API keys "
            "('sha256:' and 64 hex digits: printf %s KEY | sha256sum)"
        )
    digests = []
    for key in keys:
        match = DIGEST.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            shown = f"a string of {len(key)} characters" if isinstance(key, str) else type(key).__name__
            raise TenantsFileError(  # a key written in by mistake is never echoed into a log
                f"{where}: a key must be a SHA-256 digest, 'sha256:' and 64 hex digits (printf %s KEY | sha256sum), "
                f"never the key itself; got {shown}"
            )
        digests.append(bytes.fromhex(match.group(1)))
    return digests
