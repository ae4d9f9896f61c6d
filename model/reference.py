"""A plain numpy forward pass of a llama-architecture GGUF: the source of the model's known answer.

llama.cpp's CPU kernels differ by instruction set (AVX-512, AVX2, plain x86-64), so an answer computed by
llama.cpp on one machine proves nothing about another.  This module computes the same logits with none of
them: the weights are dequantized by ``gguf`` (the GGUF project's own numpy code) and every product is a
float64 numpy matmul, which is right on every CPU this project has seen.  It is slow (seconds for a short
prompt) and it is never on a request's path: ``python -m edgepath.model.reference`` writes the reference that
the handler's start-up check (:mod:`edgepath.model.known_answer`) compares llama.cpp against, and a test
recomputes it on whatever machine runs the suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepath.model.known_answer import KnownAnswer


class ReferenceError(ValueError):
    """The GGUF is not one this forward pass can compute (another architecture, or a missing tensor)."""


@dataclass(frozen=True)
class Hyper:
    """What the forward pass needs of the GGUF's ``llama.*`` metadata."""

    layers: int
    embedding: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_base: float
    rms_eps: float


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ReferenceError(f"the reference forward pass needs the gguf package ({exc}): pip install gguf") from exc
    return gguf


class Reference:
    """The weights of one GGUF, dequantized to float64 once."""

    def __init__(self, path: Path) -> None:
        gguf = _gguf()
        reader = gguf.GGUFReader(str(path))
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ReferenceError(f"{path}: architecture {arch!r}; the reference forward pass computes 'llama' only")
        heads = int(_field(reader, "llama.attention.head_count"))
        embedding = int(_field(reader, "llama.embedding_length"))
        self.hyper = Hyper(
            layers=int(_field(reader, "llama.block_count")),
            embedding=embedding,
            heads=heads,
            kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
            head_dim=embedding // heads,
            rope_base=float(_field(reader, "llama.rope.freq_base")),
            rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        )
        tensors = {t.name: t for t in reader.tensors}

        def weight(name: str) -> np.ndarray:
            tensor = tensors.get(name)
            if tensor is None:
                raise ReferenceError(f"{path}: no tensor {name}")
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            return np.asarray(values, dtype=np.float64).reshape(tuple(int(n) for n in reversed(tensor.shape)))

        self.embeddings = weight("token_embd.weight")
        self.output = weight("output.weight") if "output.weight" in tensors else self.embeddings  # tied
        self.output_norm = weight("output_norm.weight")
        names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
        self.blocks = [{n: weight(f"blk.{i}.{n}.weight") for n in names} for i in range(self.hyper.layers)]

    def logits(self, ids: list[int] | np.ndarray) -> np.ndarray:
        """The logits at every position of ``ids`` decoded from an empty context: (len(ids), vocabulary)."""
        h = self.hyper
        ids = np.asarray(ids, dtype=np.int64)
        count = len(ids)
        x = self.embeddings[ids]
        rope = _rope_table(count, h.head_dim, h.rope_base)
        causal = np.triu(np.full((count, count), -np.inf), k=1)
        group = h.heads // h.kv_heads
        for block in self.blocks:
            a = _rms_norm(x, block["attn_norm"], h.rms_eps)
            q = _rotate((a @ block["attn_q"].T).reshape(count, h.heads, h.head_dim), rope)
            k = _rotate((a @ block["attn_k"].T).reshape(count, h.kv_heads, h.head_dim), rope)
            v = (a @ block["attn_v"].T).reshape(count, h.kv_heads, h.head_dim)
            k = np.repeat(k, group, axis=1)
            v = np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(h.head_dim) + causal
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            attended = np.einsum("hqk,khd->qhd", scores, v).reshape(count, h.heads * h.head_dim)
            x = x + attended @ block["attn_output"].T
            f = _rms_norm(x, block["ffn_norm"], h.rms_eps)
            gate = f @ block["ffn_gate"].T
            x = x + ((gate / (1.0 + np.exp(-gate))) * (f @ block["ffn_up"].T)) @ block["ffn_down"].T
        return _rms_norm(x, self.output_norm, h.rms_eps) @ self.output.T


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ReferenceError(f"GGUF metadata has no {key}")
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value[0]


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope_table(count: int, dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angle per pair: llama.cpp's "normal" RoPE (LLAMA_ROPE_TYPE_NORM), whose
    pairs are adjacent elements (2i, 2i+1), as the llama architecture's GGUF stores Q and K."""
    theta = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.arange(count, dtype=np.float64)[:, None] * theta[None, :]
    return np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]


