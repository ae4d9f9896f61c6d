"""OpenAI-compatible API core: request validation, refused options, error shapes, response and stream
builders.  Shapes are checked against the real ``openai`` client, fed our bytes through httpx's
MockTransport (the transport is the only stand-in: the client's own parsing runs)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from helpers.openai_mock import client_answering
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.contract import wire
from edgepath.contract.wire import Sampling
from edgepath.edge.apis.limits import MESSAGES_MAX, STOP_CHARS_MAX, STOP_TOTAL_MAX
from edgepath.edge.apis.openai import (
    SSE_DONE,
    OpenAIError,
    OpenAILimits,
    OpenAIRequest,
    invalid_request,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
    sse_event,
)
from edgepath.edge.apis.openai_answers import (
    Answer,
    AnswerStep,
    StreamEncoder,
    Usage,
    chat_completion,
    completion_body,
    models_list,
    response_id,
    text_completion,
)
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes, formatter_factory
from edgepath.edge.apis.sampling import show
from edgepath.edge.http import CHAT, COMPLETIONS, HttpError, Limits, Outcome, Request, Work, body_too_large
from edgepath.edge.routes import HttpCore
from edgepath.edge.tenancy.auth import ApiKeys
from edgepath.edge.text.chat import ChatMessage

MODEL = "smollm2-135m"
LIMITS = OpenAILimits(max_tokens=256, vocab_size=1000, models=(MODEL, "echo"))
#: the seed a request that samples without one gets here (the server draws one: tests/edge/test_edge_sampling.py)
DRAWN = 1234


def completion(**fields: Any) -> OpenAIRequest:
    return parse_completion_request({"model": MODEL, "prompt": "hi", **fields}, LIMITS, lambda: DRAWN)


def chat(**fields: Any) -> OpenAIRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(body, LIMITS, lambda: DRAWN)


def refused(parse: Any, **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(**fields)
    return info.value


# -- requests -------------------------------------------------------------------------------------------


def test_minimal_completion_gets_the_defaults() -> None:
    assert completion() == OpenAIRequest(
        kind="completion", model=MODEL, max_tokens=256, sampling=Sampling(1.0, 1.0, seed=DRAWN), prompt="hi"
    )


def test_full_completion_from_json_bytes() -> None:
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": ["Once upon"],
            "max_tokens": 32,
            "temperature": 0,
            "top_p": 0.9,
            "seed": -7,
            "stop": ["\n\n", "END"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "someone",
            "n": 1,
            "best_of": 1,
            "echo": False,
            "logprobs": None,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "metadata": {"harmless": True},
        }
    ).encode()
    req = parse_completion_request(body, LIMITS)
    assert req == OpenAIRequest(
        kind="completion",
        model=MODEL,
        max_tokens=32,
        sampling=Sampling(temperature=0.0, top_p=0.9, seed=2**64 - 7),  # int64 -7 as the header's u64
        stop=("\n\n", "END"),
        stream=True,
        include_usage=True,
        prompt="Once upon",
    )
    assert isinstance(req.sampling.temperature, float)


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("plain", "plain", None),
        (["one"], "one", None),
        ([5, 6, 999], None, (5, 6, 999)),
        ([[0, 1]], None, (0, 1)),
    ],
)
def test_completion_prompt_forms(prompt: Any, text: str | None, ids: tuple[int, ...] | None) -> None:
    req = completion(prompt=prompt)
    assert (req.prompt, req.prompt_ids) == (text, ids)


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        (None, "'prompt' is required"),
        ("", "'prompt' is empty"),
        ([], "'prompt' must be"),
        (["a", "b"], "holds 2 prompts; this server takes one prompt per request"),
        ([[1], [2]], "holds 2 prompts"),
        ([1, "a"], "'prompt' must be"),
        ([True, 2], "'prompt' must be"),
        ([1, 1000], "token id 1000; ids must be in 0..999"),
        ([-1], "token id -1"),
        ({"text": "x"}, "'prompt' must be"),
        ("bad \udc80 surrogate", "unpaired surrogate"),
    ],
)
def test_bad_completion_prompts(prompt: Any, needle: str) -> None:
    err = refused(completion, prompt=prompt)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "prompt")
    assert needle in err.message


def test_missing_prompt_key() -> None:
    with pytest.raises(OpenAIError, match="'prompt' is required") as info:
        parse_completion_request({"model": MODEL}, LIMITS)
    assert info.value.code == "missing_required_parameter"


def test_chat_messages_string_and_text_parts() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "Be brief.", "name": "ignored"},
            {"role": "user", "content": [{"type": "text", "text": "Part one"}, {"type": "text", "text": "東京 🚀"}]},
            {"role": "assistant", "content": "ok", "tool_calls": []},
            {"role": "user", "content": ""},
        ],
        max_completion_tokens=10,
    )
    assert req.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Part one\n東京 🚀"),
        ChatMessage("assistant", "ok"),
        ChatMessage("user", ""),
    )
    assert (req.kind, req.max_tokens, req.prompt, req.prompt_ids) == ("chat", 10, None, None)


@pytest.mark.parametrize(
    ("messages", "param", "needle"),
    [
        (None, "messages", "non-empty list"),
        ([], "messages", "non-empty list"),
        ("hi", "messages", "non-empty list"),
        (["hi"], "messages[0]", "must be an object"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id", "must name the call this result answers"),
        ([{"role": "developer", "content": "x"}], "messages[0].role", "allowed: system, user, assistant, tool"),
        ([{"content": "x"}], "messages[0].role", "null is not supported"),
        ([{"role": "user"}], "messages[0].content", "string or a list of text parts"),
        ([{"role": "user", "content": 3}], "messages[0].content", "string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}],
            "messages[0].content[1]",
            "only text parts are supported",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]", "only text parts"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
            "messages[1].tool_calls[0]",
            '"function": {"name": str, "arguments": str (JSON)}',
        ),
    ],
)
def test_bad_chat_messages_name_the_exact_place(messages: Any, param: str, needle: str) -> None:
    err = refused(chat, messages=messages)
    assert (err.status, err.param) == (400, param)
    assert needle in err.message


def test_max_tokens_bounds_and_the_chat_alias() -> None:
    assert completion(max_tokens=1).max_tokens == 1
    assert completion(max_tokens=None).max_tokens == 256
    assert chat(max_tokens=20).max_tokens == 20
    assert chat(max_tokens=20, max_completion_tokens=20).max_tokens == 20
    err = refused(chat, max_tokens=20, max_completion_tokens=30)
    assert err.param == "max_completion_tokens" and "disagree" in err.message
    for bad in (0, 257, 1.0, True, "5", -1):
        err = refused(completion, max_tokens=bad)
        assert err.param == "max_tokens" and "1..256" in err.message
    assert refused(chat, max_completion_tokens=0).param == "max_completion_tokens"


def test_sampling_ranges() -> None:
    assert chat(temperature=2, top_p=1, seed=0).sampling == Sampling(temperature=2.0, top_p=1.0, seed=0)
    assert chat(temperature=0.0, top_p=1e-9, seed=2**63 - 1).sampling == Sampling(0.0, 1e-9, seed=2**63 - 1)
    assert chat(seed=-(2**63)).sampling.seed == 2**63  # the most negative int64, as the header's u64
    for bad in (-0.1, 2.01, "1", True, [1]):
        err = refused(chat, temperature=bad)
        assert err.param == "temperature" and "[0, 2]" in err.message
    for bad in (0, -0.5, 1.5, False):
        err = refused(chat, top_p=bad)
        assert err.param == "top_p" and "(0, 1]" in err.message
    for bad in (2**63, -(2**63) - 1, 1.5, True, "7"):
        assert refused(chat, seed=bad).param == "seed"


def test_non_finite_numbers_are_refused() -> None:
    body = b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}'
    with pytest.raises(OpenAIError, match="'temperature' must be a number") as info:
        parse_completion_request(body, LIMITS)
    assert info.value.param == "temperature"
    with pytest.raises(OpenAIError, match="'top_p'"):
        parse_completion_request(b'{"model": "smollm2-135m", "prompt": "x", "top_p": Infinity}', LIMITS)


def test_stop_forms() -> None:
    assert completion(stop="\n").stop == ("\n",)
    assert completion(stop=["a", "b", "c", "d"]).stop == ("a", "b", "c", "d")
    assert completion(stop=[]).stop == ()
    assert completion(stop=None).stop == ()
    for bad in ("", [""], ["a", "b", "c", "d", "e"], [1], {"a": 1}, ["ok", None]):
        err = refused(completion, stop=bad)
        assert err.param == "stop" and "at most 4 non-empty strings" in err.message


@pytest.mark.parametrize(
    ("stop", "says"),
    [
        (["x" * (STOP_CHARS_MAX + 1)], f"a string of {STOP_CHARS_MAX + 1} characters; each may have at most"),
        (["x" * STOP_CHARS_MAX] * 2 + ["y"], f"{2 * STOP_CHARS_MAX + 1} characters in all"),
    ],
)
def test_stop_strings_past_their_limits_are_a_400_naming_the_limit(stop: list[str], says: str) -> None:
    """A stop string's cost is bounded before the request is admitted: one of 32,000 characters cost the edge
    590 MB with the old prefix set (issue 49); now its length and the total are limits."""
    assert STOP_TOTAL_MAX < 2 * STOP_CHARS_MAX + 1
    err = refused(completion, stop=stop)
    assert (err.status, err.param) == (400, "stop") and says in err.message
    assert completion(stop=["x" * STOP_CHARS_MAX, "y" * (STOP_TOTAL_MAX - STOP_CHARS_MAX)]).stop


def test_a_chat_of_more_messages_than_the_limit_is_a_400_before_any_is_read() -> None:
    err = refused(chat, messages=[{"role": "user", "content": ""}] * (MESSAGES_MAX + 1))
    assert (err.status, err.param, err.code) == (400, "messages", "limit_exceeded")
    assert f"holds {MESSAGES_MAX + 1} messages; at most {MESSAGES_MAX}" in err.message
    assert len(chat(messages=[{"role": "user", "content": ""}] * MESSAGES_MAX).messages or ()) == MESSAGES_MAX


def test_stream_and_stream_options() -> None:
    assert chat(stream=True).include_usage is False
    options = {"include_usage": False, "include_obfuscation": True}
    assert chat(stream=True, stream_options=options).include_usage is False
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert chat(stream=False, stream_options=None).stream is False
    err = refused(chat, stream=False, stream_options={"include_usage": True})
    assert err.param == "stream_options" and "only allowed when 'stream' is true" in err.message
    assert refused(chat, stream="yes").param == "stream"
    assert refused(chat, stream=True, stream_options=[1]).param == "stream_options"
    err = refused(chat, stream=True, stream_options={"include_usage": "yes"})
    assert err.param == "stream_options.include_usage"


@pytest.mark.parametrize(
    ("kind", "name", "value"),
    [
        ("completion", "best_of", 2),
        ("completion", "echo", True),
        ("completion", "suffix", "tail"),
        ("chat", "functions", [{"name": "f"}]),
        ("chat", "function_call", "auto"),
        ("chat", "response_format", {"type": "json_object"}),
        ("chat", "modalities", ["text", "audio"]),
        ("chat", "audio", {"voice": "alloy", "format": "mp3"}),
        ("chat", "reasoning_effort", "high"),
        ("completion", "use_beam_search", True),
        ("completion", "min_tokens", 5),
        ("chat", "stop_token_ids", [2]),
        ("chat", "typical_p", 0.9),
        ("completion", "mirostat", 2),
        ("chat", "dry_multiplier", 0.8),
        ("chat", "repeat_last_n", 128),
        ("completion", "n_probs", 3),
        ("chat", "samplers", ["top_k"]),
        ("completion", "grammar", 'root ::= "a"'),
        ("chat", "echo", 1),  # a number is not false
    ],
)
def test_options_that_change_the_answer_are_refused_by_name(kind: str, name: str, value: Any) -> None:
    err = refused(completion if kind == "completion" else chat, **{name: value})
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", name, "unsupported_parameter")
    assert err.message.startswith(f"'{name}' = ")
    assert "allowed:" in err.message


def test_n_asks_for_choices_up_to_the_slots_a_request_may_hold() -> None:
    four = OpenAILimits(max_tokens=256, vocab_size=1000, models=(MODEL,), choices=4)
    body = {"model": MODEL, "prompt": "hi"}
    assert parse_completion_request({**body, "n": 4}, four).n == 4
    assert (
        parse_chat_request({**body, "prompt": None, "messages": [{"role": "user", "content": "hi"}], "n": 2}, four).n
        == 2
    )
    assert completion().n == completion(n=None).n == completion(n=1).n == 1
    for bad in (0, -1, 5, 2.0, 1.5, True, "2", [2]):
        with pytest.raises(OpenAIError) as info:
            parse_completion_request({**body, "n": bad}, four)
        err = info.value
        assert (err.status, err.param, err.code) == (400, "n", "invalid_value")
        assert err.message.startswith("'n' must be an integer in 1..4 (") and err.message.endswith(f"got {show(bad)}")
    err = refused(chat, n=2)  # limits of one choice
    assert (err.param, err.code) == ("n", "invalid_value") and "in 1..1 (" in err.message


#: llama.cpp's web UI sends its samplers' defaults: the ones that are off pass, with their settings
LLAMA_CPP_DEFAULTS = {
    "typical_p": 1, "repeat_last_n": 64, "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": -1, "xtc_probability": 0, "xtc_threshold": 0.1, "dynatemp_range": 0, "dynatemp_exponent": 1,
    "timings_per_token": False, "samplers": None, "min_keep": 0,
}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("chat", {"n": 1, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none"}),
        ("chat", {"response_format": {"type": "text"}, "modalities": ["text"], "audio": None, "logit_bias": None}),
        ("completion", {"best_of": 1, "echo": False, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0.0}),
        ("chat", {"metadata": {"a": "b"}, "store": False, "user": "u", "parallel_tool_calls": True}),
        ("chat", {"safety_identifier": "s", "prompt_cache_key": "k", "service_tier": "auto", "cache_prompt": False}),
        ("chat", LLAMA_CPP_DEFAULTS),
        # vLLM's extra fields at their defaults
        ("completion", {"use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True, "min_tokens": 0}),
        ("chat", {"add_generation_prompt": True, "continue_final_message": False, "echo": False, "bad_words": []}),
        ("chat", {"unheard_of": None, "best_of": None}),  # null is not given, whatever the name
    ],
)
def test_harmless_fields_and_extensions_that_are_off_pass(kind: str, fields: dict[str, Any]) -> None:
    req = (completion if kind == "completion" else chat)(**fields)
    assert req.kind == kind


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("chat", "x-new"),
        ("completion", "some_future_option"),
        ("chat", "best_of"),  # the completions route's, not chat's
        ("chat", "suffix"),
        ("completion", "messages"),
        ("completion", "tools"),
        ("chat", "temprature"),
    ],
)
def test_a_field_the_route_does_not_know_is_refused_by_name(kind: str, name: str) -> None:
    """Never silently ignored: an option of another server, another route's, a misspelt one."""
    err = refused(completion if kind == "completion" else chat, **{name: 1})
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", name, "unknown_parameter")
    assert err.message.startswith(f'Unrecognized request argument supplied: "{name}"')


