"""Incremental detokenization at the edge: token ids in, text deltas out, sans-I/O.

Byte-level vocabularies (Tekken, GPT-2 style BPE) split one character over several tokens: 🚀 is four
bytes and can be four tokens.  Decoding the tokens seen so far then ends in U+FFFD (the decoder's
replacement for an incomplete sequence), which must never reach a client, and decoding each token on
its own is wrong for the same reason.  Decoders that drop a leading space (SentencePiece) make
``decode(a) + decode(b) != decode(a + b)`` too.

The standard answer (TGI's and vLLM's "prefix offset / read offset"): keep a short window of recent
ids; ``prefix`` is text already sent, decoded from ``window[:read]``; after new ids arrive, decode
the whole window and send what lies beyond the prefix, unless it ends in U+FFFD (a character still
incomplete: hold it back until the next ids complete it).  Once text is sent, the window slides to
start where the last sent text ended, so each call decodes a few tokens, not the whole answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """The part of :class:`edgepath.edge.text.tokenizer.Tokenizer` this module needs."""

    def decode(self, ids: np.ndarray) -> str: ...


class IncrementalDetokenizer:
    """Turns the ids of one answer, given a batch at a time, into text deltas.

    Deltas never end in a character split across tokens, and ``"".join(deltas) + flush()`` equals
    ``decode(all ids)`` for decoders where decoding a sequence that starts on a character boundary
    is the tail of decoding it with its left context (byte-level BPE such as Tekken).

    The window only grows past a few tokens while the decoded text keeps ending in U+FFFD, i.e.
    during a run of bytes that is not valid UTF-8; each call then decodes that run again.
    """

    def __init__(self, tokenizer: Decoder) -> None:
        self._tok = tokenizer
        self._window: list[int] = []
        self._read = 0  # window[:read] decodes to the prefix, already sent
        self._prefix_len = 0
        self._count = 0
        self._flushed = False

    @property
    def token_count(self) -> int:
        """Ids fed so far (the answer's completion token count)."""
        return self._count

    @property
    def pending(self) -> int:
        """Ids fed whose text has not been sent yet (an incomplete character, or after a flush 0)."""
        return len(self._window) - self._read

    def feed(self, ids: Sequence[int] | np.ndarray) -> str:
        """Take the next ids of the answer; return the text that is now complete (may be empty)."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.feed after flush: the answer has ended")
        new = np.asarray(ids)
        if new.ndim != 1 or (new.size and not np.issubdtype(new.dtype, np.integer)):
            raise TypeError(f"ids must be a 1-D sequence of integers, got {new.dtype} with shape {new.shape}")
        if new.size == 0:
            return ""
        self._window.extend(new.tolist())
        self._count += int(new.size)
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT) or len(text) <= self._prefix_len:
            return ""
        delta = text[self._prefix_len :]
        # Slide: the new prefix is the text just sent, decoded from where the old prefix ended.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_len = len(self._decode(self._window))
        return delta

    def flush(self) -> str:
        """The answer ended: return the rest, as decoded (an incomplete final character shows as U+FFFD)."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.flush called twice")
        self._flushed = True
        text = self._decode(self._window)
        delta = text[self._prefix_len :]
        self._window.clear()
        self._read = self._prefix_len = 0
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(np.asarray(ids, dtype=np.int64))
