"""Edge tokenizers: a production tokenizer loaded offline, and a policy for large prompts.

The default is Mistral's Tekken (tiktoken-based, 131k vocabulary), whose files ship inside the
``mistral-common`` wheel, so nothing is downloaded at run time.  ``--tokenizer PATH`` loads any
Hugging Face ``tokenizer.json`` with ``tokenizers``.  Both encoders run in Rust and release the
GIL, so a large prompt can be encoded on a worker thread while the event loop keeps serving.
"""

from __future__ import annotations

import ctypes
import json
import logging
import re
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("edgepath.tokenizer")

DEFAULT_TEKKEN = "tekken_240911.json"
# Prompts up to this many characters are encoded inline (tens of microseconds); longer ones
# go to a worker thread so the QUIC event loop is never blocked by one request.
INLINE_CHARS = 4096


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode_into(self, text: str, out: np.ndarray) -> int:
        """Write the ids of ``text`` into ``out`` (int32) and return how many there are.
        If they do not fit, nothing is written and the (larger) count is returned."""
        ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


_CHECK_TEXT = "Edge check: héllo wörld, 東京 🚀 <s> [INST] 12345\n\ttabs"


class TekkenTokenizer:
    """Mistral's Tekken tokenizer from a file shipped in ``mistral_common/data`` (BOS added, as a model sees it).

    mistral-common's ``Tekkenizer.encode`` post-processes the tiktoken ids in Python (a list
    comprehension calling a property per id) and ``decode`` groups ids in Python (301 tokens: 118 and
    57 µs, against 95 and 9 µs here).  The same tiktoken ``Encoding`` is used directly instead, and its
    ``encode_ordinary``: mistral-common keeps Tekken's special tokens out of tiktoken (they are the ids
    below the offset), so tiktoken's special-token path finds nothing, yet it cost 2.7x the ordinary one
    (a 130-token prompt: 32 against 12 µs, AMD EPYC); the ids are offset by the special-token count straight
    into the caller's buffer, its one write of them.  At load, the fast path is checked against
    ``Tekkenizer.encode``/``decode`` (and used only while tiktoken holds no special token); if a future
    mistral-common changes its internals, the official (slower) API is used, with a warning.
    """

    def __init__(self, path: Path) -> None:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        self._tok = Tekkenizer.from_file(str(path))
        self._policy = SpecialTokenPolicy.IGNORE
        self.name = f"tekken:{path.name}"
        self.vocab_size = int(self._tok.n_words)
        self._bos = int(self._tok.bos_id)
        self._offset = int(self._tok.num_special_tokens)
        self._model = getattr(self._tok, "_model", None)
        if not self._fast_path_agrees():
            log.warning("tekken: mistral-common internals changed; using its slower public encode/decode")
            self._model = None

    def _fast_path_agrees(self) -> bool:
        if self._model is None or not hasattr(self._model, "encode_ordinary") or self._model.special_tokens_set:
            return False
        official = self._tok.encode(_CHECK_TEXT, bos=True, eos=False)
        try:
            fast = self.encode(_CHECK_TEXT)
        except Exception:
            return False
        return fast.tolist() == official and self.decode(fast) == self._tok.decode(official, self._policy)

    def encode_into(self, text: str, out: np.ndarray) -> int:
        if self._model is None:
            ids = self._tok.encode(text, bos=True, eos=False)
            if len(ids) <= len(out):
                out[: len(ids)] = ids
            return len(ids)
        core = self._model.encode_ordinary(text)
        n = len(core) + 1
        if n <= len(out):
            self._place(core, out[:n])
        return n

    def _place(self, core: list[int], out: np.ndarray) -> None:
        """BOS, then tiktoken's ids offset by the special-token count: ``out``'s one write of them."""
        out[0] = self._bos
        np.add(np.array(core, dtype=np.int32), self._offset, out=out[1:])

    def encode(self, text: str) -> np.ndarray:
        if self._model is None:
            return np.asarray(self._tok.encode(text, bos=True, eos=False), dtype=np.int32)
        core = self._model.encode_ordinary(text)
        out = np.empty(len(core) + 1, dtype=np.int32)
        self._place(core, out)
        return out

    def decode(self, ids: np.ndarray) -> str:
        if self._model is None:
            return self._tok.decode(np.asarray(ids).tolist(), special_token_policy=self._policy)
        ids = np.asarray(ids)
        return self._model.decode((ids[ids >= self._offset] - self._offset).tolist())


