"""The request frame codec: what an edge writes into a registered frame, validated.

``write_request`` checks every field against the frame's capacities *before*
touching memory (bad input changes nothing) and writes the token ids with one
assignment into the frame's token area — the single CPU write of the data path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgepath.dma.pool import FrameArray
from edgepath.native.abi import lib

TOKEN_MIN = -(2**31)
TOKEN_MAX = 2**31 - 1


class FrameError(ValueError):
    """A request that does not fit the frame format; the message says what is allowed."""


def check_request(frames: FrameArray, index: int, token_count: int, max_new_tokens: int) -> None:
    layout = frames.layout
    if not 0 <= index < frames.count:
        raise FrameError(f"frame index {index} is outside 0..{frames.count - 1}")
    if token_count <= 0:
        raise FrameError(f"a request needs at least 1 token, got {token_count}")
    if token_count > layout.input_capacity:
        raise FrameError(f"request has {token_count} tokens; a slot holds at most {layout.input_capacity}")
    if not 0 <= max_new_tokens <= layout.output_capacity:
        raise FrameError(f"max_new_tokens must be between 0 and {layout.output_capacity}, got {max_new_tokens}")


def write_request(
    frames: FrameArray,
    index: int,
    tokens: Sequence[int] | np.ndarray,
    *,
    request_id: int,
    max_new_tokens: int,
    flags: int = 0,
    t_receive_ns: int = 0,
    t_tokenized_ns: int = 0,
) -> int:
    """Validate and write one request into frame ``index``; returns the token count."""
    ids = np.asarray(tokens)
    if ids.ndim != 1:
        raise FrameError(f"tokens must be a flat sequence of integers, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise FrameError(f"tokens must be integers, got {ids.dtype}")
    n = int(ids.size)
    check_request(frames, index, n, max_new_tokens)
    if ids.dtype != np.int32 and (ids.min() < TOKEN_MIN or ids.max() > TOKEN_MAX):
        raise FrameError("token ids must fit in int32")
    if not 0 <= request_id < 2**64:
        raise FrameError(f"request_id must be an unsigned 64-bit integer, got {request_id}")
    req = frames.requests[index]
    frames.tokens[index, :n] = ids
    req["request_id"] = request_id
    req["token_count"] = n
    req["max_new_tokens"] = max_new_tokens
    req["flags"] = flags
    req["t_receive_ns"] = t_receive_ns
    req["t_tokenized_ns"] = t_tokenized_ns or lib.ep_now_ns()
    return n
