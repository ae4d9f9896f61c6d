"""A loopback peer written with the standard library alone, as the attacker of issue 50 wrote one: it speaks the
socket hello itself, so a test can send what edgepath never would (the protocol before the peer-secret handshake,
descriptors of memory that is not sealed) and look at what comes back (descriptors, exports)."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from edgepath.transports.peer_auth import ConnectorHandshake, PeerKeys

CQ_CAPACITY = 1024
#: bytes of a completion queue of CQ_CAPACITY entries (native/edgepath_core.c: ep_cq_size)
_MAX = 1 << 16


def _exchange(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    socket.send_fds(sock, [json.dumps(message).encode()], fds)
    data, got, _flags, _addr = socket.recv_fds(sock, _MAX, 64)
    return (json.loads(data) if data else {}), list(got)


def _connected(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10.0)
    sock.connect(address)
    return sock


def _cq_fds(size: int, sealed: bool) -> list[int]:
    """A completion queue's memfd (sealed or not) and an eventfd, as a peer sends them."""
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0)
    mem = os.memfd_create("raw-peer-cq", flags)
    os.ftruncate(mem, size)
    if sealed:
        import fcntl

        fcntl.fcntl(mem, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return [mem, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)]


def speak_v1_hello(address: str) -> tuple[dict[str, Any], list[int]]:
    """The hello of the loopback protocol before the handshake (version 1: this side's CQ and exports at once): what
    the listener answers, and the descriptors that came with the answer (the caller closes them)."""
    with _connected(address) as sock:
        fds = _cq_fds(1 << 20, sealed=False)
        hello = {"version": 1, "conn_id": 1, "cq_capacity": CQ_CAPACITY, "exports": [], "info": {}}
        try:
            return _exchange(sock, hello, fds)
        finally:
            for fd in fds:
                os.close(fd)


def handshake(
    address: str,
    keys: PeerKeys,
    cq_size: int,
    exports: list[tuple[dict[str, Any], int]],
    info: dict[str, Any],
    sealed: bool = True,
) -> tuple[dict[str, Any], list[int]]:
    """The version 2 hello with the handshake done right (``keys``), then this side's CQ (a memfd of ``cq_size``
    bytes, ``sealed`` or not), ``exports`` (descriptions and their descriptors, sent as they are) and ``info``: the
    listener's last answer and its descriptors (the caller closes them)."""
    with _connected(address) as sock:
        core = ConnectorHandshake(keys, 0.0)
        answer, got = _exchange(sock, {"version": 2, "opening": core.opening().hex()}, [])
        assert got == [], "descriptors came with the answer"
        proof = core.proof(bytes.fromhex(answer["answer"]))
        fds = _cq_fds(cq_size, sealed)
        hello = {
            "version": 2,
            "proof": proof.hex(),
            "conn_id": 1,
            "cq_capacity": CQ_CAPACITY,
            "exports": [desc for desc, _ in exports],
            "info": info,
        }
        try:
            return _exchange(sock, hello, [*fds, *(fd for _, fd in exports)])
        finally:
            for fd in fds:
                os.close(fd)
