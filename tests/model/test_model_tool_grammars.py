"""The grammars of enforced tool calls, run by llama.cpp's own grammar engine over a real vocabulary (SmolLM2's):
each format's grammar takes the answers its template asks for, token by token up to the end of the answer, and
refuses what it must (another tool's name, text before a call, the fallback's list under Hermes' format).  The
same check the slot's sampler makes before each token (:class:`edgepath.model.sampler.SlotSampler`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.grammars import gbnf

from edgepath.contract.wire import Sampling
from edgepath.edge.apis.openai import OpenAILimits, parse_chat_request

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[Any]:
    from edgepath.edge.text.tokenizer import GGUFTokenizer
    from edgepath.model.gguf import default_model_path

    tok = GGUFTokenizer(default_model_path())
    yield tok
    tok.close()


def grammar(fmt: str, **fields: Any) -> str:
    limits = OpenAILimits(64, 100, ("m",), grammars=True, tool_format=fmt)  # type: ignore[arg-type]
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, NOW],
                              **fields}, limits)  # fmt: skip
    text = gbnf(req.constraint)  # built now, as a tokenizer worker builds it
    assert text is not None
    return text


def accepts(tok: Any, gbnf: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets ``text``'s tokens through, one by one, and then the end."""
    from edgepath.model.sampler import SlotSampler

    sampler = SlotSampler(tok._lib, Sampling(), tok.vocab_size, grammar=(tok._vocab, gbnf))
    ids = np.empty(len(text.encode()) + 8, np.int32)
    n = tok._tokenize(text, ids, add_special=False, special=False)
    try:
        for token in ids[:n].tolist():
            if not sampler._allows(token):
                return False
            tok._lib.llama_sampler_accept(sampler._grammar, token)
        return sampler._allows(int(tok._lib.llama_vocab_eos(tok._vocab)))
    finally:
        sampler.close()


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TWO = HERMES + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def test_hermes_grammar_takes_tool_call_blocks_only(tokenizer: Any) -> None:
    required = grammar("hermes", tool_choice="required")
    assert accepts(tokenizer, required, HERMES) and accepts(tokenizer, required, HERMES_TWO)
    assert not accepts(tokenizer, required, "Sure. " + HERMES)  # a call, not text first
    assert not accepts(tokenizer, required, HERMES.replace("get_weather", "get_time"))  # a tool offered
    assert not accepts(tokenizer, required, '[{"name": "now", "arguments": {}}]')  # not the fallback's list
    assert not accepts(tokenizer, required, HERMES[: -len("</tool_call>")])  # not finished: the end is refused
    one = grammar("hermes", tool_choice="required", parallel_tool_calls=False)
    assert accepts(tokenizer, one, HERMES) and not accepts(tokenizer, one, HERMES_TWO)
    named = grammar("hermes", tool_choice={"type": "function", "function": {"name": "now"}})
    assert accepts(tokenizer, named, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not accepts(tokenizer, named, HERMES)


def test_llama_grammar_takes_one_name_parameters_object(tokenizer: Any) -> None:
    required = grammar("llama3-json", tool_choice="required")
    assert accepts(tokenizer, required, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert not accepts(tokenizer, required, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not accepts(tokenizer, required, '{"name": "get_weather", "parameters": {}}')  # city is required
    assert not accepts(tokenizer, required, '[{"name": "now", "parameters": {}}]')


def test_the_fallback_grammar_is_unchanged(tokenizer: Any) -> None:
    required = grammar("fallback", tool_choice="required")
    assert accepts(tokenizer, required, '[{"name": "now", "arguments": {}}]')
    assert not accepts(tokenizer, required, HERMES)
