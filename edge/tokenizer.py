"""Edge tokenizers: a production tokenizer loaded offline, and a policy for large prompts.

The default is Mistral's Tekken (tiktoken-based, 131k vocabulary), whose files ship inside the
``mistral-common`` wheel, so nothing is downloaded at run time.  ``--tokenizer PATH`` loads any
Hugging Face ``tokenizer.json`` with ``tokenizers``.  Both encoders run in Rust and release the
GIL, so a large prompt can be encoded on a worker thread while the event loop keeps serving.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

DEFAULT_TEKKEN = "tekken_240911.json"
# Prompts up to this many characters are encoded inline (tens of microseconds); longer ones
# go to a worker thread so the QUIC event loop is never blocked by one request.
INLINE_CHARS = 4096


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class TekkenTokenizer:
    """Mistral's Tekken tokenizer from a file shipped in ``mistral_common/data`` (BOS added, as a model sees it)."""

    def __init__(self, path: Path) -> None:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        self._tok = Tekkenizer.from_file(str(path))
        self._policy = SpecialTokenPolicy.IGNORE
        self.name = f"tekken:{path.name}"
        self.vocab_size = int(self._tok.n_words)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, bos=True, eos=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, special_token_policy=self._policy)


class HFTokenizer:
    """Any Hugging Face ``tokenizer.json`` (special tokens added as its post-processor says)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.name = f"hf:{path}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (plain encode does not), which the worker-thread path needs.
        return self._tok.encode_batch([text])[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def default_tekken_path() -> Path:
    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / DEFAULT_TEKKEN
    if not path.is_file():
        raise FileNotFoundError(
            f"mistral-common {mistral_common.__version__} does not ship {DEFAULT_TEKKEN} at {path}; "
            "pass --tokenizer PATH to a Hugging Face tokenizer.json"
        )
    return path


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The default Tekken tokenizer, or the Hugging Face ``tokenizer.json`` (or Tekken json) at ``path``."""
    if path is None:
        return TekkenTokenizer(default_tekken_path())
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file {p} does not exist")
    if p.name.startswith("tekken"):
        return TekkenTokenizer(p)
    return HFTokenizer(p)
