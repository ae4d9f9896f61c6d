"""What a loopback listener does with peers it cannot trust, seen from a peer written with the standard library
alone (tests/helpers/raw_loopback.py): issue 50's script -- the hello of before the handshake -- is refused with
no descriptor and no export; a peer with the secret receives only memory sealed at its size (ftruncate refused, so
it cannot make this side's writes fault); a peer whose own memory could shrink is refused before it is mapped; a
peer that stalls mid-handshake holds one worker until the handshake timeout, never the listener."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.raw_loopback import CQ_CAPACITY, handshake, speak_v1_hello
from helpers.waiting import wait_for

from edgepath.contract import wire
from edgepath.contract.pool import reply_stride
from edgepath.native.abi import lib
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports import connections
from edgepath.transports.base import Access
from edgepath.transports.connections import ConnectionManager
from edgepath.transports.loopback import SEALS, UNSEALED, LoopbackTransport
from edgepath.transports.peer_auth import NO_HANDSHAKE, TIMED_OUT, TOO_MANY, ConnectorHandshake, PeerKeys

SECRET = b"s" * 32
CQ_BYTES = int(lib.ep_cq_size(CQ_CAPACITY))
#: an agent of one frame: what it tells a slot server, and the bytes of its replies region
AGENT, REPLIES = wire.AgentHello(1, 16, 16).info(), reply_stride(16)


def echo(tokens: Any) -> Any:
    return tokens


@pytest.fixture
def slot_server(tmp_path: Path) -> Iterator[SlotServer]:
    server = SlotServer(LoopbackTransport(PeerKeys(SECRET)), str(tmp_path / "slots.sock"), echo, SlotServerConfig())
    server.start_connection_manager()
    yield server
    server.close()


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[Callable[..., ConnectionManager]]:
    """A bare listener exporting one region, its connection manager started (``handshake_timeout`` seconds)."""
    made: list[tuple[LoopbackTransport, ConnectionManager]] = []

    def make(handshake_timeout: float = 10.0) -> ConnectionManager:
        transport = LoopbackTransport(PeerKeys(SECRET), handshake_timeout=handshake_timeout)
        pool = transport.register("pool", 8192, Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)
        listener = transport.listen(str(tmp_path / f"l{len(made)}.sock"), [pool], {})
        manager = ConnectionManager(listener, lambda conn: {}, "test-listener")
        manager.start()
        made.append((transport, manager))
        return manager

    yield make
    for transport, manager in made:
        manager.close()
        transport.close()


def test_issue_50s_script_is_refused_with_nothing_described(slot_server: SlotServer) -> None:
    answer, fds = speak_v1_hello(slot_server.address)
    assert fds == []  # no pool, no completion queue: nothing to map
    assert "exports" not in answer and "info" not in answer  # no slot count, no ABI version
    assert answer["reason"] == NO_HANDSHAKE and "handshake" in answer["refused"]
    wait_for(lambda: slot_server.connections.refused[NO_HANDSHAKE] == 1, 10.0, "the refusal counted")
    assert slot_server.peers == {} and slot_server.stats.connections == 0


def test_a_peer_with_the_secret_gets_memory_it_cannot_shrink(slot_server: SlotServer) -> None:
    replies = _sealed_memfd(REPLIES)
    desc = {"name": "replies", "length": REPLIES, "access": int(Access.REMOTE_WRITE), "offset": 0}
    answer, fds = handshake(slot_server.address, PeerKeys(SECRET), CQ_BYTES, [(desc, replies)], AGENT)
    try:
        assert [export["name"] for export in answer["exports"]] == ["pool", "states", "inbox"]
        assert len(fds) == 5  # the listener's CQ memfd, its eventfd, the pool's three parts
        for fd in (fds[0], *fds[2:]):  # the memfds
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            size = os.fstat(fd).st_size
            for length in (0, size - 1, size + 4096):  # shrinking would make the server's own writes fault
                with pytest.raises(PermissionError) as refused:
                    os.ftruncate(fd, length)
                assert refused.value.errno == errno.EPERM
        with pytest.raises(PermissionError):  # and the seals cannot be taken off or added to
            fcntl.fcntl(fds[0], fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    finally:
        for fd in (*fds, replies):
            os.close(fd)


@pytest.mark.parametrize("fault", ["unsealed", "shorter than described"])
def test_a_peer_whose_memory_could_fault_this_side_is_refused_before_it_is_mapped(
    slot_server: SlotServer, fault: str
) -> None:
    length = REPLIES
    if fault == "unsealed":  # it could truncate this later, under the slot server's next result write
        memory = os.memfd_create("replies", os.MFD_CLOEXEC)
        os.ftruncate(memory, length)
    else:
        memory = _sealed_memfd(length // 2)
    desc = {"name": "replies", "length": length, "access": int(Access.REMOTE_WRITE), "offset": 0}
    try:
        answer, fds = handshake(slot_server.address, PeerKeys(SECRET), CQ_BYTES, [(desc, memory)], AGENT)
    finally:
        os.close(memory)
    assert fds == [] and answer["reason"] == UNSEALED and "exports" not in answer
    wait_for(lambda: slot_server.connections.refused[UNSEALED] == 1, 10.0, "the refusal counted")
    assert slot_server.peers == {}


def test_a_peer_that_stalls_mid_handshake_holds_no_one_else_up(listening: Callable[..., ConnectionManager]) -> None:
    manager = listening(handshake_timeout=2.0)
    address = manager.listener.address
    silent = _raw(address)  # connected, says nothing
    half = _raw(address)  # sends an opening (all in it is public), never the proof
    opening = ConnectorHandshake(PeerKeys(SECRET), 0.0).opening().hex()
    half.send(json.dumps({"version": 2, "opening": opening}).encode())
    try:
        with contextlib.closing(LoopbackTransport(PeerKeys(SECRET))) as client:
            conn = client.connect(address, [], {}, timeout=5.0)  # while both stall
            assert set(conn.remote) == {"pool"}
        assert manager.refusals == 0  # still within their timeout: the listener served the right peer meanwhile
        wait_for(lambda: manager.refused[TIMED_OUT] == 2, 10.0, "both stalled peers dropped at the timeout")
    finally:
        silent.close()
        half.close()


def test_beyond_the_handshakes_under_way_a_peer_is_let_go_of_at_once(
    listening: Callable[..., ConnectionManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connections, "MAX_HANDSHAKES", 2)
    manager = listening(handshake_timeout=30.0)
    stalled = [_raw(manager.listener.address) for _ in range(2)]
    try:
        wait_for(lambda: manager._handshakes == 2, 10.0, "two handshakes under way")
        third = _raw(manager.listener.address)
        assert third.recv(1) == b""  # let go of at once, not held for the timeout
        third.close()
        wait_for(lambda: manager.refused[TOO_MANY] == 1, 10.0, "the refusal counted")
    finally:
        for sock in stalled:
            sock.close()


def _raw(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10.0)
    sock.connect(address)
    return sock


def _sealed_memfd(length: int) -> int:
    fd = os.memfd_create("raw-peer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, length)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd
