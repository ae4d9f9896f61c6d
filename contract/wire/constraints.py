"""The words after a request's prompt (native/edgepath_slot.h, issue 36): a GBNF grammar the output must match,
then the request's logit biases; the request flags that say how many words follow."""

from __future__ import annotations

import numpy as np

from edgepath.contract.wire.sampling import LogitBias, RequestInvalid
from edgepath.native.abi import lib

FLAG_CONSTRAINT = lib.EP_FLAG_CONSTRAINT
#: most words a constraint may take
CONSTRAINT_WORDS_MAX = lib.EP_FLAG_CONSTRAINT_MASK


def constraint_encoding(grammar: str) -> np.ndarray:
    """A GBNF grammar as the int32 words that follow the prompt: its UTF-8, zero-padded to whole words."""
    data = grammar.encode()
    words = np.frombuffer(data + b"\0" * (-len(data) % 4), dtype=np.int32)
    if not 0 < len(words) <= CONSTRAINT_WORDS_MAX:
        raise RequestInvalid(f"a constraint takes 1 to {CONSTRAINT_WORDS_MAX} words, this one {len(words)}")
    return words


def logit_bias_encoding(logit_bias: LogitBias) -> np.ndarray:
    """Logit biases as the int32 words that end the constraint: per pair its token id, then its bias (float32 bits)."""
    words = np.zeros(2 * len(logit_bias), dtype=np.int32)
    if logit_bias:
        words[0::2] = [token for token, _ in logit_bias]
        words.view(np.float32)[1::2] = [bias for _, bias in logit_bias]
    return words


def after_prompt(grammar: str | None, logit_bias: LogitBias) -> np.ndarray | None:
    """The words that follow a request's prompt: its grammar (:func:`constraint_encoding`), then its logit biases
    (:func:`logit_bias_encoding`; the request header says how many); None when it has neither."""
    return grammar_then_biases(None if grammar is None else constraint_encoding(grammar), logit_bias)


def grammar_then_biases(grammar: np.ndarray | None, logit_bias: LogitBias) -> np.ndarray | None:
    """:func:`after_prompt` of a grammar already encoded (the edge builds a grammar's words once and keeps them):
    ``grammar``'s words as they are when there are no biases; None when there is neither."""
    if not logit_bias:
        return grammar
    parts = [grammar] if grammar is not None else []
    words = np.concatenate([*parts, logit_bias_encoding(logit_bias)])
    if len(words) > CONSTRAINT_WORDS_MAX:
        raise RequestInvalid(f"a constraint takes 1 to {CONSTRAINT_WORDS_MAX} words, this one {len(words)}")
    return words


def read_after_prompt(words: np.ndarray, logit_biases: int) -> tuple[str | None, LogitBias]:
    """The grammar (None: none) and the logit biases in the words after a prompt (as :func:`after_prompt` made
    them; ``logit_biases``: the request header's count).  ValueError when they cannot be: more biases than words, a
    grammar that is not UTF-8."""
    bias_words = 2 * logit_biases
    if bias_words > len(words):
        raise ValueError(f"{logit_biases} logit biases take {bias_words} words; {len(words)} follow the prompt")
    pairs = np.ascontiguousarray(words[len(words) - bias_words :], dtype=np.int32)
    ids, biases = pairs[0::2].tolist(), pairs.view(np.float32)[1::2].tolist()
    try:
        grammar = read_constraint(words[: len(words) - bias_words]) if bias_words < len(words) else None
    except UnicodeDecodeError as exc:
        raise ValueError(f"its grammar is not UTF-8 ({exc})") from None
    return grammar, tuple(zip(ids, biases, strict=True))


def constraint_flags(words: int) -> int:
    """The request flags saying ``words`` words of constraint follow the prompt."""
    if not 0 < words <= CONSTRAINT_WORDS_MAX:
        raise RequestInvalid(f"a constraint takes 1 to {CONSTRAINT_WORDS_MAX} words, got {words}")
    return FLAG_CONSTRAINT | words << lib.EP_FLAG_CONSTRAINT_SHIFT


def constraint_words(flags: int) -> int:
    """Words of constraint after the prompt (0: none)."""
    if not flags & FLAG_CONSTRAINT:
        return 0
    return int(flags >> lib.EP_FLAG_CONSTRAINT_SHIFT & lib.EP_FLAG_CONSTRAINT_MASK)


def input_words(token_count: int, flags: int) -> int:
    """What a request's input takes of a slot: its prompt's ids and the constraint after them."""
    return token_count + constraint_words(flags)


def read_constraint(words: np.ndarray) -> str:
    """The grammar in ``words`` (as :func:`constraint_encoding` made them); ValueError when it is not UTF-8."""
    return np.ascontiguousarray(words, dtype=np.int32).tobytes().rstrip(b"\0").decode()