def test_ignore_eos_is_applied_as_a_request_flag() -> None:
    """vLLM's and llama.cpp's ``ignore_eos`` (load generators send it for answers of a set length)."""
    assert chat(ignore_eos=True).ignore_eos and not chat(ignore_eos=False).ignore_eos and not chat().ignore_eos
    err = refused(completion, ignore_eos="yes")
    assert (err.param, err.code) == ("ignore_eos", "invalid_type")
    routes = OpenAIRoutes(MODEL, 8, 1000, ChatSupport(False, "no template"), 0)
    work = routes.parse(COMPLETIONS, json.dumps({"model": MODEL, "prompt": "hi", "ignore_eos": True}).encode())
    assert isinstance(work, Work) and work.flags & wire.FLAG_IGNORE_EOS
    plain = routes.parse(COMPLETIONS, json.dumps({"model": MODEL, "prompt": "hi"}).encode())
    assert isinstance(plain, Work) and not plain.flags & wire.FLAG_IGNORE_EOS


def test_a_setting_of_a_sampler_that_is_on_is_refused_with_the_sampler() -> None:
    assert chat(mirostat=0, mirostat_tau=3.0).kind == "chat"  # off: its settings change nothing
    err = refused(chat, mirostat=2, mirostat_tau=3.0)
    assert (err.param, err.code) == ("mirostat", "unsupported_parameter")
    err = refused(chat, mirostat_tau=3.0, mirostat=2)  # the setting comes first: refused, naming the switch
    assert (err.param, err.code) == ("mirostat_tau", "unsupported_parameter")
    assert "allowed: any value while 'mirostat' is off" in err.message


