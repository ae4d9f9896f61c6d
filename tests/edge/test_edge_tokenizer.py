"""Tokenizers at the edge: the shipped Tekken files load offline, and any Hugging Face tokenizer.json works."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.edge.text.tokenizer import HFTokenizer, TekkenTokenizer, default_tekken_path, load_tokenizer


@pytest.fixture(scope="module")
def tekken() -> TekkenTokenizer:
    tok = load_tokenizer()
    assert isinstance(tok, TekkenTokenizer)
    return tok


def test_default_is_tekken_from_mistral_common(tekken: TekkenTokenizer) -> None:
    assert default_tekken_path().parent.name == "data"
    assert tekken.vocab_size == 131072
    assert tekken.name == "tekken:tekken_240911.json"


def test_tekken_ids_are_the_real_ones(tekken: TekkenTokenizer) -> None:
    # Ids of the published Tekken vocabulary (BOS = 1), as mistral-common itself produces them.
    assert tekken.encode("Hello, world! The quick brown fox").tolist() == [
        1,
        22177,
        1044,
        4304,
        1033,
        1531,
        7586,
        22980,
        94137,
    ]


def test_tekken_round_trip_unicode(tekken: TekkenTokenizer) -> None:
    text = "héllo wörld — 東京 🚀"
    ids = tekken.encode(text)
    assert ids[0] == 1
    assert tekken.decode(ids) == text


@pytest.mark.parametrize(
    "text",
    [
        "plain words",
        "  leading and trailing  ",
        "<s>[INST] not special [/INST]</s>",
        "ünïcödé ✓ 🚀 東京\r\n\t",
        "a" * 5000,
    ],
)
def test_tekken_fast_path_matches_mistral_common(tekken: TekkenTokenizer, text: str) -> None:
    official = tekken._tok.encode(text, bos=True, eos=False)
    assert tekken.encode(text).tolist() == official
    assert tekken.decode(np.asarray(official)) == tekken._tok.decode(official, tekken._policy)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300))
def test_tekken_ordinary_encoding_is_mistral_commons_on_any_text(tekken: TekkenTokenizer, text: str) -> None:
    """The fast path encodes with tiktoken's ordinary path (no special-token search); mistral-common's own
    encode goes through the special-token one: the same ids for any text, straight into a frame too."""
    official = tekken._tok.encode(text, bos=True, eos=False)
    out = np.full(len(official) + 1, -1, dtype=np.int32)
    assert tekken.encode_into(text, out) == len(official)
    assert out[: len(official)].tolist() == official and tekken.encode(text).tolist() == official


def test_encode_into_writes_once_or_reports_the_count(tekken: TekkenTokenizer) -> None:
    ids = tekken.encode("count these tokens please")
    out = np.full(len(ids) + 2, -1, dtype=np.int32)
    assert tekken.encode_into("count these tokens please", out) == len(ids)
    assert out[: len(ids)].tolist() == ids.tolist() and out[len(ids) :].tolist() == [-1, -1]
    small = np.full(len(ids) - 1, -1, dtype=np.int32)
    assert tekken.encode_into("count these tokens please", small) == len(ids)  # too long: count, nothing written
    assert (small == -1).all()


def _write_hf_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"])
    tok.train_from_iterator(["the edge tokenizes the prompt", "the slot holds the tokens"] * 20, trainer)
    tok.save(str(path))


def test_hugging_face_tokenizer_json(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    _write_hf_tokenizer(path)
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(path)).encode("the edge holds the prompt").ids
    assert tok.encode("the edge holds the prompt").tolist() == reference
    assert tok.decode(reference) == "the edge holds the prompt"
    assert tok.vocab_size == Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    out = np.zeros(64, dtype=np.int32)
    assert tok.encode_into("the edge holds the prompt", out) == len(reference)
    assert out[: len(reference)].tolist() == reference


def test_missing_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
