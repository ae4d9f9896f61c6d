"""The verbs connection's primitives hand the right addresses, keys and immediates to the C data plane.

No RDMA device is needed: ``native/edgepath_verbs.c``'s entry points are replaced by a recorder, and the
connection is made without a queue pair.  What the NIC then does with those work requests is the soft-RoCE
lane's to test (tests/softroce, ``--transport verbs``)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from edgepath.transports import verbs_datapath as vd
from edgepath.transports.base import Access, RemoteRegion, TransferCounters, TransportError

LOCAL_ADDR, LKEY, REMOTE_ADDR, RKEY = 0x10000, 11, 0x7F0000, 22
C = vd.lib  # the real data plane's constants
HANG = 2.0  # the hang timeout its transport was made with (not the default): 0.8 of it is each operation's wait


class Recorder:
    """Stands in for the C data plane: records each call, answers success (0)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("EP_"):
            return getattr(C, name)

        def call(*args: Any) -> int:
            self.calls.append((name, args))
            return 0

        return call


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch) -> tuple[vd.VerbsConnection, Recorder]:
    recorder = Recorder()
    monkeypatch.setattr(vd, "lib", recorder)
    c = vd.VerbsConnection.__new__(vd.VerbsConnection)
    c.conn_id, c._alive, c.counters = 3, True, TransferCounters()
    c._qp, c._scq, c._ctl_ptr, c._ctl_lkey = "qp", "scq", [42], 5
    c._t = vd.op_timeout_ns(HANG)
    return c, recorder


def _local() -> vd.VerbsRegion:
    region = vd.VerbsRegion.__new__(vd.VerbsRegion)
    vd.MemoryRegion.__init__(region, name="frames", buf=types.SimpleNamespace(nbytes=4096), access=Access.NONE)
    region.addr, region.lkey, region.length = LOCAL_ADDR, LKEY, 4096
    return region


REMOTE = RemoteRegion(
    "pool", 4096, Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC, (REMOTE_ADDR, RKEY)
)


def test_write_write_with_imm_and_read(conn: tuple[vd.VerbsConnection, Recorder]) -> None:
    c, rec = conn
    local = _local()
    c.write(local, 64, REMOTE, 128, 100)
    c.write_with_imm(local, 8, REMOTE, 16, 8, 0x1_0000_0007)  # the immediate is 32 bits on the wire
    c.read(local, 0, REMOTE, 256, 32)
    timeout = vd.op_timeout_ns(HANG)
    assert rec.calls == [
        (
            "ep_v_post_wait",
            ("qp", "scq", vd._OP_WRITE, LOCAL_ADDR + 64, LKEY, 100, REMOTE_ADDR + 128, RKEY, 0, timeout),
        ),
        (
            "ep_v_post_wait",
            ("qp", "scq", vd._OP_WRITE_IMM, LOCAL_ADDR + 8, LKEY, 8, REMOTE_ADDR + 16, RKEY, 7, timeout),
        ),
        ("ep_v_post_wait", ("qp", "scq", C.EP_V_READ, LOCAL_ADDR, LKEY, 32, REMOTE_ADDR + 256, RKEY, 0, timeout)),
    ]
    assert (c.counters.writes, c.counters.bytes_written, c.counters.reads, c.counters.bytes_read) == (2, 108, 1, 32)


def test_a_write_and_its_doorbell_go_in_one_post(conn: tuple[vd.VerbsConnection, Recorder]) -> None:
    c, rec = conn
    c.write_then_imm(_local(), 0, REMOTE, 512, 640, 40, 1024, 8, 9)
    assert rec.calls == [
        (
            "ep_v_write_then_imm",
            (
                "qp",
                "scq",
                LOCAL_ADDR,
                LKEY,
                640,
                REMOTE_ADDR + 512,
                RKEY,
                LOCAL_ADDR + 40,
                8,
                REMOTE_ADDR + 1024,
                9,
                vd.op_timeout_ns(HANG),
            ),
        )
    ]
    assert (c.counters.writes, c.counters.bytes_written) == (2, 648)


def test_compare_and_swap_returns_what_the_nic_found(conn: tuple[vd.VerbsConnection, Recorder]) -> None:
    c, rec = conn
    assert c.compare_and_swap(REMOTE, 24, 1, 2) == 42
    assert rec.calls == [("ep_v_cas", ("qp", "scq", [42], 5, REMOTE_ADDR + 24, RKEY, 1, 2, vd.op_timeout_ns(HANG)))]
    assert c.counters.cas == 1


def test_nothing_is_posted_past_the_checks(conn: tuple[vd.VerbsConnection, Recorder]) -> None:
    c, rec = conn
    with pytest.raises(TransportError, match="outside remote region"):
        c.write(_local(), 0, REMOTE, 4090, 64)
    with pytest.raises(TransportError, match="not 8-byte aligned"):
        c.compare_and_swap(REMOTE, 4, 0, 1)
    c._alive = False
    with pytest.raises(TransportError, match="connection 3 is closed"):
        c.read(_local(), 0, REMOTE, 0, 8)
    assert rec.calls == []
