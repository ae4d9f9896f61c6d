"""Every field the OpenAI routes know, and what becomes of it: applied, passed as harmless, or taken only at the
value that changes nothing -- and every other field refused with a 400 naming it.

A client must never get a silently different answer: a field this server ignored would be one (``min_p`` sent to a
server that drops it samples otherwise than asked, and nothing says so).  So the routes take a field only when they
apply it (:data:`APPLIED`), when leaving it unapplied cannot change the answer (:data:`HARMLESS`: who the user is,
what to store, a cache key), or when it has the value that turns it off (:data:`NEUTRAL`: the extensions of vLLM's
and llama.cpp's servers that clients send with their defaults).  A field that is null is not given.  Everything
else -- an option of another server, a misspelt name -- is refused by name (OpenAI refuses an unknown field too:
"Unrecognized request argument supplied").  docs/API.md lists the three tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from edgepath.edge.apis.sampling import FIELDS as SAMPLING_FIELDS
from edgepath.edge.apis.sampling import show

Kind = Literal["completion", "chat"]


class FieldRefused(ValueError):
    """A field the route does not take (``code`` ``unknown_parameter``), or not with this value
    (``unsupported_parameter``): ``param`` names it, the message says what is allowed."""

    def __init__(self, param: str, message: str, code: str) -> None:
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


_COMMON = frozenset(
    {"model", "max_tokens", "stream", "stream_options", "stop", "n", "logprobs", "cache_salt", "ignore_eos"}
)
#: the fields each route applies (the sampling fields of :mod:`edgepath.edge.apis.sampling` among them)
APPLIED: Mapping[Kind, frozenset[str]] = {
    "completion": _COMMON | SAMPLING_FIELDS | {"prompt"},
    "chat": _COMMON
    | SAMPLING_FIELDS
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        # the thinking switched per request (edge/apis/thinking_fields.py)
        "chat_template_kwargs",
        "reasoning_effort",
    },
}

#: fields taken and not applied, because applying them cannot change the answer: who asks (``user``,
#: ``safety_identifier``), what the caller's own store keeps (``store``, ``metadata``), hints for caching and latency
#: (``prompt_cache_key``, ``service_tier``, ``prediction``: OpenAI's predicted outputs change the speed, not the
#: text; llama.cpp's ``cache_prompt``: this server reuses cached prefixes either way)
HARMLESS = frozenset(
    {"user", "metadata", "store", "safety_identifier", "prompt_cache_key", "service_tier", "prediction", "cache_prompt"}
)


@dataclass(frozen=True, slots=True)
class Neutral:
    """A field this server does not apply, taken when it changes nothing: at one of ``values`` (null always), or at
    any value while the field ``unless`` names is off (a setting of a sampler that is not on)."""

    values: tuple[Any, ...]
    allowed: str
    unless: str | None = None

    def passes(self, value: Any, doc: Mapping[str, Any]) -> bool:
        if any(_same(value, v) for v in self.values):
            return True
        if self.unless is None:
            return False
        switch = NEUTRAL_ANY.get(self.unless)
        on = doc.get(self.unless)
        return on is None or (switch is not None and any(_same(on, v) for v in switch.values))


def _off(values: tuple[Any, ...], allowed: str) -> Neutral:
    return Neutral(values, allowed)


def _while_off(switch: str) -> Neutral:
    return Neutral((), f"any value while '{switch}' is off", switch)


#: fields of both routes taken only when they change nothing: vLLM's and llama.cpp's extensions at their defaults
NEUTRAL_ANY: Mapping[str, Neutral] = {
    # OpenAI
    "verbosity": _off((), "null"),
    "web_search_options": _off((), "null (no web search)"),
    "echo": _off((False,), "false"),
    # vLLM (SamplingParams and its OpenAI server's extra fields)
    "use_beam_search": _off((False,), "false"),
    "length_penalty": _off((1,), "1 (no beam search)"),
    "stop_token_ids": _off(([],), "null or [] (give 'stop' strings)"),
    "include_stop_str_in_output": _off((False,), "false"),
    "min_tokens": _off((0,), "0"),
    "skip_special_tokens": _off((True,), "true"),
    "spaces_between_special_tokens": _off((True,), "true"),
    "truncate_prompt_tokens": _off((), "null (a prompt too long is refused)"),
    "allowed_token_ids": _off((), "null (give 'logit_bias')"),
    "prompt_logprobs": _off((), "null"),
    "bad_words": _off(([],), "null or [] (give 'logit_bias')"),
    "guided_json": _off((), "null (give 'response_format')"),
    "guided_regex": _off((), "null"),
    "guided_choice": _off((), "null"),
    "guided_grammar": _off((), "null"),
    "guided_decoding_backend": _off((), "null"),
    "guided_whitespace_pattern": _off((), "null"),
    "structural_tag": _off((), "null"),
    "logits_processors": _off((), "null"),
    "return_tokens_as_token_ids": _off((False,), "false"),
    "chat_template": _off((), "null (the model's own template, or the server's --chat-template)"),
    "mm_processor_kwargs": _off((), "null (text only)"),
    "kv_transfer_params": _off((), "null"),
    "vllm_xargs": _off((), "null"),
    # llama.cpp's server (tools/server/README.md)
    "typical_p": _off((1,), "1 (off)"),
    "repeat_last_n": _off((64,), "64 (the penalties count the last 64 tokens)"),
    "top_n_sigma": _off((-1,), "-1 (off)"),
    "mirostat": _off((0,), "0 (off)"),
    "mirostat_tau": _while_off("mirostat"),
    "mirostat_eta": _while_off("mirostat"),
    "dynatemp_range": _off((0,), "0 (off)"),
    "dynatemp_exponent": _while_off("dynatemp_range"),
    "xtc_probability": _off((0,), "0 (off)"),
    "xtc_threshold": _while_off("xtc_probability"),
    "dry_multiplier": _off((0,), "0 (off)"),
    "dry_base": _while_off("dry_multiplier"),
    "dry_allowed_length": _while_off("dry_multiplier"),
    "dry_penalty_last_n": _while_off("dry_multiplier"),
    "dry_sequence_breakers": _while_off("dry_multiplier"),
    "samplers": _off((), "null (the samplers run in llama-server's default order)"),
    "n_probs": _off((0,), "0 (give 'logprobs')"),
    "min_keep": _off((0,), "0"),
    "n_predict": _off((-1,), "-1 (give 'max_tokens')"),
    "n_keep": _off((0,), "0"),
    "t_max_predict_ms": _off((0,), "0"),
    "grammar": _off(("",), "null (give 'response_format')"),
    "json_schema": _off((), "null (give 'response_format')"),
    "post_sampling_probs": _off((False,), "false"),
    "return_tokens": _off((False,), "false"),
    "timings_per_token": _off((False,), "false"),
    "return_progress": _off((False,), "false"),
    "response_fields": _off((), "null"),
    "lora": _off(([],), "null or []"),
    "id_slot": _off((-1,), "-1"),
    "reasoning_format": _off((), "null"),
}
#: fields of one route only, taken when they change nothing (OpenAI's own, and vLLM's for chat)
NEUTRAL: Mapping[Kind, Mapping[str, Neutral]] = {
    "completion": {
        **NEUTRAL_ANY,
        "best_of": _off((1,), "1 (choices are not ranked: ask for several with 'n')"),
        "suffix": _off(("",), "null (no insertion mode)"),
        "reasoning_effort": _off((), "null (a prompt has no chat template to switch thinking in)"),
        "chat_template_kwargs": _off(({},), "null or {} (a prompt has no chat template)"),
    },
    "chat": {
        **NEUTRAL_ANY,
        "functions": _off(([],), "none (the deprecated form of 'tools': give 'tools')"),
        "function_call": _off(("none",), "'none' (deprecated: give 'tool_choice')"),
        "modalities": _off((["text"],), '["text"]'),
        "audio": _off((), "null (text only)"),
        "add_generation_prompt": _off((True,), "true"),
        "continue_final_message": _off((False,), "false"),
        "documents": _off((), "null"),
    },
}


def check_fields(doc: Mapping[str, Any], kind: Kind) -> None:
    """:class:`FieldRefused` for the first field of ``doc`` the ``kind`` route neither applies, nor takes as
    harmless, nor finds at a value that changes nothing."""
    applied, neutral = APPLIED[kind], NEUTRAL[kind]
    for name, value in doc.items():
        if value is None or name in applied or name in HARMLESS:
            continue
        rule = neutral.get(name)
        if rule is None:
            raise FieldRefused(
                name,
                f"Unrecognized request argument supplied: {show(name)} (this server applies or refuses every field "
                "it knows, by name, so that an answer is never silently other than asked; see its docs/API.md)",
                "unknown_parameter",
            )
        if not rule.passes(value, doc):
            raise FieldRefused(
                name,
                f"'{name}' = {show(value)} is not supported by this server; allowed: {rule.allowed}",
                "unsupported_parameter",
            )


def _same(value: Any, other: Any) -> bool:
    """JSON equality: a boolean is not a number (``True == 1`` in Python), a list equals a list of equal items."""
    if isinstance(value, bool) or isinstance(other, bool):
        return type(value) is type(other) and value == other
    if isinstance(value, list) and isinstance(other, list):
        return len(value) == len(other) and all(_same(a, b) for a, b in zip(value, other, strict=True))
    if isinstance(value, dict) and isinstance(other, dict):
        return value.keys() == other.keys() and all(_same(value[k], other[k]) for k in value)
    if isinstance(value, list | dict) or isinstance(other, list | dict):
        return False
    return bool(value == other)