class HFTokenizer:
    """Any Hugging Face ``tokenizer.json`` (special tokens added as its post-processor says)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.name = f"hf:{path}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode_into(self, text: str, out: np.ndarray) -> int:
        # encode_batch releases the GIL (plain encode does not), which the worker-thread path needs.
        ids = self._tok.encode_batch([text])[0].ids
        if len(ids) <= len(out):
            out[: len(ids)] = ids
        return len(ids)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode_batch([text])[0].ids, dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=True)


class GGUFTokenizer:
    """The model's own vocabulary, loaded from its GGUF by llama.cpp (vocabulary only, no weights), so
    the edge produces exactly the ids the model side would.

    User text is tokenized with ``parse_special`` off: someone typing ``<|im_start|>`` gets the ids of
    those characters, never the control token (no prompt injection through look-alikes).  Only text the
    server itself writes -- the chat template's own markers -- is tokenized with ``special=True``.
    Special tokens the model's vocabulary asks for (BOS, for models that want it) are added.
    """

    def __init__(self, path: Path) -> None:
        from edgepath.model.gguf import llama_cpp, load_model, meta_str

        self._lib = lib = llama_cpp()
        self._model = load_model(path, vocab_only=True)
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.name = f"gguf:{path.name}"
        self.path = path
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.chat_template: str | None = meta_str(self._model, "tokenizer.chat_template")
        self._template: Any = None  # compiled on first use (edgepath.edge.text.chat.ChatTemplate)
        self._pieces: list[bytes] | None = None  # every token's bytes, made on first use (pieces())
        self.bos_token = self._special_text(lib.llama_vocab_bos(self._vocab))
        self.eos_token = self._special_text(lib.llama_vocab_eos(self._vocab))

    def _special_text(self, token: int) -> str | None:
        """The text of a control token (``<|im_end|>``), or None when the model has none (-1)."""
        if token < 0:
            return None
        ids = np.array([token], dtype=np.int32)
        return self._detokenize(ids, remove_special=False, unparse_special=True)

    def encode_into(self, text: str, out: np.ndarray, *, special: bool = False) -> int:
        """``llama_tokenize`` writing straight into ``out`` (int32, e.g. the registered frame);
        ``special``: parse control-token markers (only for text the server writes, never user text)."""
        _check_frame(out)
        return self._tokenize(text, out, add_special=True, special=special)

    def _tokenize(self, text: str, out: np.ndarray, *, add_special: bool, special: bool) -> int:
        data = text.encode("utf-8")
        pointer = out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        n = self._lib.llama_tokenize(self._vocab, data, len(data), pointer, len(out), add_special, special)
        return -n if n < 0 else n  # negative: did not fit, nothing written, -n is the count

    def encode_chat_into(
        self,
        messages: list[dict[str, Any]],
        out: np.ndarray,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> int:
        """The model's chat template applied to ``messages`` (and ``tools``, for a template that renders them; and
        ``enable_thinking``, for a reasoning model's template that reads it), tokenized into ``out``: the template's
        own text with its markers parsed as control tokens, every message's content as plain text (a user typing
        ``<|im_end|>`` cannot close their turn).  The count, as :meth:`encode_into` returns it (when it exceeds
        ``len(out)``, ``out`` may hold a prefix of the ids).

        Each content is tokenized on its own, so a content that starts or ends with whitespace may
        split differently from tokenizing the whole rendered prompt (what llama.cpp's server does, with
        markers parsed everywhere, user text included)."""
        _check_frame(out)
        n = 0
        segments = self.chat_segments(messages, add_generation_prompt, tools, enable_thinking)
        for i, (text, special) in enumerate(segments):
            room = out[n:] if n < len(out) else out[:0]
            count = self._tokenize(text, room, add_special=i == 0, special=special)
            if count > len(room):  # keep counting how many it would take, writing nothing more
                count = self._tokenize(text, np.empty(count, np.int32), add_special=i == 0, special=special)
            n += count
        return n

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` instead of the GGUF's own chat template (``serve --chat-template``)."""
        self.chat_template = source
        self._template = None

    def chat_segments(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> list[tuple[str, bool]]:
        """The rendered chat prompt as ``(text, is_template_text)`` pieces, in order: the template is
        rendered (by :mod:`edgepath.edge.text.chat`, as transformers does) with a placeholder per content.

        A template may print a content through ``tojson`` (Llama 3.1's tool results): the placeholder holds a
        newline, which ``tojson`` escapes, so such a place is found and the content put there JSON-escaped, as
        the template would have printed it.  What a template prints of ``tools`` and of an assistant's
        ``tool_calls`` is template text; so neither may hold the text of one of the model's control tokens
        (ValueError names it), which would be parsed as the token."""
        from edgepath.edge.text.chat import ChatTemplate

        if self.chat_template is None:
            raise ValueError(f"{self.path} has no tokenizer.chat_template in its metadata")
        if self._template is None:
            origin = f"{self.path} (tokenizer.chat_template)"
            self._template = ChatTemplate(
                self.chat_template, bos_token=self.bos_token or "", eos_token=self.eos_token or "", origin=origin
            )
        marked: list[dict[str, Any]] = []
        contents: dict[int, str] = {}
        for i, message in enumerate(messages):
            content = message.get("content")
            calls = message.get("tool_calls")
            if not isinstance(message.get("role"), str) or not (
                isinstance(content, str) or (content is None and calls)
            ):
                raise ValueError(f"message {i} needs string 'role' and 'content', got {sorted(message)}")
            if content is not None and "\x00" in content:
                raise ValueError(f"message {i}: content may not contain NUL characters")
            if calls:
                self._plain_template_text(calls, f"messages[{i}].tool_calls")
            mark = dict(message)
            if content is not None and (content or not calls):  # an assistant's calls without text: no content
                contents[i] = content
                mark["content"] = f"\x00{i}\n\x00"
            marked.append(mark)
        if tools:
            self._plain_template_text(tools, "tools")
        rendered = self._template.render(
            marked, add_generation_prompt=add_generation_prompt, tools=tools, enable_thinking=enable_thinking
        )
        segments: list[tuple[str, bool]] = []
        seen: list[int] = []
        at = 0
        for found in _PLACE.finditer(rendered):
            if found.start() > at:
                segments.append((rendered[at : found.start()], True))
            i = int(found.group(1) or found.group(2))
            seen.append(i)
            text = contents.get(i, "")
            if found.group(2) is not None:  # printed by tojson: as tojson prints it
                text = json.dumps(text, ensure_ascii=False)[1:-1]
            if text:
                segments.append((text, False))
            at = found.end()
        if at < len(rendered):
            segments.append((rendered[at:], True))
        # each content once; a template may leave out the text of a turn that made calls (Llama 3.1's does)
        needed = {i for i in contents if not messages[i].get("tool_calls")}
        if len(seen) != len(set(seen)) or not needed <= set(seen):
            raise ValueError(f"{self.path}: the chat template does not place each message's content exactly once")
        return segments

    def _plain_template_text(self, value: Any, where: str) -> None:
        """``value`` (printed by the template as JSON) holds no control token's text: tokenized with control
        tokens parsed, it gives the ids it gives as plain text."""
        text = json.dumps(value, ensure_ascii=False)
        size = len(text.encode()) + 8
        parsed, plain = np.empty(size, np.int32), np.empty(size, np.int32)
        n = self._tokenize(text, parsed, add_special=False, special=True)
        m = self._tokenize(text, plain, add_special=False, special=False)
        if n != m or not np.array_equal(parsed[:n], plain[:m]):
            raise ValueError(
                f"'{where}' holds the text of one of the model's control tokens, which its chat template would "
                "print as that token; remove it"
            )

    def encode(self, text: str, *, special: bool = False) -> np.ndarray:
        out = np.empty(len(text) + 8, dtype=np.int32)  # a token covers at least one byte, most cover several
        n = self.encode_into(text, out, special=special)
        if n > len(out):
            out = np.empty(n, dtype=np.int32)
            self.encode_into(text, out, special=special)
        return out[:n].copy()

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> np.ndarray:
        """llama.cpp's tokenization of ``text`` as llama-server's ``/tokenize`` asks for it: the special tokens the
        vocabulary adds (BOS) only with ``add_special``, control-token markers parsed as the tokens they name with
        ``parse_special`` (never so for a prompt: :meth:`encode_into`)."""
        out = np.empty(len(text) + 8, dtype=np.int32)
        n = self._tokenize(text, out, add_special=add_special, special=parse_special)
        if n > len(out):
            out = np.empty(n, dtype=np.int32)
            self._tokenize(text, out, add_special=add_special, special=parse_special)
        return out[:n].copy()

    def pieces(self) -> list[bytes]:
        """Every token's piece, by id: its bytes as llama.cpp renders it, control tokens' text included (what
        llama-server's ``/detokenize`` joins and ``/tokenize`` lists ``with_pieces``).  Made once, on first use (a
        call per token of the vocabulary), so that a request's ids cost a list look-up each, not a call."""
        if self._pieces is None:
            buf = ctypes.create_string_buffer(256)
            table = []
            for token in range(self.vocab_size):
                n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
                if n < 0:  # longer than the buffer: -n bytes
                    big = ctypes.create_string_buffer(-n)
                    n = self._lib.llama_token_to_piece(self._vocab, token, big, len(big), 0, True)
                    table.append(big.raw[:n])
                else:
                    table.append(buf.raw[:n])
            self._pieces = table
        return self._pieces

    def decode(self, ids: np.ndarray) -> str:
        """Text of ``ids`` as a client sees it: BOS/EOS removed, control tokens not rendered."""
        return self._detokenize(np.ascontiguousarray(ids, dtype=np.int32), remove_special=True, unparse_special=False)

    def _detokenize(self, ids: np.ndarray, *, remove_special: bool, unparse_special: bool) -> str:
        pointer = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        size = 8 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_detokenize(self._vocab, pointer, len(ids), buf, size, remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n

    def close(self) -> None:
        if self._model:
            self._lib.llama_model_free(self._model)
            self._model = None


#: a content's placeholder in the rendered chat: as printed, or as ``tojson`` prints it
_PLACE = re.compile("\x00([0-9]+)\n\x00|\\\\u0000([0-9]+)\\\\n\\\\u0000")


def _check_frame(out: np.ndarray) -> None:
    if out.dtype != np.int32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"token ids go into a writable contiguous int32 array, got {out.dtype}")


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
    """The default Tekken tokenizer, or the one at ``path``: a model's ``.gguf`` (its own vocabulary,
    via llama.cpp), a Tekken json, or a Hugging Face ``tokenizer.json``."""
    if path is None:
        return TekkenTokenizer(default_tekken_path())
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file {p} does not exist")
    if p.suffix == ".gguf":
        return GGUFTokenizer(p)
    if p.name.startswith("tekken"):
        return TekkenTokenizer(p)
    return HFTokenizer(p)
