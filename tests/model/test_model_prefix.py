"""The prefix book as a pure object: stream choice, reuse lengths, host copies, LRU eviction -- no model."""

from __future__ import annotations

import numpy as np
import pytest

from edgepath.model.prefix import PrefixBook, common_prefix


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def seq(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


SYSTEM = seq(1000, 40)  # a shared "system prompt"


def chat(user: int, n: int = 10) -> np.ndarray:
    return np.concatenate([SYSTEM, seq(user, n)])


def test_common_prefix() -> None:
    assert common_prefix(ids(1, 2, 3), ids(1, 2, 4)) == 2
    assert common_prefix(ids(1, 2), ids(1, 2, 3)) == 2
    assert common_prefix(ids(), ids(1)) == 0
    assert common_prefix(ids(5), ids(6)) == 0


def test_a_free_stream_holding_the_prefix_is_reused_in_place() -> None:
    book = PrefixBook(streams=4, capacity=0, min_reuse=4)
    first = book.place(chat(1))
    book.finished(first.stream, chat(1))
    again = book.place(chat(2))
    assert (again.stream, again.reuse, again.restore) == (first.stream, 40, None)
    assert book.stats.hits == 1 and book.stats.misses == 1 and book.stats.cached_tokens == 40


def test_the_last_prompt_token_is_never_reused() -> None:
    book = PrefixBook(streams=2, capacity=0, min_reuse=4)
    book.finished(book.place(chat(1)).stream, chat(1))
    same = book.place(chat(1))
    assert same.reuse == len(chat(1)) - 1


def test_the_longest_prefix_among_free_streams_wins() -> None:
    book = PrefixBook(streams=3, capacity=0, min_reuse=4)
    a, b = book.place(chat(1)), book.place(chat(2))
    book.finished(a.stream, chat(1))
    longer = np.concatenate([chat(2), seq(7, 5)])
    book.finished(b.stream, longer)
    turn = np.concatenate([longer, seq(9, 3)])  # the next turn of conversation b
    placed = book.place(turn)
    assert (placed.stream, placed.reuse) == (b.stream, len(longer))


def test_a_running_stream_is_never_chosen_and_all_running_is_an_error() -> None:
    book = PrefixBook(streams=2, capacity=0)
    first = book.place(chat(1))
    second = book.place(chat(1))
    assert second.stream != first.stream
    with pytest.raises(RuntimeError, match="all 2 streams are running"):
        book.place(chat(1))


def test_short_matches_are_not_reused() -> None:
    book = PrefixBook(streams=2, capacity=0, min_reuse=41)
    book.finished(book.place(chat(1)).stream, chat(1))
    assert book.place(chat(2)).reuse == 0  # 40 shared tokens < 41
    assert book.stats.misses == 2


def test_reuse_can_be_turned_off_per_request() -> None:
    book = PrefixBook(streams=2, capacity=0, min_reuse=4)
    book.finished(book.place(chat(1)).stream, chat(1))
    placed = book.place(chat(1), reuse=False)
    assert placed.reuse == 0 and placed.restore is None


def test_a_spare_stream_keeps_running_streams_contiguous_then_prefers_empty_then_lru() -> None:
    book = PrefixBook(streams=6, capacity=0, min_reuse=4)
    streams = [book.place(chat(i)).stream for i in range(6)]
    assert streams == [0, 1, 2, 3, 4, 5]
    for s in (1, 3, 4):
        book.finished(s, chat(100 + s))
    # running {0, 2, 5}: 3 joins 2 (one gap left), as does 4 (joins 5); 1 closes the gap 0..2.
    placed = book.place(seq(5000, 50))
    assert placed.stream == 1 and placed.reuse == 0


def test_a_spare_stream_prefers_an_empty_one() -> None:
    book = PrefixBook(streams=3, capacity=0, min_reuse=4)
    book.finished(book.place(chat(1)).stream, chat(1))  # stream 0 now holds chat 1
    placed = book.place(seq(5000, 50))
    assert placed.stream == 1


def test_cancelled_or_failed_streams_hold_nothing() -> None:
    book = PrefixBook(streams=1, capacity=0, min_reuse=4)
    first = book.place(chat(1))
    book.finished(first.stream, None)
    assert book.holding() == [None]
    assert book.place(chat(1)).reuse == 0


def test_finished_twice_is_refused() -> None:
    book = PrefixBook(streams=1, capacity=0)
    book.finished(book.place(chat(1)).stream, chat(1))
    with pytest.raises(ValueError, match="stream 0 is not running"):
        book.finished(0, chat(1))


def test_holding_shows_idle_streams_only() -> None:
    book = PrefixBook(streams=2, capacity=0)
    a = book.place(chat(1))
    b = book.place(chat(2))
    book.finished(a.stream, chat(1))
    held = book.holding()
    assert held[b.stream] is None and np.array_equal(held[a.stream], chat(1))


def test_held_lists_idle_streams_then_host_copies_each_by_recent_use_and_the_version_follows() -> None:
    """What the slot server publishes (the pool's prefix table) for prefix-affine admission."""
    book = PrefixBook(streams=3, capacity=1000, min_reuse=4)
    assert book.held() == []
    versions = [book.version]
    a = book.place(chat(1))
    b = book.place(chat(2))
    c = book.place(seq(5, 30))
    versions.append(book.version)
    book.save(seq(5, 30), "blob", 10)
    versions.append(book.version)
    book.finished(c.stream, None)  # its stream lost it; host memory has it
    book.finished(a.stream, chat(1))
    book.finished(b.stream, chat(2))
    versions.append(book.version)
    assert versions == sorted(set(versions))  # every change moved it
    held = book.held()
    assert [h.tolist() for _, h in held] == [chat(2).tolist(), chat(1).tolist(), seq(5, 30).tolist()]
    book.place(chat(2))  # a running stream's content is the running request's: not held
    assert [h.tolist() for _, h in book.held()] == [chat(1).tolist(), seq(5, 30).tolist()]


# -- host copies ------------------------------------------------------------------------------------


def test_a_saved_copy_is_restored_when_no_free_stream_holds_the_prefix() -> None:
    book = PrefixBook(streams=2, capacity=1000, min_reuse=4)
    a = book.place(chat(1))
    assert book.wants(chat(1), 100)
    book.save(chat(1), "blob-1", 100)
    book.finished(a.stream, None)  # the stream itself lost it (say, reused for something else)
    placed = book.place(chat(2))
    assert placed.restore is not None and placed.restore.blob == "blob-1"
    assert placed.reuse == 40
    assert book.stats.restored == 1 and book.stats.in_place == 0


def test_in_place_beats_an_equal_saved_copy() -> None:
    book = PrefixBook(streams=2, capacity=1000, min_reuse=4)
    a = book.place(chat(1))
    book.save(chat(1), "blob", 100)
    book.finished(a.stream, chat(1))
    placed = book.place(chat(2))
    assert placed.restore is None and placed.stream == a.stream


def test_a_longer_saved_copy_beats_a_stream() -> None:
    book = PrefixBook(streams=2, capacity=1000, min_reuse=4)
    a = book.place(chat(1))
    book.finished(a.stream, SYSTEM[:20].copy())
    book.save(chat(1), "blob", 100)
    placed = book.place(chat(1, 12))
    assert placed.restore is not None and placed.reuse == len(chat(1))


def test_copies_already_covered_are_not_saved_again() -> None:
    book = PrefixBook(streams=1, capacity=1000, min_reuse=4)
    book.save(chat(1), "whole", 100)
    assert not book.wants(chat(1), 100)  # identical
    assert not book.wants(chat(1)[:45], 90)  # a prefix of a saved one
    assert book.wants(np.concatenate([chat(1), seq(1, 4)]), 110)  # longer: worth it


def test_a_longer_copy_supersedes_its_prefixes() -> None:
    """A conversation's next turn replaces the copy of the turn before: one copy per conversation."""
    book = PrefixBook(streams=1, capacity=1000, min_reuse=4)
    book.save(chat(1), "turn-1", 100)
    book.save(chat(2), "other", 100)
    dropped = book.save(np.concatenate([chat(1), seq(7, 8)]), "turn-2", 120)
    assert [d.blob for d in dropped] == ["turn-1"]
    assert sorted(s.blob for s in book.saved) == ["other", "turn-2"]
    assert book.stats.superseded == 1 and book.stats.evicted == 0


def test_least_recently_used_copies_are_evicted_to_stay_within_capacity() -> None:
    book = PrefixBook(streams=2, capacity=300, min_reuse=4)
    for user in (1, 2, 3):
        book.save(chat(user), f"c{user}", 100)
    book.finished(book.place(chat(1, 12)).stream, None)  # restores c1: now the most recently used
    dropped = book.save(chat(4), "c4", 100)
    assert [d.blob for d in dropped] == ["c2"]
    assert book.saved_bytes == 300 <= book.capacity
    dropped = book.save(chat(5), "c5", 250)
    assert [d.blob for d in dropped] == ["c3", "c1", "c4"]
    assert [s.blob for s in book.saved] == ["c5"] and book.stats.evicted == 4


def test_copies_larger_than_the_capacity_or_too_short_are_not_wanted() -> None:
    book = PrefixBook(streams=1, capacity=100, min_reuse=8)
    assert not book.wants(chat(1), 101)
    assert not book.wants(seq(1, 7), 10)
    assert PrefixBook(streams=1, capacity=0).wants(chat(1), 1) is False


def test_bad_book_is_refused() -> None:
    with pytest.raises(ValueError, match="streams >= 1"):
        PrefixBook(streams=0, capacity=0)


def test_a_running_streams_computed_prefix_is_copied_when_nothing_else_holds_it() -> None:
    book = PrefixBook(streams=3, capacity=1000, min_reuse=4)
    a = book.place(chat(1))
    placed = book.place(chat(2), computed={a.stream: chat(1)[:30]})  # a has computed 30 of its tokens so far
    assert (placed.reuse, placed.source, placed.restore) == (30, a.stream, None) and placed.stream != a.stream
    assert book.stats.shared == 1 and book.stats.hits == 1


def test_sources_at_equal_length_prefer_no_copy_then_one_copy() -> None:
    book = PrefixBook(streams=3, capacity=1000, min_reuse=4)
    a, b = book.place(chat(1)), book.place(chat(2))
    book.save(chat(1), "saved", 100)
    book.finished(a.stream, chat(1))
    in_place = book.place(chat(3), computed={b.stream: chat(2)})
    assert (in_place.stream, in_place.restore, in_place.source) == (a.stream, None, None)
    restored = book.place(chat(4), computed={b.stream: chat(2)})
    assert restored.restore is not None and restored.source is None
    assert (book.stats.in_place, book.stats.restored, book.stats.shared) == (1, 1, 0)


# -- cache salts: a tenant never reads another's KV -------------------------------------------------------

A, B = 0xA11CE, 0xB0B


def test_a_free_stream_is_reused_only_by_its_own_salt() -> None:
    book = PrefixBook(streams=2, capacity=0, min_reuse=4)
    book.finished(book.place(chat(1), salt=A).stream, chat(1))
    other = book.place(chat(2), salt=B)  # the same system prompt under another salt
    assert other.reuse == 0 and other.restore is None and other.source is None
    assert book.stats.misses == 2 and book.stats.hits == 0  # the first request and B's
    book.finished(other.stream, None)
    own = book.place(chat(3), salt=A)
    assert own.reuse == len(SYSTEM) and book.stats.cached_tokens == len(SYSTEM)
    book.finished(own.stream, chat(3))
    assert book.place(chat(4)).reuse == 0  # no salt is a namespace of its own too


def test_a_host_copy_is_restored_only_for_its_own_salt_and_superseded_only_by_it() -> None:
    book = PrefixBook(streams=1, capacity=1000, min_reuse=4)
    book.save(chat(1), "a-copy", 100, salt=A)
    assert book.wants(chat(1), 100, salt=B)  # B's identical sequence is not A's: it is saved apart
    assert not book.wants(chat(1), 100, salt=A)
    book.save(np.concatenate([chat(1), seq(7, 8)]), "b-longer", 120, salt=B)
    assert sorted(s.blob for s in book.saved) == ["a-copy", "b-longer"]  # B's longer one supersedes nothing of A
    placed = book.place(chat(2), salt=B)
    assert placed.restore is not None and placed.restore.blob == "b-longer"
    book.finished(placed.stream, None)
    placed = book.place(chat(2), salt=A)
    assert placed.restore is not None and placed.restore.blob == "a-copy"
    book.finished(placed.stream, None)
    assert book.place(chat(2), salt=0xC).reuse == 0


def test_a_running_streams_prefix_is_copied_only_within_its_salt() -> None:
    book = PrefixBook(streams=3, capacity=0, min_reuse=4)
    a = book.place(chat(1), salt=A)
    computed = {a.stream: chat(1)[:30]}
    assert book.place(chat(2), computed=computed, salt=B).reuse == 0
    placed = book.place(chat(3), computed=computed, salt=A)
    assert placed.source == a.stream and placed.reuse == 30


def test_what_is_held_is_published_with_its_salt() -> None:
    book = PrefixBook(streams=2, capacity=1000, min_reuse=4)
    a, b = book.place(chat(1), salt=A), book.place(chat(2), salt=B)
    book.save(chat(2), "b", 100, salt=B)
    book.finished(a.stream, chat(1))
    book.finished(b.stream, None)
    assert [(salt, t.tolist()) for salt, t in book.held()] == [(A, chat(1).tolist()), (B, chat(2).tolist())]


PUBLIC, R1, R2 = 0x9B11C, 0x21, 0x22  # the public salt, and two readers' own


def test_a_reader_copies_a_public_free_stream_and_keeps_what_it_writes_its_own() -> None:
    """A reader reuses the public namespace's system prompt by a copy (the public stream stays public and free);
    its own sequence is kept under its own salt: a second reader, reading the public salt too, never reuses it."""
    book = PrefixBook(streams=3, capacity=0, min_reuse=4)
    book.finished(book.place(chat(1), salt=PUBLIC).stream, chat(1))  # a publisher's system prompt, held
    public = next(i for i, held in enumerate(book.holding()) if held is not None)
    first = book.place(chat(2), salt=R1, reads=(PUBLIC,))
    assert first.source == public and first.stream != public and first.reuse == len(SYSTEM)
    follow_up = np.concatenate([chat(2), seq(500, 40)])  # R1's private follow-up, after its answer
    book.finished(first.stream, follow_up)
    second = book.place(np.concatenate([chat(2), seq(500, 40), seq(900, 3)]), salt=R2, reads=(PUBLIC,))
    assert second.source == public and second.reuse == len(SYSTEM)  # the public prefix only, never R1's follow-up
    book.finished(second.stream, None)
    assert book.place(follow_up, salt=PUBLIC).reuse == len(SYSTEM)  # the public side never reads a reader's either
    assert sorted(salt for salt, _ in book.held()) == [R1]  # the public stream is running again: it was never taken
    assert book.place(np.concatenate([follow_up, seq(900, 3)]), salt=R1, reads=(PUBLIC,)).reuse == len(follow_up)


def test_a_reader_restores_a_public_host_copy_and_its_own_copy_supersedes_only_its_own() -> None:
    book = PrefixBook(streams=1, capacity=1000, min_reuse=4)
    book.save(chat(1), "public", 100, salt=PUBLIC)
    placed = book.place(chat(2), salt=R1, reads=(PUBLIC,))
    assert placed.restore is not None and placed.restore.blob == "public" and placed.reuse == len(SYSTEM)
    longer = np.concatenate([chat(1), seq(7, 8)])
    assert book.wants(longer, 100, salt=R1)
    book.save(longer, "r1", 100, salt=R1)
    assert sorted(s.blob for s in book.saved) == ["public", "r1"]  # the public copy is not superseded by R1's
    book.finished(placed.stream, None)
    assert book.place(longer, salt=R2, reads=(PUBLIC,)).restore.blob == "public"  # type: ignore[union-attr]


def test_a_reader_alone_with_one_free_stream_does_not_reuse_the_public_one_in_place() -> None:
    book = PrefixBook(streams=1, capacity=0, min_reuse=4)
    book.finished(book.place(chat(1), salt=PUBLIC).stream, chat(1))
    assert book.place(chat(2), salt=R1, reads=(PUBLIC,)).reuse == 0  # no second stream to copy into


def test_a_gap_between_runs_is_closed_by_moving_the_shortest_sequence_that_closes_it() -> None:
    book = PrefixBook(4, 0)
    for _ in range(4):
        book.place(np.arange(10, dtype=np.int32), reuse=False)
    book.finished(1, None)  # streams 0, 2, 3 decode: two runs
    # 0 -> 1 closes it (100 positions to copy), 3 -> 1 too (60), 2 -> 1 does not: the shortest that does
    assert book.compaction({0, 2, 3}, {0: 100, 2: 50, 3: 60}) == (3, 1)
    version = book.version
    book.move(3, 1)
    assert book.version > version
    assert book.compaction({0, 1, 2}, {0: 100, 1: 60, 2: 50}) is None  # one run: nothing to gain
    assert book.compaction({0, 2}, {2: 50}) is None  # 2 -> 3, the only free stream, closes nothing
    with pytest.raises(ValueError, match="cannot move"):
        book.move(3, 0)  # 3 is free now, 0 running


def test_what_a_request_would_reuse_is_told_without_placing_it() -> None:
    """What a slot server publishes for a prompt not placed yet: what a placement now would reuse -- a free stream's
    or a host copy's prefix of its salt, or the prefix it shares with a prompt ahead of it -- and nothing moves."""
    book = PrefixBook(streams=4, capacity=1 << 20, min_reuse=4)
    first = book.place(chat(1))
    book.finished(first.stream, chat(1))
    version = book.version
    assert book.reusable(chat(2)) == 40  # the free stream's system prompt
    assert book.reusable(chat(2), salt=7) == 0  # not another namespace's
    assert book.reusable(seq(1, 50)) == 0
    assert book.reusable(seq(1, 50), [seq(1, 30)]) == 30  # shared with a prompt ahead, computed or not
    assert book.reusable(seq(1, 50), [seq(1, 3)]) == 0  # shorter than worth reusing
    assert book.reusable(seq(1, 20), [seq(1, 20)]) == 19  # never the last token
    assert book.version == version and book.stats.hits == 0  # nothing placed, nothing counted
    again = book.place(chat(2))
    assert again.reuse == 40
