"""Peers prove they belong: a challenge-response on a shared secret, both ways, before anything is exported.

Every listener (slot server, agent process, quota ledger home) and every connector speaks the same three messages,
whatever carries them (a Unix socket on loopback, rdma_cm private data and the hello regions on verbs):

1. connector -> listener (:class:`ConnectorHandshake`, ``opening``): a fresh nonce ``Nc`` and the ids of the
   secrets the connector holds (its current one first, and the previous one while a rotation's grace lasts);
2. listener -> connector (:class:`ListenerHandshake`, ``answer``): a fresh nonce ``Nl``, the id of the secret it
   chose (the first of the connector's it holds too: none is a refusal), and its proof
   ``HMAC-SHA256(secret, "edgepath peer v1" | "listener" | Nc | Nl | id)``;
3. connector -> listener (``proof``, only once the listener's proof checked out): its own proof, the same MAC
   under the role ``"connector"``.

Neither side describes a region before it has checked the other's proof: the listener sends its exports only after
message 3 checked out, and the connector sends its own (with message 3) only after message 2 did.  Both nonces are
in both proofs, so a recorded transcript proves nothing in another connection, and the roles are, so a listener's
proof cannot be reflected back to it as a connector's.  MACs are compared with :func:`hmac.compare_digest`.

A secret's *id* (the first 8 bytes of ``HMAC(secret, "edgepath peer secret id")``) names it without saying it, so
two sides in the middle of a rotation find the secret they share.  :class:`PeerKeys` holds what one process
accepts: the current secret, and the previous one until its grace period ends.

What this does not do: encrypt or sign the data path (RDMA has no such layer; a machine on the path sees what
crosses it), or stop a relay by a machine both sides were pointed at (there is no channel binding).  Sans-I/O:
bytes in, bytes out, the time passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from dataclasses import dataclass

from edgepath.transports.base import TransportError

#: the least a secret may hold: 32 bytes (256 bits, SHA-256's block of security)
SECRET_MIN_BYTES = 32
NONCE_BYTES = 16
KEY_ID_BYTES = 8
MAC_BYTES = 32
#: seconds a listener gives a peer to finish the handshake before it is dropped (a stalled peer holds one worker)
HANDSHAKE_TIMEOUT = 10.0

_LABEL = b"edgepath peer v1\0"
_ID_LABEL = b"edgepath peer secret id"
_LISTENER, _CONNECTOR = b"listener\0", b"connector\0"

#: message 1: Nc, then two secret ids (the second all zero when the connector holds one)
OPENING = struct.Struct(f"<{NONCE_BYTES}s{KEY_ID_BYTES}s{KEY_ID_BYTES}s")
#: message 2: Nl, the chosen secret id, the listener's proof
ANSWER = struct.Struct(f"<{NONCE_BYTES}s{KEY_ID_BYTES}s{MAC_BYTES}s")
#: message 3: the connector's proof
PROOF = struct.Struct(f"<{MAC_BYTES}s")
_NO_ID = bytes(KEY_ID_BYTES)


class PeerRefused(TransportError):
    """A peer did not prove it holds the peer secret, or this side could not prove it to the peer; ``reason`` says
    which in a few words (never the secret), for the log line and the refusal counter."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


#: the reasons a listener counts refusals by (``PeerRefused.reason``)
UNKNOWN_SECRET = "no secret in common"
BAD_PROOF = "wrong proof"
MALFORMED = "malformed handshake"
NO_HANDSHAKE = "no handshake"
TIMED_OUT = "handshake timed out"
TOO_MANY = "too many handshakes under way"


def secret_id(secret: bytes) -> bytes:
    """What names ``secret`` in a handshake without saying it."""
    return hmac.new(secret, _ID_LABEL, hashlib.sha256).digest()[:KEY_ID_BYTES]


