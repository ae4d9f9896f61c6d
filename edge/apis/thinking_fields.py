"""The fields of OpenAI's shapes that switch a reasoning model's thinking per request, sans I/O.

Three spellings ask one thing -- render the chat template with ``enable_thinking`` false, so a reasoning model's
template gives it an empty thinking block and it answers at once (:mod:`edgepath.edge.text.thinking`):

* ``chat_template_kwargs: {"enable_thinking": false}`` on the chat route: vLLM's and llama-server's field (both pass
  it to the template's renderer).  Only the ``enable_thinking`` key is taken, a boolean; any other key is a 400
  naming it (a template variable this server does not apply would change the prompt silently);
* ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses), OpenAI's: ``none`` turns the thinking off, and
  so does ``minimal`` (OpenAI: "few or no reasoning tokens" -- none is a case of it); ``low`` to ``max`` ask for a
  measure of thinking this server cannot set (the model thinks as it does), so they are a 400 naming the field.

Each gives True (think: the template's default), False (do not), or None (not asked).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgepath.edge.apis.sampling import show

#: the efforts that turn the thinking off; the others (OpenAI's ``low`` .. ``max``) are refused
OFF_EFFORTS = ("none", "minimal")
#: the keys of ``chat_template_kwargs`` applied (each a variable the template reads)
TEMPLATE_KEYS = ("enable_thinking",)
#: the keys of Responses' ``reasoning`` taken, each at null only but ``effort``
REASONING_KEYS = ("effort", "summary", "generate_summary", "context", "mode")


class ThinkingRefused(ValueError):
    """A thinking field this server cannot apply: ``param`` names it, the message says what is allowed."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def template_kwargs(raw: Any) -> bool | None:
    """``chat_template_kwargs``: its ``enable_thinking`` (None when not given); ThinkingRefused for another key."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ThinkingRefused("chat_template_kwargs", f"'chat_template_kwargs' must be an object, got {show(raw)}")
    for key in raw:
        if key not in TEMPLATE_KEYS:
            raise ThinkingRefused(
                f"chat_template_kwargs.{key}",
                f"chat_template_kwargs: the key {show(key)} is not applied by this server; allowed keys: "
                f"{', '.join(TEMPLATE_KEYS)} (true or false)",
            )
    enabled = raw.get("enable_thinking")
    if enabled is not None and not isinstance(enabled, bool):
        raise ThinkingRefused(
            "chat_template_kwargs.enable_thinking",
            f"'chat_template_kwargs.enable_thinking' must be true or false, got {show(enabled)}",
        )
    return enabled


def effort(value: Any, param: str) -> bool | None:
    """An OpenAI reasoning effort at ``param``: False for :data:`OFF_EFFORTS`, None when null; ThinkingRefused
    otherwise."""
    if value is None:
        return None
    if value in OFF_EFFORTS:
        return False
    raise ThinkingRefused(
        param,
        f"'{param}' = {show(value)} is not supported by this server (the served model thinks as it does: its effort "
        f"cannot be set); allowed: null, or {' or '.join(map(repr, OFF_EFFORTS))} (thinking turned off)",
    )


def chat_thinking(doc: Mapping[str, Any]) -> bool | None:
    """The chat route's switch: ``chat_template_kwargs.enable_thinking`` and ``reasoning_effort``, which must agree
    when both are given."""
    by_kwargs = template_kwargs(doc.get("chat_template_kwargs"))
    by_effort = effort(doc.get("reasoning_effort"), "reasoning_effort")
    if by_kwargs is not None and by_effort is not None and by_kwargs != by_effort:
        raise ThinkingRefused(
            "reasoning_effort",
            f"'reasoning_effort' = {show(doc['reasoning_effort'])} turns the thinking off and "
            "'chat_template_kwargs.enable_thinking' = true turns it on; give one of them",
        )
    return by_kwargs if by_kwargs is not None else by_effort


def reasoning(raw: Any) -> bool | None:
    """Responses' ``reasoning``: its ``effort`` (:func:`effort`); the summary, context and mode only at null (this
    server writes no summaries and has one mode)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ThinkingRefused("reasoning", f"'reasoning' must be an object {{\"effort\"?}}, got {show(raw)}")
    for key, value in raw.items():
        if key not in REASONING_KEYS:
            raise ThinkingRefused(
                f"reasoning.{key}", f"'reasoning.{key}' is not known; allowed keys: {', '.join(REASONING_KEYS)}"
            )
        if key != "effort" and value is not None:
            raise ThinkingRefused(
                f"reasoning.{key}",
                f"'reasoning.{key}' = {show(value)} is not supported by this server; allowed: null (no summaries: "
                "the thinking itself comes back, in the reasoning item)",
            )
    return effort(raw.get("effort"), "reasoning.effort")
