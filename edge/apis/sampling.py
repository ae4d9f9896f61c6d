"""The sampling fields of a request body, for every route: one parser, one set of messages.

Both APIs take the same fields -- ``temperature``, ``top_p``, ``top_k``, ``seed``, ``min_p``, ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty`` (vLLM's name; llama.cpp's ``repeat_penalty`` is taken as the same)
and ``logit_bias`` -- and refuse a bad one the same way: 400 naming the field and what is allowed
(:class:`SamplingInvalid`; each route puts it in its own error shape).  What is parsed is one
:class:`~edgepath.contract.wire.Sampling`, the value that travels to the model side unchanged (the request header,
and the words after the prompt for the logit biases).  Only the defaults differ by route (OpenAI's temperature is 1,
edgepath's ``/v1/generate`` is greedy), so each route passes its own.

A request that samples (temperature above 0) and names no ``seed`` gets a fresh one, drawn from the source the
route passes in (:func:`fresh_seed`: the OS's), as OpenAI and llama-server draw one per request: the same question
asked twice is sampled twice.  A given seed gives the same answer again, from the same model and build
(``system_fingerprint`` names them).  Greedy needs none.

A new sampling parameter is a field of ``Sampling`` (and of the request header it travels in), one entry of
:data:`RULES` here and its use on the model side; ``tests/edge/test_edge_sampling.py`` fails until
:data:`RULES` covers every field of ``Sampling``.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from edgepath.contract.wire import BIAS_MAX, LOGIT_BIAS_MAX, PENALTY_MAX, REPETITION_MAX, LogitBias, Sampling
from edgepath.edge.apis.limits import LimitExceeded, check_stops

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's documented range for seed (int64)
TOP_K_MAX = 2**31 - 1  # the request header's top_k is an int32


class SamplingInvalid(ValueError):
    """A sampling field's value is not allowed: ``param`` names the field, the message what is allowed."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def is_number(value: Any) -> bool:
    """A finite JSON number (a boolean is not one)."""
    return type(value) in (int, float) and math.isfinite(value)


def show(value: Any) -> str:
    """A short JSON rendering of a client's value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fresh_seed() -> int:
    """A seed for a request that names none: 64 bits from the OS's random source."""
    return secrets.randbits(64)


def _number(name: str, low: float, high: float, *, low_open: bool) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if is_number(value) and (low < value if low_open else low <= value) and value <= high:
            return float(value)
        bracket = "(" if low_open else "["
        raise SamplingInvalid(name, f"'{name}' must be a number in {bracket}{low:g}, {high:g}], got {show(value)}")

    return parse


def _top_k(value: Any) -> int:
    if type(value) is int and 0 <= value <= TOP_K_MAX:
        return value
    raise SamplingInvalid("top_k", f"'top_k' must be an integer in 0..{TOP_K_MAX} (0: off), got {show(value)}")


def _seed(value: Any) -> int:
    """OpenAI's seed (an int64) as the request header carries it: its two's-complement u64."""
    if type(value) is int and SEED_MIN <= value <= SEED_MAX:
        return value % 2**64
    raise SamplingInvalid("seed", f"'seed' must be an integer in {SEED_MIN}..{SEED_MAX}, got {show(value)}")


def _logit_bias(value: Any) -> LogitBias:
    """OpenAI's ``logit_bias``: an object mapping token ids (JSON keys are strings: "50256") to a number in
    [-100, 100], added to the token's logit before sampling; at most :data:`LOGIT_BIAS_MAX` entries.  As pairs,
    ids ascending (the vocabulary's bound is checked by :func:`parse_sampling`)."""
    shape = f'an object of at most {LOGIT_BIAS_MAX} token ids (as strings: {{"50256": -100}}) to numbers in [-100, 100]'
    if not isinstance(value, dict):
        raise SamplingInvalid("logit_bias", f"'logit_bias' must be {shape}, got {show(value)}")
    if len(value) > LOGIT_BIAS_MAX:
        raise SamplingInvalid("logit_bias", f"'logit_bias' has {len(value)} entries; at most {LOGIT_BIAS_MAX}")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10):
            raise SamplingInvalid("logit_bias", f"'logit_bias' key {show(key)} is not a token id; it must be {shape}")
        token = int(key)
        if token in pairs:
            raise SamplingInvalid("logit_bias", f"'logit_bias' names token {token} twice ({show(key)})")
        if not (is_number(bias) and -BIAS_MAX <= bias <= BIAS_MAX):
            raise SamplingInvalid(
                "logit_bias", f"'logit_bias' of token {token} must be a number in [-100, 100], got {show(bias)}"
            )
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


