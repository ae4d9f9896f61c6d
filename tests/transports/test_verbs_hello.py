"""Reading a peer's hello (transports/verbs_setup.py): a READ that does not parse is read again, and a hello that
never parses is a clear error -- without an RDMA device, the READ played by a fake connection."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from edgepath.transports.base import TransportError
from edgepath.transports.verbs_datapath import CTL_HEADER, HELLO_CAP
from edgepath.transports.verbs_setup import HELLO_READS, _read_hello


class FakeConnection:
    """Each READ lands the next of ``payloads`` (the last one again once they run out) in its control region."""

    def __init__(self, *payloads: bytes) -> None:
        self.ctl = SimpleNamespace(addr=0, lkey=0, buf=np.zeros(CTL_HEADER + HELLO_CAP, dtype=np.uint8))
        self.payloads = list(payloads)
        self.reads = 0

    def post_wait(self, op: int, laddr: int, lkey: int, length: int, *rest: object) -> None:
        data = self.payloads[min(self.reads, len(self.payloads) - 1)]
        self.reads += 1
        self.ctl.buf[CTL_HEADER : CTL_HEADER + length] = 0
        self.ctl.buf[CTL_HEADER : CTL_HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)


HELLO = json.dumps({"exports": [{"name": "pool", "addr": 4096, "rkey": 7, "length": 512, "access": 3}]}).encode()


def test_a_hello_read_whole_is_taken_at_once() -> None:
    conn = FakeConnection(HELLO)
    assert _read_hello(conn, 0, 0, len(HELLO)) == json.loads(HELLO)  # type: ignore[arg-type]
    assert conn.reads == 1


def test_a_read_that_broke_off_is_read_again_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    conn = FakeConnection(HELLO[:40], HELLO)
    with caplog.at_level(logging.WARNING, logger="edgepath.verbs"):
        assert _read_hello(conn, 0, 0, len(HELLO)) == json.loads(HELLO)  # type: ignore[arg-type]
    assert conn.reads == 2
    assert "did not parse" in caplog.text


def test_a_hello_that_never_parses_is_malformed_after_every_read() -> None:
    conn = FakeConnection(b"{not json")
    with pytest.raises(TransportError, match=f"malformed hello from peer \\({HELLO_READS} reads of 9 bytes\\)"):
        _read_hello(conn, 0, 0, 9)  # type: ignore[arg-type]
    assert conn.reads == HELLO_READS
