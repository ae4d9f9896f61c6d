"""Property-based fuzzing of the frame codec: any input is either written exactly, or refused with a
FrameError and the frame left byte-for-byte as it was."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.contract.pool import FrameArray, FrameLayout
from edgepath.dpu.frame import FrameError, write_request

LAYOUT = FrameLayout(16, 8)
tokens = st.one_of(
    st.lists(st.integers(-(2**40), 2**40), max_size=24),
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=16),
    st.lists(st.floats(allow_nan=True), max_size=4),
)


@settings(max_examples=400, deadline=None)
@given(ids=tokens, index=st.integers(-2, 4), max_new=st.integers(-3, 12), request_id=st.integers(-1, 2**64))
def test_frame_codec_writes_exactly_or_changes_nothing(ids, index: int, max_new: int, request_id: int) -> None:
    buf = np.full(3 * LAYOUT.stride, 0xAB, dtype=np.uint8)
    frames = FrameArray(buf, 0, 3, LAYOUT)
    before = buf.copy()
    try:
        n = write_request(frames, index, ids, request_id=request_id, max_new_tokens=max_new)
    except FrameError as exc:
        assert str(exc)
        assert np.array_equal(buf, before)
        return
    assert 0 <= index < 3 and 1 <= n == len(ids) <= LAYOUT.input_capacity and 0 <= max_new <= 8
    assert frames.tokens[index, :n].tolist() == list(ids)
    req = frames.requests[index]
    assert (int(req["token_count"]), int(req["max_new_tokens"]), int(req["request_id"])) == (n, max_new, request_id)
    other = [i for i in range(3) if i != index]
    assert all(np.array_equal(frames.raw[i], before.reshape(3, -1)[i]) for i in other)
