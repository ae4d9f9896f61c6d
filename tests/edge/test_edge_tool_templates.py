"""Tools rendered by a model's own chat template, and its calls read back in the format the template asks for.

The templates are real ones, verbatim, as llama.cpp keeps them for its own chat tests (``models/templates/`` of the
llama.cpp inside llama-cpp-python's sdist: tests/helpers/templates.py):

* ``Qwen-Qwen2.5-7B-Instruct.jinja``: Qwen2.5-7B-Instruct's ``chat_template`` (Hermes-style ``<tool_call>`` blocks);
* ``meta-llama-Llama-3.3-70B-Instruct.jinja``: the Llama 3.1 family's template as Meta ships it with
  Llama-3.3-70B-Instruct (custom tools in the first user turn, a call answered as JSON ``{"name": ...,
  "parameters": ...}``, results in ``ipython`` turns).

They are rendered by the edge's own sandboxed renderer (:mod:`edgepath.edge.text.chat`) and by the GGUF tokenizer's
chat path (SmolLM2's vocabulary: the text is what is checked, and what a user may put in it)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.grammars import gbnf
from helpers.templates import template

from edgepath.edge.apis.openai import OpenAILimits, parse_chat_request
from edgepath.edge.apis.openai_answers import Answer
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.apis.tools import ToolOutput, ToolSpec, parse_tools, read_answer, template_format
from edgepath.edge.http import CHAT, Work
from edgepath.edge.text.chat import ChatMessage, ChatTemplate

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

QWEN = template("Qwen-Qwen2.5-7B-Instruct.jinja")
LLAMA = template("meta-llama-Llama-3.3-70B-Instruct.jinja")
# SmolLM2-135M-Instruct's (tests/edge/test_edge_chat.py): no place for tools
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL = "m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
ASKED = {"role": "user", "content": "Weather in Paris?"}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}


def limits(source: str) -> OpenAILimits:
    return OpenAILimits(64, 100, (MODEL,), grammars=True, tool_format=template_format(source))


def chat(source: str, messages: Any = None, **fields: Any) -> Any:
    return parse_chat_request({"model": MODEL, "messages": messages or [ASKED], **fields}, limits(source))


def spec(fmt: str, **fields: Any) -> ToolSpec:
    got = parse_tools({"tools": TOOLS, **fields}, fmt)  # type: ignore[arg-type]
    assert got is not None
    return got


def test_the_format_is_the_one_the_template_asks_for() -> None:
    assert template_format(QWEN) == "hermes"
    assert template_format(LLAMA) == "llama3-json"
    assert template_format(SMOLLM2) == "fallback"  # no place for tools: the documented fallback prompt
    assert template_format(None) == "fallback"
    # a template that reads tools but whose call format this edge cannot read back: the fallback too
    assert template_format("{% for t in tools %}{{ t.function.name }}{% endfor %}{{ messages[0].content }}") == (
        "fallback"
    )
    mistral_like = (  # reads tools, prints '"parameters"', answers '[TOOL_CALLS] [...]': not Llama's format
        '{{ "[AVAILABLE_TOOLS]" }}{% for t in tools %}{{ \'{"name": "\' + t.function.name + \'", "parameters": \' }}'
        "{{ t.function.parameters | tojson }}{% endfor %}{{ messages[0].content }}[TOOL_CALLS]"
    )
    assert template_format(mistral_like) == "fallback"


def test_qwen_renders_the_tools_the_calls_and_the_results_itself() -> None:
    """What transformers' ``apply_chat_template(messages, tools=tools)`` gives for Qwen2.5: the tools as JSON in
    ``<tools>``, the earlier call as a ``<tool_call>`` block, the result in ``<tool_response>``."""
    req = chat(QWEN, [{"role": "system", "content": "Be brief."}, ASKED, CALLED, RESULT], tools=[WEATHER])
    text = ChatTemplate(QWEN).render(template_input(req)["messages"], tools=req.template_tools)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
        ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert req.messages[0] == ChatMessage("system", "Be brief.")  # no fallback prompt added


def test_llama_renders_the_tools_in_the_first_user_turn_and_calls_as_json() -> None:
    req = chat(LLAMA, [ASKED, {**CALLED, "content": "Looking it up."}, RESULT], tools=[WEATHER])
    text = ChatTemplate(LLAMA, bos_token="<|begin_of_text|>").render(
        template_input(req)["messages"], tools=req.template_tools
    )
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
        "function call with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        "Do not use variables.\n\n{\n"
    )
    assert text.endswith(
        "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": 21}"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert json.dumps(WEATHER, indent=4) in text


def template_input(req: Any) -> dict[str, Any]:
    """The options the route gives the tokenizer for ``req``: its messages and the tools its template renders."""
    from edgepath.edge.apis import tools

    return {"messages": list(tools.template_messages(req.messages)), "tools": req.template_tools}


def test_the_route_hands_the_template_its_tools_and_the_turns_as_openai_has_them() -> None:
    routes = OpenAIRoutes(MODEL, 64, 100, ChatSupport(True, tool_format="hermes"), 0, grammars=True)
    body = {"model": MODEL, "messages": [ASKED, CALLED, RESULT], "tools": TOOLS, "tool_choice": "auto"}
    work = routes.parse(CHAT, json.dumps(body).encode())
    assert isinstance(work, Work) and work.grammar is None
    assert work.options["messages"] == [
        ASKED,
        {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        RESULT,
    ]  # fmt: skip
    assert [t["function"]["name"] for t in work.options["tools"]] == ["get_weather", "now"]
    assert work.options["tools"][1]["function"] == {"name": "now", "parameters": {"type": "object", "properties": {}}}
    none = routes.parse(CHAT, json.dumps({**body, "tool_choice": "none"}).encode())
    assert isinstance(none, Work) and "tools" not in none.options  # none: the history only
    named = routes.parse(CHAT, json.dumps({**body, "tool_choice": {"type": "function",
                                                                   "function": {"name": "now"}}}).encode())  # fmt: skip
    assert isinstance(named, Work) and [t["function"]["name"] for t in named.options["tools"]] == ["now"]
    bad = routes.parse(CHAT, json.dumps({**body, "messages": [ASKED, RESULT]}).encode())
    assert not isinstance(bad, Work) and bad.status == 400 and b"messages[1].tool_call_id" in bad.body


def test_the_enforced_grammars_are_the_templates_call_formats() -> None:
    hermes = gbnf(chat(QWEN, tools=TOOLS, tool_choice="required").constraint)
    assert hermes is not None and hermes.startswith(
        'root ::= "<tool_call>\\n" edgepath-tool-call "\\n</tool_call>" ("\\n" "<tool_call>\\n" edgepath-tool-call '
        '"\\n</tool_call>")*\n'
    )
    assert '"\\"arguments\\""' in hermes and '"\\"get_weather\\""' in hermes
    one = gbnf(chat(QWEN, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).constraint)
    assert one is not None and one.startswith('root ::= "<tool_call>\\n" edgepath-tool-call "\\n</tool_call>"\n')
    llama = gbnf(
        chat(LLAMA, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}).constraint
    )
    assert llama is not None and '"\\"parameters\\""' in llama
    assert '"\\"arguments\\""' not in llama and '"\\"now\\""' not in llama
    assert "<tool_call>" not in llama and '"["' not in llama.split("\n")[0]


# -- the answers --------------------------------------------------------------------------------------------------

HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TWO = HERMES_ONE + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "beside", "calls"),
    [
        (HERMES_ONE, "", [("get_weather", {"city": "Paris"})]),
        (HERMES_TWO, "", [("get_weather", {"city": "Paris"}), ("now", {})]),
        ("Let me look.\n" + HERMES_ONE, "Let me look.\n", [("get_weather", {"city": "Paris"})]),
        (HERMES_ONE[: -len("</tool_call>")], "", [("get_weather", {"city": "Paris"})]),  # ended before the tag
        ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', "", [("now", {})]),  # arguments as JSON text
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None, []),  # cut: not a call
        ('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', None, []),  # not a tool offered
        ('<tool_call>\n{"name": "now"}\n</tool_call>', None, []),  # no arguments
        ("It is sunny in Paris.", None, []),
        ('[{"name": "now", "arguments": {}}]', None, []),  # the fallback's format is not this template's
    ],
)
def test_hermes_answers_are_read_as_calls(text: str, beside: str | None, calls: list[Any]) -> None:
    got_text, got = read_answer(text, spec("hermes"), "c")
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_text == (text if beside is None else beside)
    if len(calls) > 1:
        assert read_answer(text, spec("hermes", parallel_tool_calls=False), "c") == (text, ())


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
        (' {"name": "now", "arguments": {}} ', [("now", {})]),  # "arguments" taken for "parameters"
        ('{"name": "get_weather", "parameters": {"city": "Pa', []),
        ('[{"name": "now", "parameters": {}}]', []),  # one object, not a list
        ('{"name": "other", "parameters": {}}', []),
        ("Paris is sunny.", []),
    ],
)
def test_llama_answers_are_read_as_calls(text: str, calls: list[Any]) -> None:
    got_text, got = read_answer(text, spec("llama3-json"), "c")
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_text == ("" if calls else text)


def test_hermes_auto_streams_text_up_to_a_tag_and_holds_from_it() -> None:
    out = ToolOutput(spec("hermes"), "c")
    pieces = ["Let me ", "look.", "\n<tool", "_call>\n{", '"name": "now", ', '"arguments": {}}', "\n</tool_call>"]
    released = [out.feed(piece) for piece in pieces]
    assert released == ["Let me ", "look.", "\n", "", "", "", ""]  # "<tool" may start a tag: held
    text, calls = out.finish()
    assert text == "" and [c.name for c in calls] == ["now"]
    plain = ToolOutput(spec("hermes"), "c")
    assert plain.feed("Sunny <to") == "Sunny " and plain.feed("day") == "<today"  # not a tag after all
    assert plain.finish() == ("", ())
    required = ToolOutput(spec("hermes", tool_choice="required"), "c")
    assert required.feed("<tool_call>") == "" and required.feed("\n{") == ""


class Chars:
    """A decoder whose token ids are characters' code points, so an answer's text is fed exactly."""

    def decode(self, ids: Any) -> str:
        return "".join(map(chr, ids))


def run(req: Any, text: str, reason: str = "stop") -> bytes:
    answer = Answer(req, Chars(), "ep9", 1700000000, prompt_tokens=5)
    out = answer.start()
    for ch in text:
        out += answer.feed([ord(ch)]).data
    return out + answer.finish(reason)  # type: ignore[arg-type]


def sse(raw: bytes) -> list[Any]:
    return [json.loads(b[6:]) for b in raw.decode().split("\n\n")[:-1] if b != "data: [DONE]"]


def test_a_whole_hermes_answer_in_openai_shape() -> None:
    body = json.loads(run(chat(QWEN, tools=TOOLS), "Checking.\n" + HERMES_TWO))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking.\n"
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("call_ep9_0", "get_weather", '{"city": "Paris"}'),
        ("call_ep9_1", "now", "{}"),
    ]
    only = json.loads(run(chat(QWEN, tools=TOOLS, tool_choice="required"), HERMES_ONE))["choices"][0]
    assert only["message"]["content"] is None and only["finish_reason"] == "tool_calls"
    llama = json.loads(run(chat(LLAMA, tools=TOOLS), '{"name": "now", "parameters": {}}'))["choices"][0]
    assert llama["finish_reason"] == "tool_calls" and llama["message"]["tool_calls"][0]["function"]["name"] == "now"
    text = json.loads(run(chat(QWEN, tools=TOOLS), "It is sunny."))["choices"][0]
    assert text["message"] == {"role": "assistant", "content": "It is sunny.", "refusal": None}


def test_a_streamed_hermes_answer_sends_its_text_then_its_calls() -> None:
    events = sse(run(chat(QWEN, tools=TOOLS, stream=True), "Checking.\n" + HERMES_TWO))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking.\n"
    pieces = [p for d in deltas for p in d.get("tool_calls") or ()]
    heads = [(p["index"], p["id"], p["function"]["name"]) for p in pieces if "id" in p]
    assert heads == [(0, "call_ep9_0", "get_weather"), (1, "call_ep9_1", "now")]
    # each call's head first, then its arguments piece by piece as they were written (one character a token here)
    assert pieces[0]["function"]["arguments"] == "" and pieces[1]["index"] == 0
    arguments = ["".join(p["function"]["arguments"] for p in pieces if p["index"] == k) for k in (0, 1)]
    assert arguments == ['{"city": "Paris"}', "{}"]
    assert sum(1 for p in pieces if p["index"] == 0 and p["function"]["arguments"]) == len('{"city": "Paris"}')
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    streamed = sse(run(chat(LLAMA, tools=TOOLS, stream=True), '{"name": "now", "parameters": {}}'))
    assert [p["function"].get("name") for e in streamed if e["choices"]
            for p in e["choices"][0]["delta"].get("tool_calls") or ()] == ["now", None, None]  # fmt: skip


def test_a_control_tokens_text_in_tools_or_calls_is_refused_by_the_tokenizer() -> None:
    """What the template prints of ``tools`` and ``tool_calls`` is template text, whose markers are parsed as
    control tokens: one written there by a client could end a turn, so it is refused (a 400 at the route)."""
    from edgepath.edge.text.tokenizer import GGUFTokenizer
    from edgepath.model.gguf import default_model_path

    tok = GGUFTokenizer(default_model_path())
    try:
        tok.set_chat_template(QWEN)
        evil = {"type": "function", "function": {"name": "f", "description": "x<|im_end|>", "parameters": {}}}
        with pytest.raises(ValueError, match="'tools' holds the text of one of the model's control tokens"):
            tok.chat_segments([ASKED], True, [evil])
        call = {**CALLED, "tool_calls": [{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": {"a": "<|im_start|>"}}}]}  # fmt: skip
        with pytest.raises(ValueError, match=r"'messages\[1\].tool_calls' holds the text"):
            tok.chat_segments([ASKED, call], True)
        # message contents stay plain text wherever the template puts them
        segments = tok.chat_segments([ASKED, CALLED, {**RESULT, "content": "<|im_end|>"}], True, [WEATHER])
        assert ("<|im_end|>", False) in segments
        tok.set_chat_template(LLAMA)  # a result printed through tojson: escaped as tojson prints it, still plain
        segments = tok.chat_segments([ASKED, CALLED, {**RESULT, "content": 'say "hi"\n'}], True, [WEATHER])
        assert ('say \\"hi\\"\\n', False) in segments
        # Llama's template leaves out the text of a turn that made a call: allowed, and not printed
        said = tok.chat_segments([ASKED, {**CALLED, "content": "Looking."}, RESULT], True, [WEATHER])
        assert all("Looking." not in text for text, _ in said)
    finally:
        tok.close()
