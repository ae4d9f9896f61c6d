"""A reasoning model's thinking, split from its answer on the text stream, sans I/O.

Chat templates of reasoning models (Qwen3, the DeepSeek-R1 distillations) have the model think inside
``<think>…</think>`` before it answers.  Qwen3's template leaves the model to open the block itself; DeepSeek-R1's
ends the prompt with ``<think>\\n``, so the model's output starts inside the block and only its close comes back.
:func:`thinking_of` tells which from the template (:class:`Thinking`); :class:`ThinkingSplit` then takes the
detokenized text as it comes and gives back what is thinking and what is the answer, so every API shape puts the
thinking where its clients look for it (OpenAI chat's ``reasoning_content``, Anthropic's ``thinking`` block, a
Responses ``reasoning`` item) and never into the answer's text.

A request may turn the thinking off (Anthropic's ``thinking: {"type": "disabled"}``, OpenAI chat's
``chat_template_kwargs: {"enable_thinking": false}``, a Responses ``reasoning.effort`` of ``none`` or ``minimal``):
the template is then rendered with ``enable_thinking`` false, which the templates of reasoning models read (Qwen3's
prints an empty ``<think></think>`` block for the model, which answers at once; llama.cpp's DeepSeek-R1
distillations' closes the block it opened).  :func:`thinking_modes` finds from the template whether it has that
switch and how the output is split either way (:class:`ThinkingModes`); a reasoning template without the switch
cannot be turned off, and a request that asks to is refused (:class:`ThinkingFixed`), never answered with thinking.

Text that may still be the start of a tag is held back, as the stop strings' matcher does, so the split does not
depend on how the text was cut into deltas.  White space around the thinking (the newlines the templates put
after ``<think>``, before ``</think>`` and after it) belongs to neither part.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from edgepath.edge.text.chat import ChatTemplate, ChatTemplateError

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class Thinking:
    """How a template's model thinks: inside ``open``/``close``; ``starts_open`` when the prompt opens the block
    (DeepSeek-R1's), so the output starts in it."""

    starts_open: bool = False
    open: str = OPEN
    close: str = CLOSE


def thinking_of(source: str | None, enable_thinking: bool = True) -> Thinking | None:
    """The thinking of a chat template's model, None when the template has no thinking block: it must print the
    close tag (in earlier turns, or in the prompt it ends with); the prompt it renders for one user turn (with
    ``enable_thinking``) says whether the block is opened for the model."""
    if source is None or CLOSE not in source:
        return None
    prompt = _asked(source, enable_thinking)
    return Thinking(starts_open=prompt is not None and prompt.rstrip().endswith(OPEN))


def _asked(source: str, enable_thinking: bool) -> str | None:
    """The prompt ``source`` renders for one user turn, None when it cannot render one."""
    try:
        return ChatTemplate(source).render(
            [{"role": "user", "content": "?"}], add_generation_prompt=True, now=datetime(2000, 1, 1),
            enable_thinking=enable_thinking,
        )  # fmt: skip
    except (ChatTemplateError, RecursionError, TypeError):
        return None


class ThinkingFixed(ValueError):
    """A request asked to turn the thinking off, and the template's model thinks with no switch to turn it off."""


@dataclass(frozen=True, slots=True)
class ThinkingModes:
    """How a chat template's model thinks with ``enable_thinking`` true (``on``: the default) and false (``off``),
    None where it does not; ``switch``: the template reads ``enable_thinking`` (the prompts differ)."""

    on: Thinking | None = None
    off: Thinking | None = None
    switch: bool = False

    def choose(self, enabled: bool) -> Thinking | None:
        """The thinking of an answer whose request asked for it ``enabled`` (or not).  ThinkingFixed when it asked
        for none and the model thinks with no switch: its answer would think anyway.  A model that does not think
        answers as it is either way (nothing to turn off; nothing to turn on)."""
        if enabled:
            return self.on
        if self.on is not None and not self.switch:
            raise ThinkingFixed(
                "this model's chat template thinks (<think> blocks) and has no switch to turn it off (it does not "
                "read enable_thinking)"
            )
        return self.off


def thinking_modes(source: str | None) -> ThinkingModes:
    """:class:`ThinkingModes` of a chat template: its thinking with ``enable_thinking`` true and false, and whether
    the flag changes the prompt of one user turn (a template that ignores it renders the same)."""
    if source is None:
        return ThinkingModes()
    on, off = _asked(source, True), _asked(source, False)
    return ThinkingModes(thinking_of(source, True), thinking_of(source, False), on is not None and on != off)


class Split(NamedTuple):
    """What one :meth:`ThinkingSplit.feed` releases."""

    reasoning: str
    content: str


_BEFORE, _INSIDE, _AFTER = "before", "inside", "after"


class ThinkingSplit:
    """The thinking and the answer of one output, fed text deltas in order."""

    def __init__(self, thinking: Thinking) -> None:
        self.thinking = thinking
        self._state = _INSIDE if thinking.starts_open else _BEFORE
        self._held = ""
        self._trim = thinking.starts_open  # at the start of a part: its leading white space is dropped

    @property
    def within(self) -> bool:
        """Whether the output is inside its thinking now."""
        return self._state == _INSIDE

    @property
    def decided(self) -> bool:
        """Whether the thinking is over, or the output did not open one: the rest is all answer."""
        return self._state == _AFTER

    def feed(self, text: str) -> Split:
        """The thinking and the answer text that may be released now."""
        reasoning, content = "", ""
        text, self._held = self._held + text, ""
        open_, close = self.thinking.open, self.thinking.close
        while text:
            if self._state == _BEFORE:
                start = text.lstrip()
                if start.startswith(open_):
                    text, self._state, self._trim = start[len(open_) :], _INSIDE, True
                elif not start or open_.startswith(start):
                    self._held = text  # white space, or what may be the start of the tag
                    break
                else:  # no thinking: the answer as it came
                    self._state = _AFTER
            elif self._state == _INSIDE:
                if self._trim:
                    text = text.lstrip()
                    if not text:
                        break
                    self._trim = False
                at = text.find(close)
                if at >= 0:
                    reasoning += text[:at].rstrip()
                    text, self._state, self._trim = text[at + len(close) :], _AFTER, True
                    continue
                keep = _partial(text, close)
                body = text[: len(text) - keep]
                shown = body.rstrip()  # white space is held: it may be the last before the close
                reasoning += shown
                self._held = text[len(shown) :]
                break
            else:
                if self._trim:
                    text = text.lstrip()
                    if not text:
                        break
                    self._trim = False
                content += text
                break
        return Split(reasoning, content)

    def flush(self) -> Split:
        """The output ended: what is still held (a tag that never completed is text of the part it is in)."""
        held, self._held = self._held, ""
        return Split(held.rstrip(), "") if self._state == _INSIDE else Split("", held)


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[len(text) - k :]):
            return k
    return 0
