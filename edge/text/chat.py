"""Chat messages to a prompt with the model's OWN chat template, rendered at the edge.

A chat model was trained on one exact layout of turns (``<|im_start|>user\\n…<|im_end|>``,
``[INST] … [/INST]``, …); any other layout quietly degrades its answers.  The layout ships with the
model as a Jinja template: ``chat_template`` in a Hugging Face ``tokenizer_config.json``, or
``tokenizer.chat_template`` in GGUF metadata.  It is rendered here the way transformers'
``apply_chat_template`` does (sandboxed immutable environment, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``bos_token``/``eos_token``, ``add_generation_prompt``), so the edge writes the
same prompt ids the model was trained on.

Rendering is pure: ``strftime_now`` (used by some templates) reads the time the caller passes in,
never the clock.  :func:`read_gguf_metadata` and :func:`load_chat_template` are the thin I/O part.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

NO_TEMPLATE = (
    "chat completions need a model with a chat template, and this model's tokenizer has none; "
    "pass one with --chat-template FILE (a Jinja template file, a tokenizer_config.json or a .gguf), "
    "or use POST /v1/completions with a prompt"
)


class ChatTemplateError(ValueError):
    """The template is missing or malformed, or refused the conversation (its ``raise_exception``)."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation, content already flattened to text."""

    role: str
    content: str


class _GenerationTag(Extension):
    """``{% generation %}…{% endgeneration %}``: transformers' marker of assistant text (for training
    masks).  Templates that use it must still parse; rendering keeps the body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a class-level set)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers replaces Jinja's tojson (which HTML-escapes) with plain json.dumps; templates rely on it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


class ChatTemplate:
    """A compiled chat template and the special-token strings it may print."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "chat template") -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"{origin}: the chat template is empty")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"{origin}: not a valid Jinja template (line {exc.lineno}: {exc.message})"
            ) from None

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any], *, origin: str = "tokenizer_config.json") -> ChatTemplate:
        """From a parsed Hugging Face ``tokenizer_config.json`` (``chat_template`` a string, or a list of
        named templates of which ``default`` is the one for plain chat)."""
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            if "default" not in named:
                raise ChatTemplateError(f"{origin}: chat_template lists {sorted(map(str, named))} but no 'default'")
            template = named["default"]
        if template is None:
            raise ChatTemplateError(f"{origin} has no chat_template: {NO_TEMPLATE}")
        if not isinstance(template, str):
            raise ChatTemplateError(f"{origin}: chat_template must be a string, got {type(template).__name__}")
        return cls(
            template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            origin=origin,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, origin: str = "GGUF") -> ChatTemplate:
        """From GGUF metadata (:func:`read_gguf_metadata`): ``tokenizer.chat_template``, with the BOS/EOS
        strings looked up in ``tokenizer.ggml.tokens``."""
        template = metadata.get("tokenizer.chat_template")
        if template is None:
            raise ChatTemplateError(f"{origin} has no tokenizer.chat_template: {NO_TEMPLATE}")
        tokens = metadata.get("tokenizer.ggml.tokens", [])

        def token(key: str) -> str:
            index = metadata.get(key)
            if index is None:
                return ""
            if not 0 <= index < len(tokens):
                raise ChatTemplateError(f"{origin}: {key} = {index} is outside the {len(tokens)}-token vocabulary")
            return str(tokens[index])

        return cls(
            template,
            bos_token=token("tokenizer.ggml.bos_token_id"),
            eos_token=token("tokenizer.ggml.eos_token_id"),
            origin=origin,
        )

    @property
    def variables(self) -> frozenset[str]:
        """The names the template reads from its context (``messages``, ``tools``, ...), as Jinja finds them."""
        return frozenset(meta.find_undeclared_variables(_environment().parse(self.source)))

    def render(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        now: datetime | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool = True,
    ) -> str:
        """The prompt text for ``messages``, ending with the assistant's opening when ``add_generation_prompt``.

        A message is a :class:`ChatMessage` or a mapping as OpenAI's API has it (``tool_calls``, ``tool_call_id``),
        and ``tools`` the functions offered, as transformers' ``apply_chat_template(tools=...)`` passes them: a
        template that has a place for tools renders them (:mod:`edgepath.edge.apis.tools`).  ``now`` feeds
        ``strftime_now`` for templates that print today's date; a template that calls it without ``now`` is an
        error rather than a silent read of the clock.  ``enable_thinking`` goes to the template as transformers',
        llama-server's and vLLM's ``chat_template_kwargs`` pass it: true by default, as llama-server renders (templates
        that read it disagree on what its absence means: Qwen3's thinks, llama.cpp's DeepSeek-R1 distillations' close
        the block at once); false asks a reasoning model's template to answer without thinking
        (:mod:`edgepath.edge.text.thinking`), and a template that does not read it renders the same."""
        if not messages:
            raise ChatTemplateError("a chat needs at least one message")

        def strftime_now(fmt: str) -> str:
            if now is None:
                raise ChatTemplateError(f"{self.origin} calls strftime_now(); render it with now=<datetime>")
            return now.strftime(fmt)

        try:
            return self._template.render(
                messages=[
                    {"role": m.role, "content": m.content} if isinstance(m, ChatMessage) else dict(m) for m in messages
                ],
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                strftime_now=strftime_now,
                enable_thinking=enable_thinking,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.origin} failed to render: {exc}") from None


def _token_text(token: Any) -> str:
    """``bos_token``/``eos_token`` of a tokenizer_config.json: a string, or an AddedToken dict, or null."""
    if token is None:
        return ""
    if isinstance(token, str):
        return token
    if isinstance(token, Mapping) and isinstance(token.get("content"), str):
        return str(token["content"])
    raise ChatTemplateError(f"special token must be a string or {{'content': str}}, got {token!r}")


# -- GGUF metadata (the thin I/O part) --------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
_GGUF_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(stream: BinaryIO) -> dict[str, Any]:
    """The key/value metadata at the head of a GGUF file (version 2 or 3, little-endian).

    Reads only the metadata, not the tensors, so the edge gets a model's chat template without
    loading the model."""

    def take(n: int) -> bytes:
        data = stream.read(n)
        if len(data) != n:
            raise ValueError(f"GGUF: file ends inside the metadata (wanted {n} bytes, got {len(data)})")
        return data

    def unpack(fmt: str) -> Any:
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    def string() -> str:
        return take(unpack("<Q")).decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        if kind in _GGUF_SCALARS:
            return unpack(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return string()
        if kind == _GGUF_ARRAY:
            item_kind, count = unpack("<I"), unpack("<Q")
            return [value(item_kind) for _ in range(count)]
        raise ValueError(f"GGUF: unknown value type {kind}")

    magic = stream.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(f"not a GGUF file (starts with {magic!r}, expected {_GGUF_MAGIC!r})")
    version = unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported; versions 2 and 3 (little-endian) are")
    unpack("<Q")  # tensor count: the tensors are not read
    count = unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key = string()
        metadata[key] = value(unpack("<I"))
    return metadata


def load_chat_template(path: str | Path, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """``--chat-template FILE``: a ``.gguf`` model, a ``tokenizer_config.json``, or a bare Jinja template
    (whose BOS/EOS strings the caller gives, from its tokenizer)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"chat template file {p} does not exist")
    if p.suffix == ".gguf":
        with p.open("rb") as f:
            return ChatTemplate.from_gguf_metadata(read_gguf_metadata(f), origin=str(p))
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        return ChatTemplate.from_tokenizer_config(json.loads(text), origin=str(p))
    return ChatTemplate(text, bos_token=bos_token, eos_token=eos_token, origin=str(p))