#: every sampling field a body may carry (the names of ``Sampling``'s fields), each with its parser
RULES: Mapping[str, Callable[[Any], Any]] = {
    "temperature": _number("temperature", 0.0, 2.0, low_open=False),
    "top_p": _number("top_p", 0.0, 1.0, low_open=True),
    "top_k": _top_k,
    "seed": _seed,
    "min_p": _number("min_p", 0.0, 1.0, low_open=False),
    "presence_penalty": _number("presence_penalty", -PENALTY_MAX, PENALTY_MAX, low_open=False),
    "frequency_penalty": _number("frequency_penalty", -PENALTY_MAX, PENALTY_MAX, low_open=False),
    "repetition_penalty": _number("repetition_penalty", 0.0, REPETITION_MAX, low_open=True),
    "logit_bias": _logit_bias,
}
#: other names of those fields: llama.cpp's ``repeat_penalty`` is vLLM's ``repetition_penalty`` (both names may
#: be given when they agree)
ALIASES: Mapping[str, tuple[str, Callable[[Any], Any]]] = {
    "repeat_penalty": ("repetition_penalty", _number("repeat_penalty", 0.0, REPETITION_MAX, low_open=True)),
}
FIELDS = frozenset(RULES) | frozenset(ALIASES)

#: OpenAI's defaults (temperature 1); a field not given (or null) keeps its default
OPENAI_DEFAULT = Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=0)
#: ``/v1/generate``'s defaults: greedy
GENERATE_DEFAULT = Sampling()


def parse_sampling(
    doc: Mapping[str, Any],
    default: Sampling,
    *,
    vocab_size: int | None = None,
    seeds: Callable[[], int] = fresh_seed,
) -> Sampling:
    """The sampling a request body asks for, on top of ``default``; :class:`SamplingInvalid` for a bad field (a
    logit bias on a token id at or above ``vocab_size`` among them; None: the route takes no logit bias).  A request
    that samples without a ``seed`` gets one from ``seeds``."""
    sampling = default
    if not FIELDS.isdisjoint(doc):  # most requests name none: no per-field look-ups
        given = {name: parse(doc[name]) for name, parse in RULES.items() if doc.get(name) is not None}
        for alias, (name, parse) in ALIASES.items():
            if doc.get(alias) is None:
                continue
            value = parse(doc[alias])
            if given.setdefault(name, value) != value:
                raise SamplingInvalid(
                    alias, f"'{alias}' ({show(doc[alias])}) and '{name}' ({show(doc[name])}) disagree; give one of them"
                )
        bias = given.get("logit_bias", ())
        if bias and vocab_size is None:
            raise SamplingInvalid("logit_bias", "'logit_bias' is not taken on this route")
        if bias and vocab_size is not None and bias[-1][0] >= vocab_size:
            raise SamplingInvalid(
                "logit_bias", f"'logit_bias' names token {bias[-1][0]}; this model's token ids are 0..{vocab_size - 1}"
            )
        sampling = replace(default, **given) if given else default
    if sampling.temperature > 0.0 and doc.get("seed") is None:
        sampling = replace(sampling, seed=seeds())
    return sampling


#: the longest ``cache_salt`` a request may give, in UTF-8 bytes
CACHE_SALT_MAX = 256


def parse_cache_salt(doc: Mapping[str, Any]) -> str | None:
    """A request's ``cache_salt`` field: a non-empty string of at most :data:`CACHE_SALT_MAX` UTF-8 bytes, or None
    when absent (or null).  :class:`SamplingInvalid` (naming the field) otherwise."""
    value = doc.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SamplingInvalid("cache_salt", f"'cache_salt' must be a non-empty string, got {show(value)}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise SamplingInvalid(
            "cache_salt", "'cache_salt' holds an unpaired surrogate escape, which is not valid UTF-8"
        ) from None
    if size > CACHE_SALT_MAX:
        raise SamplingInvalid("cache_salt", f"'cache_salt' must be at most {CACHE_SALT_MAX} bytes, got {size}")
    return value


def parse_stops(value: Any, param: str, most: int, *, single: bool) -> tuple[str, ...]:
    """Stop strings as a request gives them (``single``: one string is taken for a list of one, as OpenAI's
    ``stop``; Anthropic's ``stop_sequences`` is a list): at most ``most`` non-empty strings of valid UTF-8, or
    :class:`SamplingInvalid` naming ``param``.  None is no stop string."""
    if value is None:
        return ()
    stops = [value] if single and isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > most or not all(isinstance(s, str) and s for s in stops):
        shape = "a non-empty string or a list" if single else "a list"
        raise SamplingInvalid(
            param, f"'{param}' must be {shape} of at most {most} non-empty strings, got {show(value)}"
        )
    try:
        check_stops(tuple(stops), param)  # each one's length and all together (edge/apis/limits.py)
    except LimitExceeded as exc:
        raise SamplingInvalid(param, exc.message) from None
    for s in stops:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise SamplingInvalid(
                param, f"'{param}' holds an unpaired surrogate escape, which is not valid UTF-8"
            ) from None
    return tuple(stops)
