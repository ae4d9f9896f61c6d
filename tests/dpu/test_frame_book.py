"""The frame book (sans-I/O): one set of rules for a frame's life and its exactly-once accounting, shared by
the in-process agent and the agent process's client."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from edgepath.dpu.frame_book import Flight, FrameBook
from edgepath.dpu.port import Delivery, DeliveryStats


@dataclass(slots=True, kw_only=True)
class Tagged(Flight):
    where: str


def test_frames_are_handed_out_lowest_first_and_come_back() -> None:
    book: FrameBook[Flight] = FrameBook(3)
    assert [book.acquire() for _ in range(4)] == [0, 1, 2, None]
    book.release(1)
    assert book.acquire() == 1


def test_a_frame_in_flight_cannot_be_released() -> None:
    book: FrameBook[Flight] = FrameBook(2)
    index = book.acquire()
    assert index is not None
    book.sent(index, Flight())
    with pytest.raises(ValueError, match="frame 0 is still in flight"):
        book.release(index)
    book.unsent(index)  # the send failed before it left
    book.release(index)
    assert book.acquire() == 0


def test_progress_is_delivered_only_when_it_is_news_and_the_final_once() -> None:
    book: FrameBook[Flight] = FrameBook(2)
    book.sent(0, Flight())
    assert book.progress(0, 2) == Delivery(0, 2, False)
    assert book.progress(0, 2) is None  # nothing new
    assert book.progress(0, 1) is None  # older news
    assert book.progress(0, 5) == Delivery(0, 5, False)
    assert book.final(0, 7, answers=3) == Delivery(0, 7, True)
    assert 0 not in book.inflight
    assert book.stats == DeliveryStats(delivered=1)


def test_an_abandoned_frame_delivers_only_its_final_marked_abandoned_and_comes_back_with_it() -> None:
    book: FrameBook[Flight] = FrameBook(2)
    index = book.acquire()
    assert index is not None
    flight = Flight()
    book.sent(index, flight)
    assert book.abandon(index) is flight
    assert book.abandon(index) is None  # once
    assert book.progress(index, 3) is None
    assert book.acquire() == 1 and book.acquire() is None  # not back yet: the other side may still write
    # what was computed for it, for its bill; the frame is free already (the caller does not release it)
    assert book.final(index, 3) == Delivery(index, 3, True, abandoned=True)
    assert book.acquire() == index  # the book gave it back itself
    assert book.stats == DeliveryStats(abandoned=1, late=2)
    with pytest.raises(ValueError, match="frame 0 is not in flight"):
        book.abandon(index)


def test_strays_are_duplicates_of_the_last_answer_or_unknown() -> None:
    book: FrameBook[Flight] = FrameBook(4)
    book.sent(2, Flight())
    book.final(2, 1, answers=9)
    book.stray(2, final=True, answers=9)  # a second final for request 9
    book.stray(2, final=True, answers=8)  # a final for another request of the frame
    book.stray(2, final=False, answers=9)  # progress for a frame not in flight
    book.stray(3, final=True)  # never in flight
    book.stray(99, final=True, answers=-1)  # outside the book
    book.unknown()  # in flight, but another request's completion
    assert (book.stats.duplicates, book.stats.unknown, book.stats.delivered) == (1, 5, 1)


def test_losing_a_peer_returns_its_flights_and_frees_the_abandoned_ones() -> None:
    book: FrameBook[Tagged] = FrameBook(4)
    for index, where in enumerate(("a", "b", "a", "a")):
        book.acquire()
        book.sent(index, Tagged(where=where))
    book.abandon(2)
    assert book.lose(lambda flight: flight.where == "a") == [0, 3]  # the caller answers these
    assert sorted(book.inflight) == [1]
    assert book.acquire() == 2  # abandoned and lost: back at once
    assert book.lose() == [1]
    assert book.inflight == {}


def test_counters_go_on_in_a_new_book() -> None:
    """A port that reconnects (a new agent process, new frames) keeps counting where it was."""
    stats = DeliveryStats()
    first: FrameBook[Flight] = FrameBook(1, stats)
    first.sent(0, Flight())
    first.final(0, 1)
    second: FrameBook[Flight] = FrameBook(2, stats)
    second.sent(1, Flight())
    second.final(1, 1)
    assert second.stats is stats and stats.delivered == 2


def test_a_lost_frame_is_answered_once_whether_the_caller_takes_it_or_abandons_it_first() -> None:
    """Issue 37: lost with the other side, a frame waits for the caller; abandoning it then frees it at once (the
    other side is gone: nothing can land in it) and :meth:`FrameBook.take` never reports it, so the request ends
    once and the frame is freed once."""
    book: FrameBook[Tagged] = FrameBook(3)
    for index in (0, 1, 2):
        assert book.acquire() == index
        book.sent(index, Tagged(where="a"))
    assert book.lose() == [0, 1, 2]
    with pytest.raises(ValueError, match="frame 1 is lost and not taken yet"):
        book.release(1)
    assert book.abandon(1) is None  # the client went away before the caller heard: freed now
    assert book.stats.abandoned == 1
    with pytest.raises(ValueError, match="frame 1 is not in flight nor lost"):
        book.abandon(1)  # free again: not the caller's to abandon
    assert book.take([0, 1, 2]) == [0, 2]  # the caller answers these two, and releases them
    assert book.take([0, 2]) == []
    book.release(0)
    book.release(2)
    assert sorted(iter(book.acquire, None)) == [0, 1, 2]  # each frame free exactly once
