"""The request frame codec: what an edge writes into a registered frame, validated.

``write_request`` checks every field against the frame's capacities *before*
touching memory (bad input changes nothing) and writes the token ids with one
assignment into the frame's token area — the single CPU write of the data path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgepath.contract.pool import AgentFrames, FrameArray
from edgepath.contract.wire import TOKEN_MAX, TOKEN_MIN, RequestHeader, RequestInvalid, Sampling, request_problem
from edgepath.native.abi import lib

FrameError = RequestInvalid


def check_request(frames: FrameArray | AgentFrames, index: int, token_count: int, max_new_tokens: int) -> None:
    layout = frames.layout
    if not 0 <= index < frames.count:
        raise FrameError(f"frame index {index} is outside 0..{frames.count - 1}")
    problem = request_problem(token_count, max_new_tokens, layout.input_capacity, layout.output_capacity)
    if problem is not None:
        raise FrameError(problem)


def write_request(
    frames: FrameArray | AgentFrames,
    index: int,
    tokens: Sequence[int] | np.ndarray,
    *,
    request_id: int,
    max_new_tokens: int,
    flags: int = 0,
    sampling: Sampling | None = None,
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
    sampling = sampling or Sampling()
    sampling.check()
    frames.tokens[index, :n] = ids
    t_tokenized_ns = t_tokenized_ns or lib.ep_now_ns()
    frames.request_headers[index].fill(request_id, n, max_new_tokens, flags, sampling, t_receive_ns, t_tokenized_ns)
    return n


#: the writer's fields of a request header (``req``: a frame's view, from ``frames.request_headers``), values
#: already checked; the agent stamps the rest when it sends -- ``write_header(req, request_id=..., ...)``
write_header = RequestHeader.fill
