"""Test tokenizers: one id per character (ids predictable without a vocabulary), and a byte-level file."""

from __future__ import annotations

from pathlib import Path

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


class CharVocabulary(CharTokenizer):
    """A CharTokenizer with what llama-server's ``/tokenize`` and ``/detokenize`` need (edge/apis/llama_utils.py):
    BOS (id 1) when asked for; ``<b>`` is the control token 2 when parsed; every id's piece is its character's
    UTF-8, but for id 999, half of one (not UTF-8 alone)."""

    BOS = 1

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> np.ndarray:
        ids = [self.BOS] if add_special else []
        parts = text.split("<b>") if parse_special else [text]
        for i, part in enumerate(parts):
            ids += ([2] if i else []) + self.encode(part).tolist()
        return np.array(ids, dtype=np.int32)

    def pieces(self) -> list[bytes]:
        return [chr(i).encode() for i in range(self.vocab_size - 1)] + [b"\xc3"]


def byte_tokenizer(path: Path) -> Path:
    """A real Hugging Face ``tokenizer.json`` that loads in a millisecond: byte-level BPE with no merges
    (one id per UTF-8 byte, 256 ids), so any text survives encode -> decode exactly.  For process tests
    that must not spend their start-up loading a production vocabulary (slow in the soft-RoCE VM)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))
    return path