def test_model_is_required_and_must_be_served() -> None:
    with pytest.raises(OpenAIError) as info:
        parse_chat_request({"messages": [{"role": "user", "content": "x"}]}, LIMITS)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "model", "missing_required_parameter")
    assert "'smollm2-135m', 'echo'" in err.message
    err = refused(chat, model="gpt-4o")
    assert (err.status, err.type, err.param, err.code) == (404, "invalid_request_error", "model", "model_not_found")
    assert "'gpt-4o'" in err.message and "'echo'" in err.message
    assert refused(chat, model=7).code == "invalid_type"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\xff\xfe{}", "not valid UTF-8 (byte 0)"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got array"),
        (b"null", "must be a JSON object, got null"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests JSON too deeply"),
    ],
)
def test_bad_bodies(body: bytes, needle: str) -> None:
    for parse in (parse_completion_request, parse_chat_request):
        with pytest.raises(OpenAIError) as info:
            parse(body, LIMITS)
        assert info.value.status == 400 and needle in info.value.message


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="OpenAILimits"):
        OpenAILimits(max_tokens=0, vocab_size=10, models=("m",))
    with pytest.raises(ValueError, match="OpenAILimits"):
        OpenAILimits(max_tokens=1, vocab_size=10, models=())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)
field_names = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "echo",
        "suffix",
        "tools",
        "tool_choice",
        "response_format",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
    ]
)


