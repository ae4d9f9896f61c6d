"""The blob pool (model/blobs.py): exact-size views, memory handed out again once given back, a bounded spare."""

from __future__ import annotations

import pytest

from edgepath.model.blobs import GRAIN, BlobPool


def test_a_blob_is_writable_and_exactly_its_size_and_counts_its_whole_buffer() -> None:
    pool = BlobPool()
    blob = pool.take(GRAIN + 5)
    blob[:] = 7
    assert blob.nbytes == GRAIN + 5 and blob.flags.writeable
    assert pool.footprint(blob) == 2 * GRAIN and pool.lent == 1 and pool.allocated == 1


def test_a_blob_given_back_is_memory_for_the_next_one_of_a_similar_size() -> None:
    pool = BlobPool()
    first = pool.take(3 * GRAIN - 100)
    where = first.ctypes.data
    pool.give(first)
    assert pool.spare_bytes == 3 * GRAIN and pool.lent == 0
    second = pool.take(3 * GRAIN - 4000)  # the same grain: the same memory, nothing mapped afresh
    assert second.ctypes.data == where and pool.allocated == 1 and pool.spare_bytes == 0


def test_a_spare_buffer_much_larger_than_asked_is_not_lent_and_the_smallest_that_fits_is() -> None:
    pool = BlobPool()
    big, middle = pool.take(8 * GRAIN), pool.take(3 * GRAIN)
    where = middle.ctypes.data
    pool.give(big)
    pool.give(middle)
    small = pool.take(GRAIN // 2)  # 1 grain: neither 8 nor 3 grains is within a grain of it
    assert pool.allocated == 3 and small.ctypes.data != where
    again = pool.take(2 * GRAIN + 1)  # 3 grains: the middle buffer, not the big one
    assert again.ctypes.data == where and pool.allocated == 3


def test_spare_buffers_beyond_the_bound_are_let_go_oldest_first() -> None:
    pool = BlobPool(spare=4 * GRAIN)
    blobs = [pool.take(2 * GRAIN) for _ in range(3)]
    kept = blobs[2].ctypes.data
    for blob in blobs:
        pool.give(blob)
    assert pool.spare_bytes == 4 * GRAIN  # the first one let go
    assert pool.take(2 * GRAIN).ctypes.data in (blobs[1].ctypes.data, kept)


def test_a_blob_the_pool_did_not_lend_and_an_empty_blob_are_refused() -> None:
    pool = BlobPool()
    lent = pool.take(10)
    pool.give(lent)
    with pytest.raises(ValueError, match="did not lend"):
        pool.give(lent)  # twice
    with pytest.raises(ValueError, match=">= 1 byte"):
        pool.take(0)
    with pytest.raises(ValueError, match="spare must be >= 0"):
        BlobPool(spare=-1)
