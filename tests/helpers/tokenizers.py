"""A test tokenizer: one id per character, so ids are predictable without a real vocabulary."""

from __future__ import annotations

import numpy as np


class CharTokenizer:
    """One id per character (id = code point % 1000); counts calls; can be told to fail."""

    name = "chars"
    vocab_size = 1000

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def encode(self, text: str) -> np.ndarray:
        self.calls += 1
        if self.fail:
            raise ValueError("tokenizer exploded")
        return np.array([ord(c) % 1000 for c in text], dtype=np.int32)

    def encode_into(self, text: str, out: np.ndarray) -> int:
        ids = self.encode(text)
        if len(ids) <= len(out):
            out[: len(ids)] = ids
        return len(ids)

    def decode(self, ids: np.ndarray) -> str:
        return "".join(chr(int(i)) for i in ids)
