"""A reasoning model's thinking, split from its answer on the text stream, sans I/O.

Chat templates of reasoning models (Qwen3, the DeepSeek-R1 distillations) have the model think inside
``<think>…</think>`` before it answers.  Qwen3's template leaves the model to open the block itself; DeepSeek-R1's
ends the prompt with ``<think>\\n``, so the model's output starts inside the block and only its close comes back.
:func:`thinking_of` tells which from the template (:class:`Thinking`); :class:`ThinkingSplit` then takes the
detokenized text as it comes and gives back what is thinking and what is the answer, so every API shape puts the
thinking where its clients look for it (OpenAI chat's ``reasoning_content``, Anthropic's ``thinking`` block, a
Responses ``reasoning`` item) and never into the answer's text.

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


def thinking_of(source: str | None) -> Thinking | None:
    """The thinking of a chat template's model, None when the template has no thinking block: it must print the
    close tag (in earlier turns, or in the prompt it ends with); the prompt it renders for one user turn says
    whether the block is opened for the model."""
    if source is None or CLOSE not in source:
        return None
    try:
        prompt = ChatTemplate(source).render(
            [{"role": "user", "content": "?"}], add_generation_prompt=True, now=datetime(2000, 1, 1)
        )
    except (ChatTemplateError, RecursionError, TypeError):
        return Thinking()
    return Thinking(starts_open=prompt.rstrip().endswith(OPEN))


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
