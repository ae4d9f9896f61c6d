"""A reasoning model's thinking turned off per request, with the real templates of the reasoning families, verbatim as
llama.cpp keeps them (tests/helpers/templates.py):

* ``Qwen-Qwen3-0.6B.jinja``: with ``enable_thinking`` false the prompt ends with an empty ``<think>\\n\\n</think>``
  block, so the model answers at once;
* ``deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja`` (llama.cpp's version): the generation prompt opens the block,
  and with ``enable_thinking`` false closes it at once -- so the output no longer starts inside the thinking;
* ``deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja``: thinks, and has no switch -- a request to turn it off is a 400
  naming the field, never an answer that thinks anyway;
* ``Qwen-Qwen2.5-7B-Instruct.jinja``: no thinking at all -- turning it off changes nothing, and is taken.

Each shape's spelling (Anthropic's ``thinking: {"type": "disabled"}``, OpenAI chat's ``chat_template_kwargs`` and
``reasoning_effort``, Responses' ``reasoning.effort``) goes from the request to the prompt ids the frame gets, through
the real tokenizer of the default GGUF with the template set on it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest
from helpers.templates import template

from edgepath.edge.apis import anthropic_answers, responses_answers
from edgepath.edge.apis.anthropic import AnthropicError, parse_messages
from edgepath.edge.apis.conversation import ChatLimits
from edgepath.edge.apis.openai import OpenAIError, OpenAILimits, parse_chat_request
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.apis.output import OutputText
from edgepath.edge.apis.responses import parse_response_request
from edgepath.edge.apis.tools import template_format
from edgepath.edge.http import CHAT, COUNT_TOKENS, MESSAGES, RESPONSES, Work
from edgepath.edge.tenancy.tenants import ANONYMOUS
from edgepath.edge.text.chat import ChatTemplate
from edgepath.edge.text.thinking import Thinking, ThinkingFixed, ThinkingModes, thinking_modes
from edgepath.edge.text.tokenizer import INLINE_CHARS, GGUFTokenizer
from edgepath.edge.tokenizing import Tokenizing, encode_prompt, work_on_worker
from edgepath.edge.tracked import Phase, Tokenize, Tracked

QWEN3 = template("Qwen-Qwen3-0.6B.jinja")
R1 = template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
R1_LLAMA = template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja")
QWEN25 = template("Qwen-Qwen2.5-7B-Instruct.jinja")
MODEL = "m"
ASKED = [{"role": "user", "content": "What is the capital of France?"}]
QWEN3_OPEN = "<|im_start|>assistant\n"
QWEN3_EMPTY = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_enable_thinking_false_renders_what_each_template_says() -> None:
    qwen3 = ChatTemplate(QWEN3)
    assert qwen3.render(ASKED).endswith(QWEN3_OPEN)
    assert qwen3.render(ASKED, enable_thinking=False) == qwen3.render(ASKED) + "<think>\n\n</think>\n\n"
    r1 = ChatTemplate(R1)
    assert r1.render(ASKED).endswith("<\uff5cAssistant\uff5c><think>\n")
    assert r1.render(ASKED, enable_thinking=False).endswith("<\uff5cAssistant\uff5c><think>\n</think>")
    for fixed in (R1_LLAMA, QWEN25):  # neither reads the flag
        assert ChatTemplate(fixed).render(ASKED, enable_thinking=False) == ChatTemplate(fixed).render(ASKED)


def test_the_modes_of_each_template_are_found() -> None:
    assert thinking_modes(QWEN3) == ThinkingModes(Thinking(), Thinking(), switch=True)
    # R1's prompt opens the block for the model; turned off, it is closed: the output starts with the answer
    assert thinking_modes(R1) == ThinkingModes(Thinking(starts_open=True), Thinking(starts_open=False), switch=True)
    assert thinking_modes(QWEN25) == ThinkingModes() == thinking_modes(None)
    fixed = thinking_modes(R1_LLAMA)
    assert fixed.on == Thinking(starts_open=True) and not fixed.switch
    with pytest.raises(ThinkingFixed, match="no switch"):
        fixed.choose(False)
    assert fixed.choose(True) == Thinking(starts_open=True)
    assert ThinkingModes().choose(False) is None  # nothing to turn off: taken


def test_turned_off_r1s_answer_is_all_answer() -> None:
    """With the block closed in the prompt, the output is the answer: none of it is taken for thinking."""
    from helpers.tokenizers import CharTokenizer

    answer = "The capital is Paris."
    for thinking, reasoning, text in ((thinking_modes(R1).on, answer, ""), (thinking_modes(R1).off, "", answer)):
        out = OutputText(CharTokenizer(), thinking=thinking)
        out.feed([ord(c) for c in answer])
        out.finish()
        assert (out.reasoning, out.text) == (reasoning, text)


@pytest.fixture(scope="module")
def qwen3_tokenizer() -> Iterator[GGUFTokenizer]:
    """The default GGUF's tokenizer rendering Qwen3's template (its ``<|im_start|>`` markers are the GGUF's too)."""
    from edgepath.model.gguf import default_model_path

    tok = GGUFTokenizer(default_model_path())
    tok.set_chat_template(QWEN3)
    yield tok
    tok.close()


def _shapes(source: str) -> dict[str, Any]:
    """The routes of each chat shape for a model whose template is ``source``."""
    modes, fmt = thinking_modes(source), template_format(source)
    limits = ChatLimits(4096, (MODEL,), False, fmt, modes)
    return {
        CHAT: OpenAIRoutes(MODEL, 4096, 1000, ChatSupport(True, tool_format=fmt, thinking=modes), 0),
        MESSAGES: anthropic_answers.AnthropicRoutes(limits, True),
        COUNT_TOKENS: anthropic_answers.AnthropicRoutes(limits, True),
        RESPONSES: responses_answers.ResponsesRoutes(limits, True),
    }


def _work(source: str, path: str, body: dict[str, Any]) -> Work:
    work = _shapes(source)[path].parse(path, orjson.dumps(body))
    assert isinstance(work, Work), getattr(work, "body", work)
    return work


def _prompt(tok: GGUFTokenizer, work: Work) -> str:
    """The text of the ids ``work``'s prompt is tokenized into (control tokens as their text)."""
    out = np.zeros(512, np.int32)
    n = encode_prompt(
        tok, work.prompt, out, work.options["messages"], work.options.get("tools"), work.tokens, None,
        work.options.get("enable_thinking", True),
    )  # fmt: skip
    assert isinstance(n, int) and n <= len(out)
    pieces = tok.pieces()
    return b"".join(pieces[int(i)] for i in out[:n]).decode()


CHAT_BODY = {"model": MODEL, "messages": ASKED}
MESSAGES_BODY = {"model": MODEL, "messages": ASKED, "max_tokens": 32}
OFF = [
    (CHAT, {**CHAT_BODY, "chat_template_kwargs": {"enable_thinking": False}}),
    (CHAT, {**CHAT_BODY, "reasoning_effort": "none"}),
    (CHAT, {**CHAT_BODY, "reasoning_effort": "minimal", "chat_template_kwargs": {"enable_thinking": False}}),
    (MESSAGES, {**MESSAGES_BODY, "thinking": {"type": "disabled"}}),
    (COUNT_TOKENS, {"model": MODEL, "messages": ASKED, "thinking": {"type": "disabled"}}),
    (RESPONSES, {"model": MODEL, "input": ASKED, "reasoning": {"effort": "none"}}),
    (RESPONSES, {"model": MODEL, "input": "What is the capital of France?", "reasoning": {"effort": "minimal"}}),
]
ON = [
    (CHAT, CHAT_BODY),
    (CHAT, {**CHAT_BODY, "chat_template_kwargs": {"enable_thinking": True}}),
    (MESSAGES, MESSAGES_BODY),
    (MESSAGES, {**MESSAGES_BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}),
    (COUNT_TOKENS, {"model": MODEL, "messages": ASKED}),
    (RESPONSES, {"model": MODEL, "input": ASKED, "reasoning": {"effort": None}}),
]


@pytest.mark.parametrize(("path", "body"), OFF)
def test_each_shape_turns_the_thinking_off_in_the_prompt(
    qwen3_tokenizer: GGUFTokenizer, path: str, body: dict[str, Any]
) -> None:
    work = _work(QWEN3, path, body)
    assert work.options["enable_thinking"] is False
    assert _prompt(qwen3_tokenizer, work).endswith(QWEN3_EMPTY)
    shaped = work.options.get("openai") or work.options.get("anthropic") or work.options.get("responses")
    if shaped is not None:  # the answer is split as the model then answers: it may still open a block, never leak
        assert shaped.thinking == Thinking() and shaped.enable_thinking is False


@pytest.mark.parametrize(("path", "body"), ON)
def test_without_the_switch_the_model_thinks_as_its_template_has_it(
    qwen3_tokenizer: GGUFTokenizer, path: str, body: dict[str, Any]
) -> None:
    work = _work(QWEN3, path, body)
    assert "enable_thinking" not in work.options
    prompt = _prompt(qwen3_tokenizer, work)
    assert prompt.endswith(QWEN3_OPEN) and "</think>" not in prompt


def test_the_switch_reaches_the_tokenizer_worker(qwen3_tokenizer: GGUFTokenizer) -> None:
    """A large chat goes to a worker: the switch travels in its Tokenize action."""
    long = [{"role": "user", "content": "x " * INLINE_CHARS}]
    work = _work(QWEN3, CHAT, {**CHAT_BODY, "messages": long, "chat_template_kwargs": {"enable_thinking": False}})
    work.tenant = ANONYMOUS
    out = np.zeros(2 * INLINE_CHARS + 64, np.int32)
    t = Tracked(1, None, CHAT, work, None, Phase.TOKENIZING)  # type: ignore[arg-type]
    action = Tokenizing(qwen3_tokenizer, lambda: 0, 1).start(t, out)
    assert isinstance(action, Tokenize) and action.enable_thinking is False
    n, _ = work_on_worker(qwen3_tokenizer, action)
    assert isinstance(n, int)
    pieces = qwen3_tokenizer.pieces()
    assert b"".join(pieces[int(i)] for i in out[:n]).decode().endswith(QWEN3_EMPTY)


def test_a_template_without_thinking_takes_off_and_renders_the_same() -> None:
    """Qwen2.5 does not think: off is what it does anyway, so it is taken, and the prompt is unchanged."""
    on = _work(QWEN25, CHAT, CHAT_BODY)
    off = _work(QWEN25, CHAT, {**CHAT_BODY, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.options["openai"].thinking is None
    template_ = ChatTemplate(QWEN25)
    assert template_.render(off.options["messages"], enable_thinking=False) == template_.render(on.options["messages"])


def _limits(source: str) -> tuple[OpenAILimits, ChatLimits]:
    modes, fmt = thinking_modes(source), template_format(source)
    chat = OpenAILimits(64, 1000, (MODEL,), tool_format=fmt, thinking=modes)
    return chat, ChatLimits(64, (MODEL,), False, fmt, modes)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
        ({"reasoning_effort": "none"}, "reasoning_effort"),
    ],
)
def test_a_thinking_model_without_a_switch_refuses_off_on_the_chat_route(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_chat_request({**CHAT_BODY, **fields}, _limits(R1_LLAMA)[0])
    assert (info.value.status, info.value.param) == (400, param)
    assert "no switch to turn it off" in info.value.message


def test_a_thinking_model_without_a_switch_refuses_off_on_the_other_shapes() -> None:
    limits = _limits(R1_LLAMA)[1]
    with pytest.raises(AnthropicError) as anthropic:
        parse_messages({**MESSAGES_BODY, "thinking": {"type": "disabled"}}, limits)
    assert anthropic.value.status == 400 and anthropic.value.message.startswith("thinking: ")
    with pytest.raises(OpenAIError) as responses:
        parse_response_request({"model": MODEL, "input": "hi", "reasoning": {"effort": "none"}}, limits)
    assert (responses.value.status, responses.value.param) == (400, "reasoning.effort")
    # on: what the template does
    assert parse_messages(MESSAGES_BODY, limits).thinking == Thinking(starts_open=True)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": {"enable_thinking": False, "tools_in_user_message": True}},
         "chat_template_kwargs.tools_in_user_message"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort"),
    ],
)  # fmt: skip
def test_what_the_chat_route_cannot_apply_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_chat_request({**CHAT_BODY, **fields}, _limits(QWEN3)[0])
    assert (info.value.status, info.value.param) == (400, param), info.value.message


@pytest.mark.parametrize(
    ("reasoning", "param"),
    [
        ({"effort": "medium"}, "reasoning.effort"),
        ({"effort": "none", "summary": "auto"}, "reasoning.summary"),
        ({"budget": 5}, "reasoning.budget"),
        ("none", "reasoning"),
    ],
)
def test_what_responses_cannot_apply_of_reasoning_is_a_400_naming_it(reasoning: Any, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_response_request({"model": MODEL, "input": "hi", "reasoning": reasoning}, _limits(QWEN3)[1])
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_responses_echoes_the_effort() -> None:
    req = parse_response_request({"model": MODEL, "input": "hi", "reasoning": {"effort": "none"}}, _limits(QWEN3)[1])
    assert (req.effort, req.enable_thinking) == ("none", False)
