"""Incremental detokenization with the real default tokenizer (Tekken): characters split across tokens
are held back, never sent as U+FFFD, and the deltas add up to the full decode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.edge.text.detokenize import REPLACEMENT, IncrementalDetokenizer
from edgepath.edge.text.tokenizer import TekkenTokenizer, load_tokenizer

UNICODE_HEAVY = [
    "東京タワーは333メートルです。中文测试：你好，世界！",  # noqa: RUF001 (full-width punctuation on purpose)
    "rocket 🚀 family 👨\u200d👩\u200d👧 flag 🇫🇷 skin 👍🏽",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353 ﷽",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 rare CJK 𪚥𠜎 and 한국어 텍스트, ελληνικά, עברית",  # noqa: RUF001 (4-byte letters on purpose)
]


@pytest.fixture(scope="module")
def tekken() -> TekkenTokenizer:
    tok = load_tokenizer()
    assert isinstance(tok, TekkenTokenizer)
    return tok


def answer_ids(tok: TekkenTokenizer, text: str) -> np.ndarray:
    """The ids a model would produce for ``text`` (no BOS: an answer does not start with one)."""
    return tok.encode(text)[1:]


def stream(tok: TekkenTokenizer, ids: np.ndarray, sizes: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok)
    out, i = [], 0
    for n in sizes:
        out.append(d.feed(ids[i : i + n]))
        i += n
    out.append(d.feed(ids[i:]))
    out.append(d.flush())
    return out


@pytest.mark.parametrize("text", UNICODE_HEAVY)
def test_one_token_at_a_time_never_sends_a_broken_character(tekken: TekkenTokenizer, text: str) -> None:
    ids = answer_ids(tekken, text)
    # The case is real: decoding single tokens of this text yields replacement characters.
    assert any(REPLACEMENT in tekken.decode(ids[i : i + 1]) for i in range(len(ids)))
    deltas = stream(tekken, ids, [1] * len(ids))
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == tekken.decode(ids) == text


@pytest.mark.parametrize("text", UNICODE_HEAVY)
def test_every_prefix_sent_is_a_prefix_of_the_answer(tekken: TekkenTokenizer, text: str) -> None:
    ids = answer_ids(tekken, text)
    d = IncrementalDetokenizer(tekken)
    sent = ""
    for i in range(len(ids)):
        sent += d.feed(ids[i : i + 1])
        assert text.startswith(sent)
        # Only an incomplete character is held: at most the 4 bytes of one UTF-8 sequence.
        assert d.pending <= 4
    assert sent + d.flush() == text
    assert d.token_count == len(ids)


def test_a_character_split_over_tokens_is_held_until_complete(tekken: TekkenTokenizer) -> None:
    ids = answer_ids(tekken, "go 🚀")
    d = IncrementalDetokenizer(tekken)
    first = d.feed(ids[:1])
    assert first == "go"
    held = [d.feed(ids[i : i + 1]) for i in range(1, len(ids) - 1)]
    assert held == [""] * (len(ids) - 2)
    assert d.pending == len(ids) - 2
    assert d.feed(ids[-1:]) == " 🚀"
    assert d.pending == 0
    assert d.flush() == ""


def test_an_answer_cut_inside_a_character_ends_as_the_full_decode_does(tekken: TekkenTokenizer) -> None:
    ids = answer_ids(tekken, "ok 🚀")[:-1]
    d = IncrementalDetokenizer(tekken)
    sent = "".join(d.feed(ids[i : i + 1]) for i in range(len(ids)))
    assert REPLACEMENT not in sent
    rest = d.flush()
    assert rest.endswith(REPLACEMENT)
    assert sent + rest == tekken.decode(ids)


def test_special_tokens_decode_to_nothing(tekken: TekkenTokenizer) -> None:
    ids = np.concatenate([[1], answer_ids(tekken, "hi"), [2]])
    assert "".join(stream(tekken, ids, [1, 1, 1])) == "hi"


def test_empty_batches_and_bad_input(tekken: TekkenTokenizer) -> None:
    d = IncrementalDetokenizer(tekken)
    assert d.feed([]) == ""
    with pytest.raises(TypeError, match="1-D sequence of integers"):
        d.feed(np.array([[1, 2]]))
    with pytest.raises(TypeError, match="1-D sequence of integers"):
        d.feed(np.array([1.5]))
    assert d.flush() == ""
    with pytest.raises(RuntimeError, match="after flush"):
        d.feed([1234])
    with pytest.raises(RuntimeError, match="twice"):
        d.flush()


class CountingDecoder:
    """Wraps the real tokenizer and counts how many ids each call decodes (the work done)."""

    def __init__(self, tok: TekkenTokenizer) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids: np.ndarray) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids)


def test_work_per_token_is_bounded_not_growing_with_the_answer(tekken: TekkenTokenizer) -> None:
    text = "Streaming text with 東京 and 🚀 now and then. " * 150
    ids = answer_ids(tekken, text)
    counter = CountingDecoder(tekken)
    d = IncrementalDetokenizer(counter)
    sent = "".join(d.feed(ids[i : i + 1]) for i in range(len(ids))) + d.flush()
    assert sent == text
    # A full re-decode per token would be ~len(ids)**2 / 2 ids; the window keeps it a small multiple.
    assert counter.decoded <= 8 * len(ids)


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(st.characters(exclude_categories=("Cs",)), max_size=60),
    data=st.data(),
)
def test_deltas_concatenate_to_the_full_decode(tekken: TekkenTokenizer, text: str, data: st.DataObject) -> None:
    ids = answer_ids(tekken, text)
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    deltas = stream(tekken, ids, sizes)
    assert "".join(deltas) == tekken.decode(ids)
    if REPLACEMENT not in text:
        assert all(REPLACEMENT not in d for d in deltas)