@settings(max_examples=300, deadline=None)
@given(fields=st.dictionaries(field_names, json_values, max_size=8), with_model=st.booleans())
def test_any_json_object_is_accepted_or_refused_in_openai_shape(fields: dict[str, Any], with_model: bool) -> None:
    if with_model:
        fields["model"] = MODEL
    for parse in (parse_completion_request, parse_chat_request):
        try:
            req = parse(fields, LIMITS)
        except OpenAIError as err:
            assert err.status in (400, 404)
            assert set(err.payload()["error"]) == {"message", "type", "param", "code"}
            json.loads(err.body())
        else:
            assert 1 <= req.max_tokens <= LIMITS.max_tokens
            assert 0 <= req.sampling.temperature <= 2 and 0 < req.sampling.top_p <= 1
            assert len(req.stop) <= 4 and all(req.stop)
            assert [req.prompt, req.prompt_ids, req.messages].count(None) == 2


# -- errors ---------------------------------------------------------------------------------------------


SERVED = "echo"


def openai_core(keys: ApiKeys | None = None) -> HttpCore:
    """The HTTP core with the OpenAI routes, as ``serve`` builds it."""
    limits = Limits(max_body=64, input_capacity=8, output_capacity=8, vocab_size=100)
    return HttpCore(limits, keys, OpenAIRoutes(SERVED, 8, 100, ChatSupport(False, "no template"), 0))


def test_every_error_on_the_openai_routes_is_one_of_openais() -> None:
    """One error path: the routes' own validation and every refusal or failure of the edge (the same errors
    /v1/generate answers in edgepath's shape) are OpenAI errors whose type follows from the status and whose
    code is the error's own name."""
    core = openai_core()
    with pytest.raises(HttpError) as too_long:
        core.limits.check_length(9)
    cases = [
        (OpenAIError.of(core.refusals.no_slot()), 429, "requests", "no_slot", "does not queue"),
        (OpenAIError.of(core.refusals.busy()), 429, "requests", "tokenizer_busy", "tokenizer worker"),
        (OpenAIError.of(body_too_large(100, 64)), 413, "invalid_request_error", "body_too_large", "100 bytes"),
        (OpenAIError.of(too_long.value), 400, "invalid_request_error", "prompt_too_long", "9 tokens"),
        (
            OpenAIError.of(HttpError(500, "tokenizer_error", "it broke")),
            500,
            "server_error",
            "tokenizer_error",
            "broke",
        ),
        (OpenAIError.of(HttpError(502, "slot_error", "status X")), 502, "server_error", "slot_error", "status X"),
        (OpenAIError.of(HttpError(503, "unavailable", "gone")), 503, "server_error", "unavailable", "gone"),
        (OpenAIError.of(HttpError(504, "timeout", "late")), 504, "timeout", "timeout", "late"),
        (model_not_found("x", ["a"]), 404, "invalid_request_error", "model_not_found", "'x'"),
        (invalid_request("no", param="p", code="invalid_value"), 400, "invalid_request_error", "invalid_value", "no"),
    ]
    for err, status, type_, code, needle in cases:
        body = json.loads(err.body())
        assert list(body) == ["error"]
        assert body["error"] == {"message": err.message, "type": type_, "param": err.param, "code": code}
        assert err.status == status and needle in err.message
    assert OpenAIError.of(core.refusals.no_slot()).headers == [(b"retry-after", b"1")]
    stream_end = OpenAIError.of(HttpError(502, "slot_error", "status X")).event()
    assert stream_end.endswith(SSE_DONE) and json.loads(stream_end[6 : -len(SSE_DONE)])["error"]["code"] == "slot_error"


