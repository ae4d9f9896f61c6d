"""The loopback completion queue: sleeping and spinning waits, GIL released while blocked, overrun."""

from __future__ import annotations

import os
import threading

from edgepath.native.abi import lib
from edgepath.transports.loopback import LoopbackCQ


def _push(cq: LoopbackCQ, value: int) -> int:
    return lib.ep_cq_push(cq._map.ptr, value, cq.event_fd)


def test_wait_returns_what_was_pushed_in_order() -> None:
    cq = LoopbackCQ(8)
    for v in (1, 2, (3 << 32) | 4):
        assert _push(cq, v) == lib.EP_OK
    got = cq.wait(timeout=1.0)
    assert [(c.conn_id, c.imm) for c in got] == [(0, 1), (0, 2), (3, 4)]
    assert cq.wait(timeout=0.01) == []
    assert cq.wait(timeout=0.01, spin=0.005) == []


def test_a_full_queue_refuses_instead_of_overwriting() -> None:
    cq = LoopbackCQ(4)
    assert [_push(cq, v) for v in range(5)] == [lib.EP_OK] * 4 + [lib.EP_CQ_E_FULL]
    assert [c.imm for c in cq.poll(16)] == [0, 1, 2, 3]
    assert _push(cq, 9) == lib.EP_OK


def test_a_blocked_waiter_releases_the_gil_and_wakes_on_a_push() -> None:
    """The waiter sleeps in C; if it held the GIL, this thread could not run to wake it and the
    wait would end by timeout with nothing."""
    cq = LoopbackCQ(8)
    entered = threading.Event()
    got: list = []

    def waiter() -> None:
        entered.set()
        got.extend(cq.wait(timeout=30.0))

    t = threading.Thread(target=waiter)
    t.start()
    assert entered.wait(5.0)
    armed = cq._map.array[192:196].view("u4")  # struct ep_cq.armed: set just before the waiter sleeps
    while armed[0] == 0 and t.is_alive():
        pass
    counted = sum(1 for _ in range(100_000))  # Python work while the waiter is inside C
    assert _push(cq, 42) == lib.EP_OK
    t.join(timeout=10.0)
    assert not t.is_alive()
    assert counted == 100_000 and [c.imm for c in got] == [42]


def test_arm_reports_pending_entries_so_an_event_loop_never_misses_one() -> None:
    cq = LoopbackCQ(8)
    assert cq.arm() is False
    _push(cq, 5)  # armed: this push writes the eventfd
    assert cq.arm() is True
    assert [c.imm for c in cq.poll()] == [5]


def _eventfd_count(cq: LoopbackCQ) -> int:
    try:
        return os.eventfd_read(cq.event_fd)
    except BlockingIOError:
        return 0


def test_a_push_makes_a_system_call_only_for_a_consumer_that_armed_before_sleeping() -> None:
    """The doorbell's cost on the hot path: while the consumer is awake (not armed) a push is a store
    into shared memory and no eventfd write; once armed, the first push wakes it and the next ones
    (until it re-arms) do not write again."""
    cq = LoopbackCQ(8)
    _push(cq, 1)
    assert _eventfd_count(cq) == 0
    assert cq.arm() is True  # re-arming sees the pending entry: poll instead of sleeping
    assert [c.imm for c in cq.poll()] == [1]
    assert cq.arm() is False
    _push(cq, 2)
    _push(cq, 3)
    assert _eventfd_count(cq) == 1  # one wake for the two pushes
    _push(cq, 4)
    assert _eventfd_count(cq) == 0
    assert [c.imm for c in cq.poll()] == [2, 3, 4]


def test_rearming_drains_a_wake_that_was_already_consumed() -> None:
    cq = LoopbackCQ(8)
    assert cq.arm() is False
    _push(cq, 7)  # writes the eventfd
    assert [c.imm for c in cq.poll()] == [7]
    assert cq.arm() is False  # the stale wake is drained: an event loop does not spin on it
    assert _eventfd_count(cq) == 0