def check_secret(secret: bytes, source: str) -> bytes:
    """``secret`` if it is long enough; ValueError naming ``source`` and what is allowed."""
    if len(secret) < SECRET_MIN_BYTES:
        raise ValueError(
            f"{source}: a peer secret of {len(secret)} bytes; it must hold at least {SECRET_MIN_BYTES} "
            "(make one with: python3 -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return secret


@dataclass(frozen=True)
class _Held:
    current: bytes
    previous: bytes | None = None
    previous_until: float = 0.0


class PeerKeys:
    """The secrets a process accepts: ``current``, and after :meth:`rotate` the one before it until its grace ends.
    Shared by every transport endpoint of the process (a rotation reaches them all); safe across threads."""

    def __init__(self, secret: bytes, source: str = "peer secret") -> None:
        self._held = _Held(check_secret(secret, source))
        self._lock = threading.Lock()
        self.source = source

    def rotate(self, secret: bytes, now: float, grace: float) -> bool:
        """Make ``secret`` the current one; the one it replaces is accepted ``grace`` seconds more.  False (nothing
        changes) when it is the current one already."""
        check_secret(secret, self.source)
        with self._lock:
            held = self._held
            if hmac.compare_digest(secret, held.current):
                return False
            self._held = _Held(secret, held.current, now + grace)
        return True

    def accepted(self, now: float) -> list[bytes]:
        """The secrets accepted at ``now``, the current one first."""
        held = self._held
        if held.previous is not None and now < held.previous_until:
            return [held.current, held.previous]
        return [held.current]

    def find(self, ids: list[bytes], now: float) -> tuple[bytes, bytes] | None:
        """The first of ``ids`` that names a secret accepted at ``now``: (its id, the secret); None if none does."""
        mine = {secret_id(secret): secret for secret in self.accepted(now)}
        for wanted in ids:
            for known, secret in mine.items():
                if hmac.compare_digest(wanted, known):
                    return known, secret
        return None


def _mac(secret: bytes, role: bytes, nonce_c: bytes, nonce_l: bytes, key: bytes) -> bytes:
    return hmac.new(secret, _LABEL + role + nonce_c + nonce_l + key, hashlib.sha256).digest()


def _unpack(layout: struct.Struct, message: bytes, what: str) -> tuple[bytes, ...]:
    if len(message) != layout.size:
        raise PeerRefused(MALFORMED, f"{what} of {len(message)} bytes, expected {layout.size}")
    return layout.unpack(message)


class ConnectorHandshake:
    """The connecting side: :meth:`opening`, then :meth:`proof` of the listener's answer (which checks it first)."""

    def __init__(self, keys: PeerKeys, now: float, nonce: bytes | None = None) -> None:
        self._keys = keys
        self._now = now
        self._nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        offered = [secret_id(secret) for secret in keys.accepted(now)]
        self._offered = offered

    def opening(self) -> bytes:
        """Message 1."""
        ids = [*self._offered, _NO_ID][:2]
        return OPENING.pack(self._nonce, *ids)

    def proof(self, answer: bytes) -> bytes:
        """Message 3, once ``answer`` (message 2) proved that the listener holds a secret this side offered;
        :class:`PeerRefused` otherwise."""
        nonce_l, key, mac = _unpack(ANSWER, answer, "listener's answer")
        found = self._keys.find([key], self._now)
        if found is None or key not in self._offered:
            raise PeerRefused(UNKNOWN_SECRET, "the listener chose a secret this side did not offer")
        _, secret = found
        if not hmac.compare_digest(mac, _mac(secret, _LISTENER, self._nonce, nonce_l, key)):
            raise PeerRefused(BAD_PROOF, "the listener's proof does not check out: it does not hold the peer secret")
        return PROOF.pack(_mac(secret, _CONNECTOR, self._nonce, nonce_l, key))


class ListenerHandshake:
    """The listening side: :meth:`answer` the connector's opening, then :meth:`verify` its proof."""

    def __init__(self, keys: PeerKeys, now: float, nonce: bytes | None = None) -> None:
        self._keys = keys
        self._now = now
        self._nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        self._expected: bytes | None = None

    def answer(self, opening: bytes) -> bytes:
        """Message 2; :class:`PeerRefused` when the connector offers no secret this side accepts."""
        nonce_c, first, second = _unpack(OPENING, opening, "connector's opening")
        ids = [first] if second == _NO_ID else [first, second]
        found = self._keys.find(ids, self._now)
        if found is None:
            raise PeerRefused(UNKNOWN_SECRET, "the peer offers no peer secret this side accepts")
        key, secret = found
        self._expected = _mac(secret, _CONNECTOR, nonce_c, self._nonce, key)
        return ANSWER.pack(self._nonce, key, _mac(secret, _LISTENER, nonce_c, self._nonce, key))

    def verify(self, proof: bytes) -> None:
        """Return when ``proof`` (message 3) is the connector's for this very exchange; :class:`PeerRefused` else."""
        (mac,) = _unpack(PROOF, proof, "connector's proof")
        if self._expected is None:
            raise PeerRefused(MALFORMED, "a proof before the opening")
        if not hmac.compare_digest(mac, self._expected):
            raise PeerRefused(BAD_PROOF, "the peer's proof does not check out (a wrong secret, or a replayed one)")