def test_the_core_answers_openai_paths_in_openais_shape_and_its_own_paths_in_edgepaths() -> None:
    core = openai_core(ApiKeys(["k"]))
    denied = core.handle(Request("POST", "/v1/completions", [], b"{}", 0))
    assert denied.status == 401 and (b"www-authenticate", b"Bearer") in denied.headers
    assert json.loads(denied.body)["error"] == {
        "message": "API key is missing: send it as 'x-api-key: KEY' or 'Authorization: Bearer KEY'",
        "type": "authentication_error",
        "param": None,
        "code": "unauthorized",
    }
    key = [(b"x-api-key", b"k")]
    wrong_method = core.handle(Request("GET", "/v1/chat/completions", key, b"", 0))
    assert wrong_method.status == 405 and json.loads(wrong_method.body)["error"]["code"] == "method_not_allowed"
    big = core.refusal("/v1/completions?x=1", body_too_large(100, 64))  # an adapter's early 413 on an OpenAI route
    assert json.loads(big.body)["error"]["type"] == "invalid_request_error"
    own = core.refusal("/v1/generate", body_too_large(100, 64))
    assert json.loads(own.body) == {"error": {"type": "body_too_large", "message": body_too_large(100, 64).message}}


# -- responses ------------------------------------------------------------------------------------------


def test_ids_come_from_the_request_id() -> None:
    assert response_id("completion", 42) == "cmpl-42"
    assert response_id("chat", "a1-b_2") == "chatcmpl-a1-b_2"
    for bad in ("", "a b", "x/y", "é"):
        with pytest.raises(ValueError, match="request id"):
            response_id("chat", bad)


