"""The Secrets the one-node and podman overlays need and do not ship (no key is in the repository): fresh random API
keys made at test time, as an operator makes them.

    python tests/containers/make_secrets.py DIR

writes ``DIR/secrets.yaml`` -- Secret ``edgepath-api-keys`` (key ``keys``: one flat key, a tenant of its own),
Secret ``edgepath-tenants`` (key ``tenants.toml``: tenants ``team-a`` and ``team-b`` with quotas, by their keys'
SHA-256 digests) and Secret ``edgepath-peer-secret`` (key ``secret``: what every slot server, edge and ledger
proves it holds, docs/DEPLOY.md "The peer secret") -- and ``DIR/keys.env``, the three keys for a shell to source
(``KEY``, ``KEY_A``, ``KEY_B``); both readable by their owner only.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import yaml

NAMESPACE = "edgepath"
#: the tenants' quotas: team-a by the minute (tokens and requests), team-b by the minute and the day (50 requests a
#: day: one refills every 28.8 minutes, so the container lane can tell a count kept from one forgotten)
TENANTS = {
    "team-a": {"tokens_per_minute": 20000, "requests_per_minute": 600},
    "team-b": {"tokens_per_minute": 20000, "requests_per_day": 50},
}


def tenants_toml(keys: dict[str, str]) -> str:
    """A tenants file (docs/TENANTS.md) of :data:`TENANTS`, each with the digest of its key in ``keys``."""
    lines = ["# made by tests/containers/make_secrets.py: keys by their SHA-256 digests only"]
    for name, limits in TENANTS.items():
        digest = hashlib.sha256(keys[name].encode()).hexdigest()
        lines += ["", f"[tenants.{name}]", f'keys = ["sha256:{digest}"]']
        lines += [f"{field} = {value}" for field, value in limits.items()]
    return "\n".join(lines) + "\n"


def secret(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "type": "Opaque",
        "stringData": data,
    }


def make(directory: Path) -> dict[str, str]:
    """Fresh keys, their Secrets into ``directory``; the keys, by the shell variable each is written as."""
    keys = {name: "ep-" + secrets.token_urlsafe(24) for name in ("flat", *TENANTS)}
    docs = [
        secret("edgepath-api-keys", {"keys": keys["flat"] + "\n"}),
        secret("edgepath-tenants", {"tenants.toml": tenants_toml(keys)}),
        secret("edgepath-peer-secret", {"secret": secrets.token_hex(32)}),
    ]
    variables = {"KEY": keys["flat"], "KEY_A": keys["team-a"], "KEY_B": keys["team-b"]}
    for path, text in (
        (directory / "secrets.yaml", yaml.safe_dump_all(docs, sort_keys=False)),
        (directory / "keys.env", "".join(f"{k}={v}\n" for k, v in variables.items())),
    ):
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            out.write(text)
    return variables


if __name__ == "__main__":
    make(Path(sys.argv[1]))
