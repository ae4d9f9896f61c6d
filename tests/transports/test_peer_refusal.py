"""Peers prove they belong, on whichever transport was chosen (``--transport``; the soft-RoCE lane runs these over
verbs): a peer with another secret, or none, is refused before any region is described to it -- counted and logged
by the listener's connection manager, never admitted -- a peer with the secret is admitted, and a rotation accepts
the old and the new secret during its grace, only the new one after, and leaves connections set up alone."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers.waiting import wait_for

from edgepath.transports.base import Access, Connection, MemoryRegion, Transport
from edgepath.transports.connections import ConnectionManager
from edgepath.transports.peer_auth import NO_HANDSHAKE, UNKNOWN_SECRET, PeerKeys, PeerRefused
from edgepath.transports.registry import make_transport

pytestmark = pytest.mark.transport

OLD, NEW, OTHER = (bytes([n]) * 32 for n in (7, 8, 9))


@dataclass
class Served:
    """A listener exporting one region, its connection manager, and what its ``admit`` saw."""

    transport: Transport
    keys: PeerKeys
    pool: MemoryRegion
    manager: ConnectionManager
    admitted: list[Connection]

    @property
    def address(self) -> str:
        return self.manager.listener.address


@pytest.fixture
def endpoint(transport_name: str, transport_options: dict[str, Any]) -> Iterator[Callable[[PeerKeys], Transport]]:
    """Transport endpoints of the chosen kind, each with the keys it is given; all closed after the test."""
    made: list[Transport] = []

    def make(keys: PeerKeys) -> Transport:
        made.append(make_transport(transport_name, keys, **transport_options))
        return made[-1]

    yield make
    for transport in reversed(made):
        transport.close()


@pytest.fixture
def served(endpoint: Callable[[PeerKeys], Transport], new_address: Callable[[str], str]) -> Iterator[Served]:
    keys = PeerKeys(OLD, "the listener's")
    transport = endpoint(keys)
    pool = transport.register("pool", 4096, Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)
    listener = transport.listen(new_address("server"), [pool], {"slots": 3})
    admitted: list[Connection] = []

    def admit(conn: Connection) -> dict[str, Any]:
        admitted.append(conn)
        return {}

    manager = ConnectionManager(listener, admit, "test-listener")
    manager.start()
    yield Served(transport, keys, pool, manager, admitted)
    manager.close()


def connect(endpoint: Callable[[PeerKeys], Transport], served: Served, keys: PeerKeys) -> Connection:
    return endpoint(keys).connect(served.address, [], {"who": "test"}, timeout=20.0)


def test_a_peer_with_the_secret_is_admitted_and_reaches_what_was_exported(
    endpoint: Callable[[PeerKeys], Transport], served: Served
) -> None:
    conn = connect(endpoint, served, PeerKeys(OLD))
    assert conn.peer_info == {"slots": 3} and set(conn.remote) == {"pool"}
    served.pool.buf[:8].view(np.uint64)[0] = 5
    assert conn.compare_and_swap(conn.remote["pool"], 0, 5, 6) == 5
    assert int(served.pool.buf[:8].view(np.uint64)[0]) == 6
    wait_for(lambda: len(served.admitted) == 1, 10.0, "the peer admitted")
    assert served.admitted[0].peer_info == {"who": "test"} and served.manager.refusals == 0


def test_a_peer_with_another_secret_is_refused_before_anything_is_described_and_counted(
    endpoint: Callable[[PeerKeys], Transport], served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="edgepath.connections"):
        with pytest.raises(PeerRefused) as refused:
            connect(endpoint, served, PeerKeys(OTHER))
        assert refused.value.reason == UNKNOWN_SECRET
        wait_for(lambda: served.manager.refused[UNKNOWN_SECRET] == 1, 10.0, "the refusal counted")
    assert served.admitted == []  # admission never ran: nothing was registered for the peer, nothing described
    (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "test-listener" in line and UNKNOWN_SECRET in line
    assert OLD.hex() not in line and OTHER.hex() not in line  # who and why, never a secret
    conn = connect(endpoint, served, PeerKeys(OLD))  # the listener serves on
    assert set(conn.remote) == {"pool"}


def test_a_rotation_accepts_both_secrets_in_its_grace_then_only_the_new_and_keeps_what_is_connected(
    endpoint: Callable[[PeerKeys], Transport], served: Served
) -> None:
    before = connect(endpoint, served, PeerKeys(OLD))  # connected before the rotation: a stream under way
    assert served.keys.rotate(NEW, now=time.monotonic(), grace=3600.0)
    during_old = connect(endpoint, served, PeerKeys(OLD))  # a peer whose file has not changed yet
    during_new = connect(endpoint, served, PeerKeys(NEW))  # a peer whose file has
    served.keys.rotate(OTHER, now=time.monotonic() - 7200.0, grace=3600.0)  # NEW's grace is over (ended an hour ago)
    with pytest.raises(PeerRefused):
        connect(endpoint, served, PeerKeys(NEW))
    after = connect(endpoint, served, PeerKeys(OTHER))
    words = served.pool.buf[:8].view(np.uint64)
    words[0] = 0
    for n, conn in enumerate((before, during_old, during_new, after)):  # not one of them was dropped
        assert conn.check_alive()
        assert conn.compare_and_swap(conn.remote["pool"], 0, n, n + 1) == n
    assert int(words[0]) == 4
    wait_for(lambda: served.manager.refusals == 1, 10.0, "the one refusal counted")


def test_a_connection_request_without_the_handshake_is_refused(transport_name: str, served: Served) -> None:
    """What an old edgepath, or anyone else, sends: the listener rejects it, describing nothing."""
    if transport_name == "verbs":
        from helpers.rdma_cm import raw_connect

        event, reply = raw_connect(served.address, b"EPv1" + bytes(20))  # v1's hello pointer, no handshake
        assert event == "RDMA_CM_EVENT_REJECTED" and NO_HANDSHAKE.encode() in reply
    else:
        from helpers.raw_loopback import speak_v1_hello

        answer, fds = speak_v1_hello(served.address)
        assert fds == [] and "exports" not in answer and NO_HANDSHAKE in answer.get("reason", "")
    wait_for(lambda: served.manager.refused[NO_HANDSHAKE] == 1, 10.0, "the refusal counted")
    assert served.admitted == []
