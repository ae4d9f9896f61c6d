"""Log probabilities in the output area (native/edgepath_slot.h, issue 36): the request flags asking for them,
and each token's record -- its id, log probability and likeliest alternatives -- written and read back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgepath.contract.wire.sampling import RequestInvalid
from edgepath.native.abi import lib

FLAG_LOGPROBS = lib.EP_FLAG_LOGPROBS
#: most alternatives one token's record carries (OpenAI's ``top_logprobs`` limit)
TOP_LOGPROBS_MAX = lib.EP_TOP_LOGPROBS_MAX


def logprobs_flags(top: int) -> int:
    """The request flags asking for each output token's log probability and its ``top`` likeliest alternatives."""
    if not 0 <= top <= TOP_LOGPROBS_MAX:
        raise RequestInvalid(f"top log probabilities must be between 0 and {TOP_LOGPROBS_MAX}, got {top}")
    return FLAG_LOGPROBS | top << lib.EP_FLAG_TOP_SHIFT


def logprobs_top(flags: int) -> int | None:
    """None: the output area holds plain token ids; else how many alternatives each token's record carries (as
    written: a reader checks it against :data:`TOP_LOGPROBS_MAX`)."""
    if not flags & FLAG_LOGPROBS:
        return None
    return int(flags >> lib.EP_FLAG_TOP_SHIFT & lib.EP_FLAG_TOP_MASK)


def record_words(top: int | None) -> int:
    """Output words one token takes: 1 (its id), or its log-probability record with ``top`` alternatives."""
    return 1 if top is None else 2 + 2 * top


def write_record(
    out: np.ndarray, index: int, token: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray
) -> None:
    """Token ``index``'s record in the int32 output area ``out``: id, log probability, then the alternatives'
    ids and log probabilities (likeliest first), the floats as float32 bits."""
    top = len(top_ids)
    record = out[index * (2 + 2 * top) : (index + 1) * (2 + 2 * top)]
    record[0] = token
    floats = record.view(np.float32)
    floats[1] = logprob
    record[2 : 2 + top] = top_ids
    floats[2 + top :] = top_logprobs


@dataclass(frozen=True, slots=True)
class TokenRecords:
    """Output records read back: per token its id and log probability, and its alternatives (``top`` columns)."""

    ids: np.ndarray  # int32 (n,)
    logprobs: np.ndarray  # float32 (n,)
    top_ids: np.ndarray  # int32 (n, top)
    top_logprobs: np.ndarray  # float32 (n, top)


def read_records(words: np.ndarray, top: int) -> TokenRecords:
    """The records in ``words`` (a whole number of them, as :func:`write_record` placed them)."""
    width = 2 + 2 * top
    if len(words) % width:
        raise ValueError(f"{len(words)} output words are not a whole number of {width}-word records")
    records = np.ascontiguousarray(words, dtype=np.int32).reshape(-1, width)
    floats = records.view(np.float32)
    return TokenRecords(records[:, 0], floats[:, 1], records[:, 2 : 2 + top], floats[:, 2 + top :])