def test_text_completion_exact_shape() -> None:
    assert text_completion(7, 1700000000, MODEL, "Hello 東京", "length", Usage(3, 4)) == {
        "id": "cmpl-7",
        "object": "text_completion",
        "created": 1700000000,
        "model": MODEL,
        "system_fingerprint": None,
        "choices": [{"text": "Hello 東京", "index": 0, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


def test_chat_completion_exact_shape() -> None:
    assert chat_completion(8, 1700000001, MODEL, "Hi!", "stop", Usage(10, 2)) == {
        "id": "chatcmpl-8",
        "object": "chat.completion",
        "created": 1700000001,
        "model": MODEL,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi!", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }
    with pytest.raises(ValueError, match="finish_reason"):
        chat_completion(8, 0, MODEL, "", "cancelled", Usage(0, 0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        Usage(-1, 0)


def test_the_servers_fingerprint_is_in_every_answer_and_chunk() -> None:
    """``system_fingerprint`` names the model and build that answered (edgepath/builder.py's serve_fingerprint)."""
    limits = OpenAILimits(max_tokens=8, vocab_size=1000, models=(MODEL,), fingerprint="fp_0123456789ab")
    body = {"model": MODEL, "prompt": "hi"}
    request = parse_completion_request(body, limits)
    assert request.fingerprint == "fp_0123456789ab"
    whole = json.loads(completion_body(request, 1, 0, "x", "stop", Usage(1, 1)))
    assert whole["system_fingerprint"] == "fp_0123456789ab"
    streamed = parse_completion_request({**body, "stream": True, "stream_options": {"include_usage": True}}, limits)
    enc = StreamEncoder.for_request(streamed, 1, 0)
    chunks = events(enc.start() + enc.text("x") + enc.finish("stop") + enc.end(Usage(1, 1)))[:-1]
    assert len(chunks) == 3 and {c["system_fingerprint"] for c in chunks} == {"fp_0123456789ab"}
    assert parse_completion_request(body, LIMITS).fingerprint is None  # not known: null, as before


def test_usage_reports_cached_prompt_tokens_as_openai_does() -> None:
    assert Usage(10, 2, 6).payload() == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 6},
    }
    assert "prompt_tokens_details" not in Usage(10, 2).payload()  # not known: left out, not reported as 0
    with pytest.raises(ValueError, match="cached tokens must be between 0 and the prompt's tokens"):
        Usage(3, 1, 4)


def test_models_list_and_sse_framing() -> None:
    assert models_list([MODEL], 5) == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 5, "owned_by": "edgepath"}],
    }
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def events(stream: bytes) -> list[Any]:
    """Parse SSE bytes: JSON payloads, and the string "[DONE]"."""
    assert stream.endswith(b"\n\n")
    out = []
    for block in stream.decode().split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat_stream(deltas: list[str], include_usage: bool, reason: str = "stop") -> bytes:
    enc = StreamEncoder("chat", 9, 100, MODEL, include_usage)
    return (
        enc.start()
        + b"".join(enc.text(d) for d in deltas)
        + enc.finish(reason)  # type: ignore[arg-type]
        + enc.end(Usage(5, len(deltas)))
    )


def test_chat_stream_chunks() -> None:
    evs = events(chat_stream(["Hel", "", "lo 🚀"], include_usage=True))
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 5
    assert {c["id"] for c in chunks} == {"chatcmpl-9"} and {c["created"] for c in chunks} == {100}
    assert [c["choices"][0]["delta"] for c in chunks[:4]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo 🚀"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "stop"]
    assert [c["usage"] for c in chunks[:4]] == [None] * 4
    assert chunks[4]["choices"] == [] and chunks[4]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
    }


def test_streams_without_usage_have_no_usage_key() -> None:
    evs = events(chat_stream(["a"], include_usage=False, reason="length"))
    assert evs[-1] == "[DONE]" and len(evs) == 4
    assert all("usage" not in c for c in evs[:-1])
    assert evs[2]["choices"][0]["finish_reason"] == "length"


def test_completion_stream_chunks() -> None:
    enc = StreamEncoder("completion", 3, 100, MODEL, include_usage=True)
    assert enc.start() == b""
    raw = enc.text("Once") + enc.text(" upon") + enc.finish("length") + enc.end(Usage(2, 2))
    evs = events(raw)
    assert evs[-1] == "[DONE]"
    assert [c["object"] for c in evs[:-1]] == ["text_completion"] * 4
    assert [c["choices"] for c in evs[:3]] == [
        [{"text": "Once", "index": 0, "logprobs": None, "finish_reason": None}],
        [{"text": " upon", "index": 0, "logprobs": None, "finish_reason": None}],
        [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
    ]
    assert evs[3]["choices"] == [] and evs[3]["usage"]["total_tokens"] == 4


def test_stream_encoder_order_is_enforced() -> None:
    enc = StreamEncoder("chat", 1, 0, MODEL, include_usage=True)
    with pytest.raises(RuntimeError, match="needs 'open'"):
        enc.text("early")
    enc.start()
    with pytest.raises(RuntimeError, match="needs 'new'"):
        enc.start()
    with pytest.raises(RuntimeError, match="needs 'finished'"):
        enc.end(Usage(1, 1))
    enc.finish("stop")
    with pytest.raises(RuntimeError, match="needs 'open'"):
        enc.text("late")
    with pytest.raises(ValueError, match="needs the usage"):
        enc.end(None)
    with pytest.raises(ValueError, match="did not ask for a stream"):
        StreamEncoder.for_request(chat(), 1, 0)
    assert StreamEncoder.for_request(chat(stream=True), 1, 0).kind == "chat"


@given(deltas=st.lists(st.text(st.characters(exclude_categories=("Cs",)), max_size=8), max_size=12))
def test_streamed_content_concatenates_to_the_text(deltas: list[str]) -> None:
    chunks = events(chat_stream(deltas, include_usage=False))[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "".join(deltas)


# -- the real openai client parses what we build ----------------------------------------------------------


@pytest.fixture
def client_for() -> Any:
    pytest.importorskip("openai")
    return client_answering


def test_openai_client_reads_non_streamed_answers(client_for: Any) -> None:
    req = chat()
    body = completion_body(req, 11, 1700000000, "Hi 東京", "stop", Usage(4, 3))
    got = client_for(200, body, b"application/json").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert (got.id, got.choices[0].message.content, got.choices[0].finish_reason) == ("chatcmpl-11", "Hi 東京", "stop")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (4, 3, 7)

    body = completion_body(completion(), 12, 1700000000, "there", "length", Usage(2, 1))
    got = client_for(200, body, b"application/json").completions.create(model=MODEL, prompt="hi")
    assert (got.id, got.object, got.choices[0].text, got.choices[0].finish_reason) == (
        "cmpl-12",
        "text_completion",
        "there",
        "length",
    )


def test_openai_client_streams_chat_and_completions(client_for: Any) -> None:
    raw = chat_stream(["Hel", "lo"], include_usage=True)
    chunks = list(
        client_for(200, raw, b"text/event-stream").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7

    enc = StreamEncoder("completion", 4, 0, MODEL, include_usage=False)
    raw = enc.start() + enc.text("a") + enc.text("b") + enc.finish("stop") + enc.end(None)
    chunks = list(client_for(200, raw, b"text/event-stream").completions.create(model=MODEL, prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "ab"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_client_lists_models(client_for: Any) -> None:
    body = json.dumps(models_list([MODEL, "echo"], 1)).encode()
    page = client_for(200, body, b"application/json").models.list()
    assert [m.id for m in page] == [MODEL, "echo"]


def test_openai_client_maps_our_errors(client_for: Any) -> None:
    openai = pytest.importorskip("openai")
    err = refused(chat, n=2)
    with pytest.raises(openai.BadRequestError) as info:
        client_for(err.status, err.body(), b"application/json").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2
        )
    assert (info.value.code, info.value.param) == ("invalid_value", "n")
    busy = OpenAIError.of(openai_core().refusals.no_slot())  # what the server answers when no slot is free
    with pytest.raises(openai.RateLimitError) as limited:
        client_for(busy.status, busy.body(), b"application/json", busy.headers).completions.create(
            model=MODEL, prompt="x"
        )
    assert limited.value.code == "no_slot"
    missing = model_not_found("gpt-4o", [MODEL])
    with pytest.raises(openai.NotFoundError):
        client_for(missing.status, missing.body(), b"application/json").completions.create(model="gpt-4o", prompt="x")


# -- a whole answer: ids -> text -> stop strings -> bytes -------------------------------------------------


@pytest.fixture(scope="module")
def tekken() -> Any:
    from edgepath.edge.text.tokenizer import load_tokenizer

    return load_tokenizer()


def answer_ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text)[1:].tolist()


def run_answer(answer: Answer, ids: list[int], reason: str) -> tuple[bytes, list[AnswerStep]]:
    out = answer.start()
    steps = []
    for i in ids:
        step = answer.feed([i])
        steps.append(step)
        out += step.data
        if step.stopped:
            break
    return out + answer.finish("stop" if answer.stopped else reason), steps  # type: ignore[arg-type]


def test_streamed_chat_answer_stops_at_a_stop_string_spanning_tokens(tekken: Any) -> None:
    req = chat(stream=True, stream_options={"include_usage": True}, stop=["\n\nUser:"])
    ids = answer_ids(tekken, "Sure 🚀 東京!\n\nUser: and then more text")
    answer = Answer(req, tekken, 21, 100, prompt_tokens=9)
    raw, steps = run_answer(answer, ids, "length")
    assert steps[-1].stopped and len(steps) < len(ids)
    evs = events(raw)
    assert evs[-1] == "[DONE]"
    content = [c["choices"][0]["delta"].get("content") for c in evs[:-2]]
    assert all("\ufffd" not in (c or "") for c in content)
    assert "".join(c or "" for c in content) == "Sure 🚀 東京!" == answer.text
    assert evs[-3]["choices"][0]["finish_reason"] == "stop"
    assert evs[-2]["usage"] == {"prompt_tokens": 9, "completion_tokens": len(steps), "total_tokens": 9 + len(steps)}


def test_non_streamed_completion_to_length(tekken: Any) -> None:
    text = "Once upon a time, 東京 🚀"
    ids = answer_ids(tekken, text)
    answer = Answer(completion(stop=["never"]), tekken, 5, 100, prompt_tokens=3)
    raw, steps = run_answer(answer, ids, "length")
    assert all(s.data == b"" and not s.stopped for s in steps)
    body = json.loads(raw)
    assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}


def test_held_stop_prefix_is_released_at_the_end(tekken: Any) -> None:
    answer = Answer(completion(stop=["END"], stream=True), tekken, 6, 100, prompt_tokens=1)
    raw, _ = run_answer(answer, answer_ids(tekken, "the EN"), "stop")
    evs = events(raw)
    assert "".join(c["choices"][0]["text"] for c in evs[:-1]) == "the EN"
    assert evs[-2]["choices"][0]["finish_reason"] == "stop"


def test_ids_after_a_stop_are_counted_not_sent(tekken: Any) -> None:
    answer = Answer(chat(stop="!"), tekken, 7, 100, prompt_tokens=2)
    answer.start()
    assert answer.feed(answer_ids(tekken, "Hi! there")).stopped
    late = answer.feed(answer_ids(tekken, " more"))
    assert late == AnswerStep(b"", True)
    with pytest.raises(ValueError, match="finish reason is 'stop'"):
        answer.finish("length")
    body = json.loads(answer.finish("stop"))
    assert body["choices"][0]["message"]["content"] == "Hi"
    assert body["usage"]["completion_tokens"] == answer.completion_tokens == len(answer_ids(tekken, "Hi! there more"))
    with pytest.raises(RuntimeError, match="needs 'open'"):
        answer.feed([1])


def test_openai_client_reads_a_whole_streamed_answer(client_for: Any, tekken: Any) -> None:
    req = chat(stream=True, stream_options={"include_usage": True})
    ids = answer_ids(tekken, "Streaming 👨\u200d👩\u200d👧 works.")
    raw, _ = run_answer(Answer(req, tekken, 30, 100, prompt_tokens=4), ids, "length")
    chunks = list(
        client_for(200, raw, b"text/event-stream").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tekken.decode(ids)
    assert chunks[-1].usage.completion_tokens == len(ids)


# -- log probabilities ----------------------------------------------------------------------------------

WITH_LOGPROBS = OpenAILimits(max_tokens=256, vocab_size=1000, models=(MODEL,), logprobs=True)


def test_logprobs_are_parsed_with_the_answer_length_they_leave() -> None:
    """Each token's record takes 2 + 2 x alternatives output words, so a slot's output holds fewer tokens: the
    default ``max_tokens`` is what fits, and more is a 400 that says why."""
    asked = parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                "top_logprobs": 3}, WITH_LOGPROBS)  # fmt: skip
    assert (asked.logprobs, asked.max_tokens) == (3, 256 // 8)
    plain = parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
                               WITH_LOGPROBS)  # fmt: skip
    assert (plain.logprobs, plain.max_tokens) == (0, 128)
    legacy = parse_completion_request({"model": MODEL, "prompt": "hi", "logprobs": 5}, WITH_LOGPROBS)
    assert (legacy.logprobs, legacy.max_tokens) == (5, 256 // 12)
    assert chat(logprobs=False, top_logprobs=0).logprobs is None and completion().logprobs is None


@pytest.mark.parametrize(
    ("kind", "fields", "param", "says"),
    [
        ("chat", {"logprobs": "yes"}, "logprobs", "true or false"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "0..20"),
        ("chat", {"logprobs": True, "top_logprobs": 2.0}, "top_logprobs", "0..20"),
        ("chat", {"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
        ("chat", {"logprobs": True, "top_logprobs": 3, "max_tokens": 33}, "max_tokens", "1..32 (this server's most"),
        ("completion", {"logprobs": 6}, "logprobs", "0..5"),
        ("completion", {"logprobs": True}, "logprobs", "0..5"),
        ("completion", {"logprobs": 1, "max_tokens": 65}, "max_tokens", "with log probabilities and 1 alternatives"),
    ],
)
def test_bad_logprobs_are_a_400_naming_the_field_and_what_is_allowed(
    kind: str, fields: dict[str, Any], param: str, says: str
) -> None:
    base: dict[str, Any] = {"model": MODEL}
    if kind == "chat":
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    parse = parse_chat_request if kind == "chat" else parse_completion_request
    with pytest.raises(OpenAIError) as info:
        parse({**base, **fields}, WITH_LOGPROBS)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.code in ("invalid_value", "invalid_type")
    assert says in info.value.message


def test_a_model_side_without_logprobs_refuses_them_by_name() -> None:
    err = refused(chat, logprobs=True)
    assert (err.status, err.param, err.code) == (400, "top_logprobs", "unsupported_parameter")
    assert "does not compute log probabilities" in err.message
    assert refused(completion, logprobs=2).param == "logprobs"


def _records(tok: Any, text: str, top: int) -> tuple[list[int], np.ndarray]:
    """Output words as the model side writes them: each token's record, its alternatives made up (the token
    first, then the next ids), log probabilities that fall with rank."""
    ids = answer_ids(tok, text)
    words = np.zeros(len(ids) * wire.record_words(top), dtype=np.int32)
    for i, token in enumerate(ids):
        alternatives = np.array([token, *range(100, 100 + top - 1)][:top], dtype=np.int32)
        wire.write_record(words, i, token, -0.25 * i, alternatives, -np.arange(top, dtype=np.float32) - 0.25 * i)
    return ids, words


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_reach_the_openai_client_in_its_shapes(client_for: Any, tekken: Any, stream: bool) -> None:
    """Records from the output area become OpenAI's ``logprobs`` of a chat answer, whole and streamed, as the
    ``openai`` package parses them: one entry per token, its text, log probability, bytes and alternatives."""
    routes = OpenAIRoutes(MODEL, 256, 1000, ChatSupport(True), 0, logprobs=True)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    work = routes.parse(CHAT, json.dumps({**body, "stream": stream}).encode())
    assert isinstance(work, Work) and wire.logprobs_top(work.flags) == 2 and work.max_tokens == 256 // 6 * 6
    ids, words = _records(tekken, "Tokyo is big 東京", 2)
    formatter = formatter_factory(lambda: 0.0)(work, tekken)
    outcome = Outcome(1, 3, words, "STOP", 1)
    client = client_for
    if stream:
        raw = formatter.tokens(words[:12]) + formatter.tokens(words[12:]) + formatter.end(outcome)
        chunks = list(client(200, raw, b"text/event-stream").chat.completions.create(**body, stream=True))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        got = client(200, formatter.complete(outcome).body, b"application/json").chat.completions.create(**body)
        entries = got.choices[0].logprobs.content
        text = got.choices[0].message.content
        assert got.usage.completion_tokens == len(ids) and got.choices[0].finish_reason == "stop"
    assert text == tekken.decode(np.array(ids))
    assert [e.token for e in entries] == [tekken.decode(np.array([i])) for i in ids]
    assert [e.logprob for e in entries] == [-0.25 * i for i in range(len(ids))]
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    assert all([t.logprob for t in e.top_logprobs] == [e.logprob, e.logprob - 1] for e in entries)
    assert all(e.top_logprobs[0].token == e.token for e in entries)


def test_completion_logprobs_in_the_legacy_shape(client_for: Any, tekken: Any) -> None:
    routes = OpenAIRoutes(MODEL, 256, 1000, ChatSupport(False, "no template"), 0, logprobs=True)
    work = routes.parse(COMPLETIONS, json.dumps({"model": MODEL, "prompt": "x", "logprobs": 1}).encode())
    assert isinstance(work, Work)
    ids, words = _records(tekken, "Once upon", 1)
    body = formatter_factory(lambda: 0.0)(work, tekken).complete(Outcome(1, 3, words, "LENGTH", 1)).body
    got = client_for(200, body, b"application/json").completions.create(model=MODEL, prompt="x", logprobs=1)
    logprobs = got.choices[0].logprobs
    tokens = [tekken.decode(np.array([i])) for i in ids]
    assert logprobs.tokens == tokens and logprobs.token_logprobs == [-0.25 * i for i in range(len(ids))]
    assert logprobs.top_logprobs == [{t: -0.25 * i} for i, t in enumerate(tokens)]
    assert logprobs.text_offset == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert got.choices[0].finish_reason == "length"
