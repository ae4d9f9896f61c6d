"""A reasoning model's thinking split from its answer, with the real templates of two reasoning families, verbatim as
llama.cpp keeps them for its own chat tests (``models/templates/`` of the llama.cpp inside llama-cpp-python's sdist:
tests/helpers/templates.py):

* ``Qwen-Qwen3-0.6B.jinja``: Qwen3's ``chat_template`` (the model opens ``<think>`` itself; Hermes ``<tool_call>``
  blocks);
* ``deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja``: the DeepSeek-R1 distillations' template, whose generation
  prompt ends with ``<think>\\n`` (the output starts inside the thinking).

The thinking goes to OpenAI chat's ``reasoning_content`` and never into ``content`` however the text is cut into
deltas; the split is the one text transform every shape uses (:mod:`edgepath.edge.apis.output`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from helpers.templates import template
from helpers.tokenizers import CharTokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.edge.apis.openai import OpenAILimits, parse_chat_request
from edgepath.edge.apis.openai_answers import Answer
from edgepath.edge.apis.output import OutputText
from edgepath.edge.apis.tools import template_format
from edgepath.edge.text.chat import ChatTemplate
from edgepath.edge.text.thinking import Thinking, ThinkingSplit, thinking_modes, thinking_of

QWEN3 = template("Qwen-Qwen3-0.6B.jinja")
R1 = template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
QWEN25 = template("Qwen-Qwen2.5-7B-Instruct.jinja")
ASKED = [{"role": "user", "content": "What is the capital of France?"}]
# what each family answers: Qwen3 opens the block itself; R1's prompt opened it
QWEN3_OUT = "<think>\nThe user asks for the capital of France.\nIt is Paris.\n</think>\n\nThe capital is Paris."
R1_OUT = "The user asks for the capital of France. It is Paris.\n</think>\n\nThe capital is Paris."
THOUGHT = {QWEN3_OUT: "The user asks for the capital of France.\nIt is Paris.", R1_OUT: R1_OUT.split("\n</think>")[0]}


def test_the_thinking_of_each_template_is_found() -> None:
    assert thinking_of(QWEN3) == Thinking(starts_open=False)
    assert thinking_of(R1) == Thinking(starts_open=True)
    assert thinking_of(QWEN25) is None  # no thinking block: answers unchanged
    assert thinking_of(None) is None
    # R1's prompt ends inside the block it opened for the model; Qwen3's leaves it to the model
    assert ChatTemplate(R1).render(ASKED).endswith("<\uff5cAssistant\uff5c><think>\n")  # full-width bars
    assert ChatTemplate(QWEN3).render(ASKED).endswith("<|im_start|>assistant\n")
    assert template_format(QWEN3) == "hermes"  # its calls, after the thinking, are read as Hermes blocks


def split_all(thinking: Thinking, pieces: list[str]) -> tuple[str, str]:
    split = ThinkingSplit(thinking)
    reasoning, content = "", ""
    for piece in [*(split.feed(p) for p in pieces), split.flush()]:
        reasoning += piece.reasoning
        content += piece.content
    return reasoning, content


def cuts(text: str, points: list[int]) -> list[str]:
    at = sorted({min(p, len(text)) for p in points})
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(QWEN3, QWEN3_OUT), (R1, R1_OUT)]), st.lists(st.integers(0, 120), max_size=12))
def test_the_thinking_never_reaches_the_answer_however_the_text_is_cut(
    case: tuple[str, str], points: list[int]
) -> None:
    template, text = case
    thinking = thinking_of(template)
    assert thinking is not None
    reasoning, content = split_all(thinking, cuts(text, points))
    assert reasoning == THOUGHT[text]
    assert content == "The capital is Paris."


def test_an_answer_without_thinking_is_left_as_it_is_and_one_cut_short_stays_thinking() -> None:
    qwen3 = Thinking()
    assert split_all(qwen3, ["  Paris", " is the capital."]) == ("", "  Paris is the capital.")
    assert split_all(qwen3, ["<th", "ink>\nStill thinking about it\n</th"]) == ("Still thinking about it\n</th", "")
    assert split_all(Thinking(starts_open=True), ["cut short <"]) == ("cut short <", "")


def test_the_real_tokens_of_a_thought_split_the_same_as_its_text() -> None:
    """The ids of Qwen3's answer in a real vocabulary (SmolLM2's), detokenized token by token as they arrive."""
    from edgepath.edge.text.tokenizer import GGUFTokenizer
    from edgepath.model.gguf import default_model_path

    tok = GGUFTokenizer(default_model_path())
    try:
        ids = tok.encode(QWEN3_OUT).tolist()
        out = OutputText(tok, thinking=thinking_of(QWEN3), count_thinking=True)
        pieces = [out.feed([i]) for i in ids] + out.finish()
        assert "".join(p.reasoning for p in pieces) == THOUGHT[QWEN3_OUT]
        assert "".join(p.text for p in pieces) == out.text == "The capital is Paris."
        answer_ids = tok.encode("\n\nThe capital is Paris.").tolist()
        assert 0 < out.reasoning_tokens <= len(ids) - len(answer_ids) + 2  # the answer's tokens are not thinking
    finally:
        tok.close()


def chat_answer(template: str, text: str, stream: bool, **fields: Any) -> bytes:
    limits = OpenAILimits(64, 1000, ("m",), thinking=thinking_modes(template), tool_format=template_format(template))
    request = parse_chat_request({"model": "m", "messages": ASKED, "stream": stream, **fields}, limits)
    answer = Answer(request, CharTokenizer(), "1", 0, prompt_tokens=5)
    out = answer.start()
    for part in cuts(text, [3, 9, 20, 40, 61]):
        out += answer.feed([ord(c) for c in part]).data
    return out + answer.finish("stop")


def test_openai_chat_puts_the_thinking_in_reasoning_content_whole_and_streamed() -> None:
    import openai.types.chat as types

    whole = types.ChatCompletion.model_validate(json.loads(chat_answer(QWEN3, QWEN3_OUT, False)))
    message = whole.choices[0].message
    assert message.content == "The capital is Paris."
    assert message.model_extra == {"reasoning_content": THOUGHT[QWEN3_OUT]}
    chunks = [
        types.ChatCompletionChunk.model_validate(json.loads(line[6:]))
        for line in chat_answer(R1, R1_OUT, True).decode().split("\n\n")
        if line.startswith("data: {")
    ]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "The capital is Paris."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THOUGHT[R1_OUT]
    # a template that does not think: no reasoning_content, the text as it came
    plain = json.loads(chat_answer(QWEN25, QWEN3_OUT, False))["choices"][0]["message"]
    assert "reasoning_content" not in plain and plain["content"] == QWEN3_OUT


def test_a_thinking_models_tool_call_after_its_thought_is_read_as_a_call() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = (
        '<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n'
        "</tool_call>"
    )
    body = json.loads(chat_answer(QWEN3, text, False, tools=tools))
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "I should call the tool." and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_nothing_is_decoded_twice_in_the_split() -> None:
    out = OutputText(CharTokenizer(), thinking=Thinking(starts_open=True))
    got = [out.feed(np.array([ord(c) for c in part]).tolist()) for part in cuts(R1_OUT, [1, 2, 50])]
    got += out.finish()
    assert "".join(p.reasoning for p in got) + "|" + "".join(p.text for p in got) == (
        THOUGHT[R1_OUT] + "|The capital is Paris."
    )
    assert out.token_count == len(R1_OUT)
