"""Where a process's peer secret comes from, and how a new one replaces it without dropping anything.

Every edgepath process that listens for peers or connects to them (slot servers, agents, edges reaching an agent
process or a quota ledger, ``edgepath probe``) proves it holds the peer secret and asks its peers to prove the same
(:mod:`edgepath.transports.peer_auth`).  The secret is read from ``--peer-secret-file FILE`` (a Kubernetes Secret
mounted as a file, say) or the file :data:`PEER_SECRET_FILE_ENV` names, else from the environment variable
:data:`PEER_SECRET_ENV`; its bytes are the secret (a
trailing newline is not part of it), at least 32 of them.  ``edgepath serve`` makes a fresh one for the children it
starts when it is given none (:func:`own_secret_file`).

Rotation: a file is read again every :data:`POLL_INTERVAL` seconds; when it holds another secret, that one is the
current secret of every endpoint of the process at once, and the one before is still accepted for
``--peer-secret-grace`` seconds -- long enough for the file to change on every machine (a Kubernetes Secret reaches
its pods within a minute or two).  Connections already set up are not touched: a secret is checked when a peer
connects, never after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from edgepath.transports.peer_auth import PeerKeys, check_secret

log = logging.getLogger("edgepath.peer_secret")

#: the environment variable that names the peer secret's file when ``--peer-secret-file`` is not given (so every
#: command of a container -- its probes too -- finds the mounted Secret without a flag)
PEER_SECRET_FILE_ENV = "EDGEPATH_PEER_SECRET_FILE"
#: the environment variable that holds the peer secret itself when no file is named (read once: no rotation)
PEER_SECRET_ENV = "EDGEPATH_PEER_SECRET"
#: seconds between reads of a peer secret file (a changed secret is taken within this)
POLL_INTERVAL = 1.0
#: seconds the previous secret is still accepted after the file changed
DEFAULT_GRACE = 300.0
#: how to make a secret, said wherever one is missing
HOW_TO_MAKE = "python3 -c 'import secrets; print(secrets.token_hex(32))' > FILE"


class PeerSecretMissing(ValueError):
    """No peer secret was given where one is needed; the message says how to give one."""


def read_secret(path: str) -> bytes:
    """The secret a file holds (without a trailing newline); ValueError naming the file and what is wrong."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"--peer-secret-file {path}: cannot read it ({exc.strerror or exc})") from None
    return check_secret(data.rstrip(b"\r\n"), f"--peer-secret-file {path}")


_loaded: dict[tuple[str | None, str | None], PeerKeys] = {}
_lock = threading.Lock()


def peer_keys(
    secret_file: str | None, grace: float = DEFAULT_GRACE, environ: Mapping[str, str] | None = None
) -> PeerKeys:
    """The process's peer keys from ``secret_file`` (watched for a new secret: see the module's docstring), else
    from the file :data:`PEER_SECRET_FILE_ENV` names, else from :data:`PEER_SECRET_ENV`; the same object for the
    same source, so a rotation reaches every endpoint of the process.  :class:`PeerSecretMissing` when none is
    given, ValueError when the secret cannot be used."""
    environ = os.environ if environ is None else environ
    secret_file = secret_file or environ.get(PEER_SECRET_FILE_ENV) or None
    env = environ.get(PEER_SECRET_ENV)
    source = (secret_file, None if secret_file else env)
    with _lock:
        keys = _loaded.get(source)
        if keys is not None:
            return keys
        if secret_file is not None:
            keys = PeerKeys(read_secret(secret_file), f"--peer-secret-file {secret_file}")
            _watch(keys, secret_file, grace)
        elif env:
            keys = PeerKeys(env.encode(), f"${PEER_SECRET_ENV}")
        else:
            raise PeerSecretMissing(
                f"no peer secret: give --peer-secret-file FILE (or ${PEER_SECRET_FILE_ENV}) or set {PEER_SECRET_ENV} "
                "-- the same on every slot server, agent and edge that connect to each other (make one with: "
                f"{HOW_TO_MAKE})"
            )
        _loaded[source] = keys
        return keys


def fresh_keys(why: str) -> PeerKeys:
    """Keys of a secret made now, for peers that all live in this process (``why`` names them)."""
    return PeerKeys(secrets.token_hex(32).encode(), why)


def secret_given(secret_file: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a peer secret is given (a file, or the environment)."""
    environ = os.environ if environ is None else environ
    return bool(secret_file or environ.get(PEER_SECRET_FILE_ENV) or environ.get(PEER_SECRET_ENV))


def own_secret_file(path: Path) -> Path:
    """A fresh secret in a new file at ``path``, readable by this user only (0600): what ``serve`` gives the
    children it starts when it was given none (their command lines name the file, never the secret)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # an earlier run's
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32) + "\n")
    return path


def _watch(keys: PeerKeys, path: str, grace: float) -> None:
    """Read ``path`` every :data:`POLL_INTERVAL` seconds on a daemon thread; a new secret there rotates ``keys``.  A
    file that cannot be read (or holds no usable secret) is one error line per problem, and the secrets in use
    stay."""

    def poll() -> None:
        problem = ""
        while True:
            time.sleep(POLL_INTERVAL)
            try:
                secret = read_secret(path)
            except ValueError as exc:
                if str(exc) != problem:
                    log.error("%s; keeping the peer secret in use", exc)
                    problem = str(exc)
                continue
            problem = ""
            if keys.rotate(secret, time.monotonic(), grace):
                log.info(
                    "peer secret replaced from %s: new connections use the new one; the previous one is still "
                    "accepted for %g s",
                    path,
                    grace,
                )

    threading.Thread(target=poll, name="peer-secret-watch", daemon=True).start()
