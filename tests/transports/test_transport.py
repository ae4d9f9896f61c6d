"""The transport interface itself, on whichever transport was chosen (``--transport``): remote CAS,
WRITE, WRITE_WITH_IMM, READ, the access and bounds checks, admission and refusal at setup, the
completion channel, and disconnect detection."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from edgepath.peer_secret import peer_keys
from edgepath.transports.base import Access, Connection, MemoryRegion, Transport, TransportError, TransportUnavailable
from edgepath.transports.loopback import LoopbackTransport

pytestmark = pytest.mark.transport

SIZE = 4096


@dataclass
class Pair:
    server: Transport
    client: Transport
    exported: MemoryRegion  # the server's region, exported with every remote access
    replies: MemoryRegion  # the client's region, exported with REMOTE_WRITE only
    local: MemoryRegion  # the client's private staging memory
    s_conn: Connection
    c_conn: Connection


def _accept_in_thread(listener: Any, admit: Callable[[Connection], dict[str, Any]] | None = None) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["conn"] = listener.accept(timeout=10.0, admit=admit)
        except Exception as exc:
            box["error"] = exc

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


@pytest.fixture
def pair(new_transport: Callable[[], Transport], new_address: Callable[[str], str]) -> Iterator[Pair]:
    server, client = new_transport(), new_transport()
    exported = server.register("pool", SIZE, Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)
    replies = client.register("replies", SIZE, Access.REMOTE_WRITE)
    local = client.register("local", SIZE, Access.NONE)
    listener = server.listen(new_address("server"), [exported], {"slots": 7})
    box = _accept_in_thread(listener, admit=lambda conn: {"you": conn.conn_id})
    c_conn = client.connect(listener.address, [replies], {"frames": 3}, timeout=10.0)
    box["thread"].join(10.0)
    assert "error" not in box, box.get("error")
    yield Pair(server, client, exported, replies, local, box["conn"], c_conn)
    listener.close()


def test_setup_exchanges_exports_info_and_ids(pair: Pair) -> None:
    c, s = pair.c_conn, pair.s_conn
    assert c.peer_info == {"slots": 7, "you": s.conn_id}
    assert s.peer_info == {"frames": 3}
    assert (c.peer_assigned_id, s.peer_assigned_id) == (s.conn_id, c.conn_id)
    assert set(c.remote) == {"pool"} and set(s.remote) == {"replies"}
    assert c.remote["pool"].length == SIZE
    assert s.remote["replies"].access == Access.REMOTE_WRITE


def test_compare_and_swap_returns_the_value_found(pair: Pair) -> None:
    words = pair.exported.buf[:16].view(np.uint64)
    words[1] = 5
    pool = pair.c_conn.remote["pool"]
    assert pair.c_conn.compare_and_swap(pool, 8, 5, 9) == 5
    assert int(words[1]) == 9
    assert pair.c_conn.compare_and_swap(pool, 8, 5, 11) == 9  # lost: nothing changes
    assert int(words[1]) == 9
    assert pair.c_conn.compare_and_swap(pool, 8, 9, (1 << 63) | 3) == 9
    assert int(words[1]) == (1 << 63) | 3
    assert pair.c_conn.counters.cas == 3


def test_write_places_bytes_and_read_fetches_them(pair: Pair) -> None:
    pair.local.buf[:100] = np.arange(100, dtype=np.uint8)
    pool = pair.c_conn.remote["pool"]
    pair.c_conn.write(pair.local, 0, pool, 1000, 100)
    assert pair.exported.buf[1000:1100].tolist() == list(range(100))
    pair.exported.buf[2000:2010] = 42
    pair.c_conn.read(pair.local, 500, pool, 2000, 10)
    assert pair.local.buf[500:510].tolist() == [42] * 10
    counters = pair.c_conn.counters
    assert (counters.writes, counters.bytes_written, counters.reads, counters.bytes_read) == (1, 100, 1, 10)


def test_write_with_imm_lands_data_then_a_completion_for_this_side_s_connection(pair: Pair) -> None:
    pair.local.buf[:8] = 7
    pool = pair.c_conn.remote["pool"]
    for imm in (0, 1, 0xFFFFFFFF):
        pair.c_conn.write_with_imm(pair.local, 0, pool, 64, 8, imm)
    got = []
    while len(got) < 3:
        batch = pair.server.cq.wait(5.0)
        assert batch, "completion never arrived"
        got += batch
    assert [(c.conn_id, c.imm) for c in got] == [(pair.s_conn.conn_id, imm) for imm in (0, 1, 0xFFFFFFFF)]
    assert pair.exported.buf[64:72].tolist() == [7] * 8
    # Zero-length WRITE_WITH_IMM: a bare notification (the slot server's result signal).
    pair.s_conn.write_with_imm(pair.exported, 0, pair.s_conn.remote["replies"], 0, 0, 12)
    assert [(c.conn_id, c.imm) for c in pair.client.cq.wait(5.0)] == [(pair.c_conn.conn_id, 12)]


def test_write_then_imm_lands_the_data_before_its_doorbell(pair: Pair) -> None:
    pair.local.buf[:64] = np.arange(64, dtype=np.uint8)
    pair.local.buf[64:72] = 9
    pool = pair.c_conn.remote["pool"]
    pair.c_conn.write_then_imm(pair.local, 0, pool, 512, 64, 64, 1024, 8, 5)
    assert [(c.conn_id, c.imm) for c in pair.server.cq.wait(5.0)] == [(pair.s_conn.conn_id, 5)]
    assert pair.exported.buf[512:576].tolist() == list(range(64))
    assert pair.exported.buf[1024:1032].tolist() == [9] * 8
    assert (pair.c_conn.counters.writes, pair.c_conn.counters.bytes_written) == (2, 72)
    with pytest.raises(TransportError, match="outside remote region"):
        pair.c_conn.write_then_imm(pair.local, 0, pool, 512, 64, 64, SIZE - 4, 8, 6)


def test_completion_channel_wakes_a_sleeper_after_arm(pair: Pair) -> None:
    cq = pair.server.cq
    assert cq.poll() == []
    assert cq.arm() is False
    pair.c_conn.write_with_imm(pair.local, 0, pair.c_conn.remote["pool"], 0, 0, 99)
    readable, _, _ = select.select([cq.fileno()], [], [], 5.0)
    assert readable, "completion channel did not turn readable"
    assert [c.imm for c in cq.poll()] == [99]
    assert cq.wait(0.01) == []


def test_access_and_bounds_are_enforced_before_anything_moves(pair: Pair) -> None:
    pool = pair.c_conn.remote["pool"]
    replies = pair.s_conn.remote["replies"]
    with pytest.raises(TransportError, match="outside remote region"):
        pair.c_conn.write(pair.local, 0, pool, SIZE - 4, 8)
    with pytest.raises(TransportError, match="outside"):
        pair.c_conn.read(pair.local, SIZE - 4, pool, 0, 8)
    with pytest.raises(TransportError, match="does not grant"):
        pair.s_conn.read(pair.exported, 0, replies, 0, 8)
    with pytest.raises(TransportError, match="does not grant"):
        pair.s_conn.compare_and_swap(replies, 0, 0, 1)
    with pytest.raises(TransportError, match="aligned"):
        pair.c_conn.compare_and_swap(pool, 4, 0, 1)
    assert pair.exported.buf.sum() == 0


def test_refusal_by_admit_reaches_the_connecting_side(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str], transport_name: str
) -> None:
    server, client = new_transport(), new_transport()
    listener = server.listen(new_address("server"), [], {})

    def refuse(conn: Connection) -> dict[str, Any]:
        raise ValueError("no room for you")

    box = _accept_in_thread(listener, admit=refuse)
    with pytest.raises(TransportError) as refused:
        client.connect(listener.address, [], {}, timeout=10.0)
    if transport_name == "verbs":  # loopback's refusal is the socket closing, without a reason
        assert "no room for you" in str(refused.value)
    box["thread"].join(10.0)
    assert isinstance(box.get("error"), ValueError)
    listener.close()


def test_connecting_to_nobody_fails_clearly(new_transport: Callable[[], Transport], new_address) -> None:
    with pytest.raises(TransportError):
        new_transport().connect(new_address("nobody"), [], {}, timeout=3.0)


def test_closing_one_side_is_seen_by_the_other(pair: Pair) -> None:
    assert pair.s_conn.check_alive()
    pair.c_conn.close()
    readable, _, _ = select.select([pair.s_conn.fileno()], [], [], 10.0)
    assert readable, "no management event after the peer closed"
    assert not pair.s_conn.check_alive()
    with pytest.raises(TransportError):
        pair.c_conn.write(pair.local, 0, pair.c_conn.remote["pool"], 0, 8)


def _connect_to(
    server: Transport, client: Transport, address: str, exports: list[MemoryRegion]
) -> tuple[Any, Connection]:
    listener = server.listen(address, exports, {})
    box = _accept_in_thread(listener)
    c_conn = client.connect(listener.address, [], {}, timeout=10.0)
    box["thread"].join(10.0)
    assert "error" not in box, box.get("error")
    return listener, c_conn


def test_a_caller_owned_buffer_is_registered_in_place_and_exported(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str]
) -> None:
    server, client = new_transport(), new_transport()
    owner = server.register("owner", 2 * SIZE, Access.NONE)
    # An unaligned slice of memory registered with the transport: what the agent does with the frames
    # its edges share (registered once for the edges, once in place for the slot servers).
    inplace = server.register(
        "inplace", SIZE, Access.REMOTE_READ | Access.REMOTE_WRITE, buffer=owner.buf[100 : 100 + SIZE]
    )
    assert inplace.buf.ctypes.data == owner.buf.ctypes.data + 100
    local = client.register("local", SIZE, Access.NONE)
    listener, conn = _connect_to(server, client, new_address("server"), [inplace])
    local.buf[:16] = np.arange(16, dtype=np.uint8)
    conn.write(local, 0, conn.remote["inplace"], 8, 16)
    assert owner.buf[108:124].tolist() == list(range(16))  # landed in the caller's memory, no copy
    owner.buf[100 + SIZE - 4 : 100 + SIZE] = 7
    conn.read(local, 100, conn.remote["inplace"], SIZE - 4, 4)
    assert local.buf[100:104].tolist() == [7] * 4
    assert owner.buf[:100].sum() == 0 and owner.buf[100 + SIZE :].sum() == 0  # nothing outside the slice
    listener.close()


def test_register_refuses_a_buffer_that_does_not_fit_saying_what_it_needs(
    new_transport: Callable[[], Transport],
) -> None:
    t = new_transport()
    with pytest.raises(ValueError, match=r"'frames'.*64 C-contiguous uint8 bytes, got 32 bytes of uint8"):
        t.register("frames", 64, Access.NONE, buffer=np.zeros(32, dtype=np.uint8))
    with pytest.raises(ValueError, match="of int32"):
        t.register("frames", 64, Access.NONE, buffer=np.zeros(16, dtype=np.int32))
    with pytest.raises(ValueError, match="not contiguous"):
        t.register("frames", 64, Access.NONE, buffer=np.zeros(128, dtype=np.uint8)[::2])
    with pytest.raises(ValueError, match="length must be positive"):
        t.register("frames", 0, Access.NONE)


def test_memory_that_is_not_shared_is_usable_locally_and_exported_only_where_the_transport_can(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str], transport_name: str
) -> None:
    server, client = new_transport(), new_transport()
    pool = server.register("pool", SIZE, Access.REMOTE_WRITE)
    staging = client.register("staging", SIZE, Access.NONE, buffer=np.full(SIZE, 5, dtype=np.uint8))
    listener, conn = _connect_to(server, client, new_address("server"), [pool])
    conn.write(staging, 0, conn.remote["pool"], 0, 32)  # the local side of an operation: any memory will do
    assert pool.buf[:32].tolist() == [5] * 32
    plain = server.register("plain", SIZE, Access.REMOTE_WRITE, buffer=np.zeros(SIZE, dtype=np.uint8))
    if transport_name == "loopback":  # shared memory is the only memory another process can map
        with pytest.raises(TransportError, match="'plain' wraps caller memory that is not loopback shared memory"):
            server.listen(new_address("other"), [plain], {})
    else:  # a NIC reaches any registered memory
        server.listen(new_address("other"), [plain], {}).close()
    listener.close()


def test_local_view_maps_the_peer_s_region_where_the_transport_can(
    new_transport: Callable[[], Transport], new_address: Callable[[str], str], transport_name: str
) -> None:
    server, client = new_transport(), new_transport()
    status = server.register("status", SIZE, Access.REMOTE_READ)
    listener, conn = _connect_to(server, client, new_address("server"), [status])
    if transport_name != "loopback":
        with pytest.raises(TransportUnavailable, match=r"'status' is in the peer's memory.*Connection\.read"):
            conn.local_view(conn.remote["status"])
        listener.close()
        return
    view = conn.local_view(conn.remote["status"])
    assert view.dtype == np.uint8 and view.nbytes == SIZE
    status.buf[:8] = 3
    assert view[:8].tolist() == [3] * 8  # the peer's memory itself, not a copy
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 1  # REMOTE_READ only: mapped read-only
    conn.close()
    with pytest.raises(TransportError, match="closed"):
        conn.local_view(conn.remote["status"])
    listener.close()


def test_closing_a_loopback_endpoint_twice_is_harmless() -> None:
    """A second close must not close descriptors (the CQ's memfd and eventfd, the regions' memfds) that by
    then may belong to someone else."""
    t = LoopbackTransport(peer_keys(None))
    t.register("r", 64, Access.NONE)
    t.close()
    reused = os.eventfd(0)  # likely the number the CQ's eventfd had
    try:
        t.close()
        os.eventfd_write(reused, 1)  # still ours
    finally:
        os.close(reused)


def test_a_peer_that_does_not_answer_in_time_is_a_transport_error(new_transport, new_address) -> None:
    """A listener that never accepts (a frozen slot server): connecting times out as a TransportError, the one
    error callers of connect handle -- never a bare socket timeout."""
    server, client = new_transport(), new_transport()
    address = new_address("frozen")
    listener = server.listen(address, [], {})
    try:
        with pytest.raises(TransportError):
            client.connect(address, [], {}, timeout=0.2)
    finally:
        listener.close()
