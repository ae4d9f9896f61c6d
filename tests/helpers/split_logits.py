"""A prompt's last logits computed in one step and cut into steps several ways, on the default model: how far
they differ by how the prompt was batched (0 on a batch-invariant build).  Run as a program it loads the build
``--deterministic`` names first (llama.cpp's library is chosen before its first load) and prints the largest
difference per cut as JSON: ``python -m helpers.split_logits [--deterministic]`` with ``tests`` on the path."""

from __future__ import annotations

import argparse
import ctypes
import json

import numpy as np

from edgepath.model.gguf import default_model_path, llama_cpp, load_model
from edgepath.model.llama_context import context_params
from edgepath.model.llama_options import LlamaOptions

CAP = 640
QUESTION = "Which platform does the night train leave from?"
#: a system prompt of ~500 tokens: flash attention's differences grow with the positions a token attends
SYSTEM = "You are a helpful assistant at a railway station. " + " ".join(
    f"Train {n} leaves from platform {n % 9 + 1} at {n % 12 + 1} o'clock and stops at every town on the coast."
    for n in range(20)
)


def differences(deterministic: bool = False, flash_attn: str = "off") -> dict[str, float]:
    """{cuts: largest |logit difference| from the prompt computed in one step} (and ``argmax``: 1 when every cut's
    best token is the one step's), with llama.cpp's flash attention ``flash_attn``."""
    from edgepath.edge.text.tokenizer import GGUFTokenizer

    lib = llama_cpp(deterministic)
    options = LlamaOptions.parse({"threads": "1", "flash_attn": flash_attn}, CAP)
    frame = np.zeros(CAP, dtype=np.int32)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    prompt = frame[: GGUFTokenizer(default_model_path()).encode_chat_into(messages, frame)]
    model = load_model(options.model, vocab_only=False)
    ctx = lib.llama_init_from_model(model, context_params(lib, 1, options, CAP))
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))

    def logits(cuts: list[int]) -> np.ndarray:
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        start = 0
        for end in [*cuts, len(prompt)]:
            batch = lib.llama_batch_init(end - start, 0, 1)
            for i in range(end - start):
                batch.token[i] = int(prompt[start + i])
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = int(start + i == len(prompt) - 1)
            batch.n_tokens = end - start
            try:
                assert lib.llama_decode(ctx, batch) == 0
            finally:
                lib.llama_batch_free(batch)
            start = end
        row = lib.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (n_vocab,)).copy()

    try:
        whole = logits([])
        n = len(prompt)
        out: dict[str, float] = {}
        best = 1.0
        for cuts in ([n - 1], [n // 2], [7, n // 3, n - 5], list(range(8, n, 8))):
            other = logits(cuts)
            out[str(cuts if len(cuts) < 4 else "every 8")] = float(np.abs(other - whole).max())
            best = min(best, float(other.argmax() == whole.argmax()))
        out["argmax"] = best
        return out
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deterministic", action="store_true")
    print(json.dumps(differences(parser.parse_args().deterministic)))


if __name__ == "__main__":
    main()