def _rotate(x: np.ndarray, rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    cos, sin = rope
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


#: the known answer's prompt: the README's example chat in SmolLM2's template (ChatML), tokenized by the
#: model's own vocabulary with its markers as control tokens
KNOWN_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
KNOWN_TOP = 8  # tokens per checked position
KNOWN_CONTINUATION = 12  # greedy answer tokens at most (the checked positions are the answer's)
#: logits llama.cpp may differ by (F16 weights, LLAMAFILE off: at most 0.094 from the exact ones over 49
#: positions and the whole vocabulary on an AVX2 build; docs/MODEL.md) -- three times that
KNOWN_TOLERANCE = 0.3


def known_answer(path: Path, ids: list[int]) -> KnownAnswer:
    """The reference for ``path``: ``ids`` (the prompt) and the exact model's greedy answer after it; at the
    prompt's last position and every answer position, the best :data:`KNOWN_TOP` tokens and their logits."""
    from edgepath.model.convert import sha256

    model = Reference(path)
    eos = _eos(path)
    seq = list(ids)
    for _ in range(KNOWN_CONTINUATION):
        token = int(model.logits(seq)[-1].argmax())
        if token == eos:
            break
        seq.append(token)
    rows = model.logits(seq)
    positions = list(range(len(ids) - 1, len(seq)))
    top = [np.argsort(-rows[p], kind="stable")[:KNOWN_TOP] for p in positions]
    return KnownAnswer(
        model=path.name,
        sha256=sha256(path),
        ids=tuple(seq),
        positions=tuple(positions),
        top=tuple(tuple(int(t) for t in row) for row in top),
        logits=tuple(tuple(round(float(rows[p][t]), 4) for t in row) for p, row in zip(positions, top, strict=True)),
        tolerance=KNOWN_TOLERANCE,
        source="edgepath.model.reference: float64 numpy forward pass over the GGUF's weights dequantized by gguf",
    )


def _eos(path: Path) -> int:
    return int(_field(_gguf().GGUFReader(str(path)), "tokenizer.ggml.eos_token_id"))


def tokenize(path: Path, text: str) -> list[int]:
    """``text`` in the model's vocabulary, control markers parsed (llama.cpp's tokenizer, no arithmetic)."""
    import ctypes

    from edgepath.model.gguf import llama_cpp, load_model

    lib = llama_cpp()
    model = load_model(path, vocab_only=True)
    try:
        vocab = lib.llama_model_get_vocab(model)
        data = text.encode()
        out = (ctypes.c_int32 * (len(data) + 8))()
        n = lib.llama_tokenize(vocab, data, len(data), out, len(out), False, True)
        if n < 0:
            raise ReferenceError(f"llama_tokenize needs {-n} tokens for the known prompt")
        return list(out[:n])
    finally:
        lib.llama_model_free(model)


def main(argv: list[str] | None = None) -> int:
    """Write the default model's (or ``--model``'s) known answer into ``known_answers.json``."""
    import argparse
    import json

    from edgepath.model.gguf import default_model_path

    parser = argparse.ArgumentParser(prog="python -m edgepath.model.reference", description=main.__doc__)
    parser.add_argument(
        "--model", type=Path, default=None, help="a llama-architecture GGUF (default: the default model)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("known_answers.json"))
    args = parser.parse_args(argv)
    path = args.model or default_model_path()
    entry = known_answer(path, tokenize(path, KNOWN_PROMPT)).to_json()
    entries = json.loads(args.out.read_text()) if args.out.exists() else []
    entries = [e for e in entries if e["sha256"] != entry["sha256"]] + [entry]
    lines = (",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in e.items()) for e in entries)
    args.out.write_text("[\n" + ",\n".join("{\n" + body + "\n}" for body in lines) + "\n]\n")
    print(f"wrote the known answer of {path.name} ({len(entry['ids'])} ids, {len(entry['positions'])} positions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
