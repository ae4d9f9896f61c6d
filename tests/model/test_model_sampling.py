"""The sampling fields on the real SmolLM2 GGUF, each shown by what it does to the answer: llama.cpp's samplers
applied per sequence in llama-server's order -- logit biases, the penalties over the last 64 tokens (the prompt's
included), top-k, min-p, temperature, the seeded draw (model/sampler.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

from edgepath.contract import wire
from edgepath.contract.wire import PENALTY_LAST_N, Sampling
from edgepath.edge.text.tokenizer import GGUFTokenizer
from edgepath.model.gguf import default_model_path
from edgepath.model.llama import LlamaHandler
from edgepath.model.sampler import dist_seed
from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, HandlerConfig, SlotRequest

IN_CAP, OUT_CAP = 256, 1024  # room for 24 tokens' log-probability records
OPTIONS = {"threads": "1", "ctx_per_slot": "256", "prefix_cache": "off"}  # one thread: the CPUs are shared


@pytest.fixture(scope="module")
def tok() -> GGUFTokenizer:
    return GGUFTokenizer(default_model_path())


@pytest.fixture(scope="module")
def handler():
    h = LlamaHandler.from_config(HandlerConfig(2, IN_CAP, OUT_CAP, dict(OPTIONS)))
    yield h
    h.close()


def chat(tok: GGUFTokenizer, user: str) -> np.ndarray:
    frame = np.zeros(IN_CAP, dtype=np.int32)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": user}]
    return frame[: tok.encode_chat_into(messages, frame)].copy()


def run(
    handler: LlamaHandler, prompt: np.ndarray, sampling: Sampling, max_new: int = 16, flags: int = 0
) -> tuple[np.ndarray, Emit]:
    """One request alone on slot 0, stepped to its end: its output words and its final Emit."""
    inputs, outputs = np.zeros(IN_CAP, dtype=np.int32), np.zeros(OUT_CAP, dtype=np.int32)
    inputs[: len(prompt)] = prompt
    request = SlotRequest(0, 1, max_new, flags, inputs[: len(prompt)], outputs[:max_new], sampling)
    emits = handler.add(request, 0.0)
    for _ in range(4 * max_new):
        final = next((e for e in emits if e.status is not None), None)
        if final is not None:
            return outputs[: final.count].copy(), final
        emits = handler.step(0.0)
    raise AssertionError("the request did not end")


def answer(handler: LlamaHandler, prompt: np.ndarray, sampling: Sampling, max_new: int = 16) -> list[int]:
    return run(handler, prompt, sampling, max_new)[0].tolist()


def test_a_logit_bias_of_minus_100_on_the_greedy_token_changes_the_greedy_answer(
    handler: LlamaHandler, tok: GGUFTokenizer
) -> None:
    prompt = chat(tok, "What is the capital of France?")
    greedy = answer(handler, prompt, Sampling())
    assert "Paris" in tok.decode(np.array(greedy))
    banned = answer(handler, prompt, Sampling(logit_bias=((greedy[0], -100.0),)))
    assert banned[0] != greedy[0] and greedy[0] not in banned


def test_a_logit_bias_of_plus_100_forces_its_token(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    (forced,) = tok.encode(" Paris").tolist()
    prompt = chat(tok, "Name a colour.")
    assert forced not in answer(handler, prompt, Sampling(), 8)
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=3)):  # greedy and drawn alike
        assert answer(handler, prompt, replace(sampling, logit_bias=((forced, 100.0),)), 8) == [forced] * 8


@pytest.mark.parametrize(
    "penalty",
    [
        Sampling(frequency_penalty=2.0),
        Sampling(presence_penalty=2.0),
        Sampling(repetition_penalty=1.5),
    ],
    ids=["frequency_penalty", "presence_penalty", "repetition_penalty"],
)
def test_a_strong_penalty_stops_the_token_the_prompt_repeats(
    handler: LlamaHandler, tok: GGUFTokenizer, penalty: Sampling
) -> None:
    """The penalties count the prompt's tail too (llama-server's way): a word the prompt repeats is not picked."""
    prompt = tok.encode("one, one, one, one, one, one,")
    (repeated,) = tok.encode(" one").tolist()
    assert answer(handler, prompt, Sampling(), 8)[0] == repeated  # greedy goes on repeating it
    assert repeated not in answer(handler, prompt, penalty, 8)


def test_presence_and_frequency_penalties_are_llama_cpps_over_the_last_64_tokens(
    handler: LlamaHandler, tok: GGUFTokenizer
) -> None:
    """Each greedy pick is the likeliest token once its log probability (the model's, as the records carry it) is
    lowered by ``count x frequency_penalty + presence_penalty`` for the tokens among the sequence's last 64 --
    prompt and answer so far: the penalties shift logits, so they shift log probabilities alike."""
    presence, frequency, top = 0.7, 0.5, 20
    prompt = tok.encode("Write the word apple ten times: apple apple apple apple apple apple apple apple apple")
    sampling = Sampling(presence_penalty=presence, frequency_penalty=frequency)
    words, final = run(handler, prompt, sampling, 24 * wire.record_words(top), wire.logprobs_flags(top))
    records = wire.read_records(words, top)
    assert final.status in (Status.LENGTH, Status.STOP) and len(records.ids) >= 8
    sequence, moved = prompt.tolist(), 0
    for token, logprob, ids, logprobs in zip(
        records.ids.tolist(), records.logprobs, records.top_ids, records.top_logprobs, strict=True
    ):
        window = sequence[-PENALTY_LAST_N:]

        def penalized(t: int, lp: float, window: list[int] = window) -> float:
            count = window.count(t)
            return lp - count * frequency - (count > 0) * presence

        best = max(penalized(int(t), float(lp)) for t, lp in zip(ids, logprobs, strict=True))
        assert penalized(token, float(logprob)) >= best - 1e-4
        moved += token != int(ids[0])  # the penalty picked another than the likeliest
        sequence.append(token)
    assert moved > 0  # not a check that greedy alone passes


def test_min_p_of_1_and_top_k_of_1_leave_only_the_likeliest_token(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    prompt = chat(tok, "What is the capital of France?")
    greedy = answer(handler, prompt, Sampling(), 12)
    drawn = [answer(handler, prompt, Sampling(temperature=2.0, seed=seed), 12) for seed in range(3)]
    assert any(d != greedy for d in drawn)  # at temperature 2 the draw wanders ...
    for seed in range(3):  # ... but not with nothing left to draw from
        assert answer(handler, prompt, Sampling(temperature=2.0, seed=seed, min_p=1.0), 12) == greedy
        assert answer(handler, prompt, Sampling(temperature=2.0, seed=seed, top_k=1), 12) == greedy


def test_min_p_draws_only_tokens_at_least_min_p_times_as_likely_as_the_likeliest(
    handler: LlamaHandler, tok: GGUFTokenizer
) -> None:
    """min_p cuts the tail a high temperature would draw from: each drawn token's probability (the model's, as
    the records carry it, before temperature) is at least min_p times the likeliest one's."""
    prompt, min_p = chat(tok, "Tell me a story about a cat."), 0.3

    def below(sampling: Sampling) -> int:
        words, _ = run(handler, prompt, sampling, 16 * wire.record_words(1), wire.logprobs_flags(1))
        records = wire.read_records(words, 1)
        cut = records.top_logprobs[:, 0] + np.log(min_p) - 1e-4
        return int((records.logprobs < cut).sum())

    assert sum(below(Sampling(2.0, seed=seed)) for seed in range(2)) > 0  # the tail is drawn from at temperature 2
    assert all(below(Sampling(2.0, seed=seed, min_p=min_p)) == 0 for seed in range(2))


def test_greedy_needs_no_seed_and_a_given_seed_repeats_itself(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    prompt = chat(tok, "Write one word.")
    assert answer(handler, prompt, Sampling(seed=1), 8) == answer(handler, prompt, Sampling(seed=99), 8)
    for seed in (7, 2**32 - 1, 2**64 - 1):  # 0xFFFFFFFF is llama.cpp's "draw a seed": it must not become one here
        first = answer(handler, prompt, Sampling(temperature=1.0, seed=seed), 8)
        assert answer(handler, prompt, Sampling(temperature=1.0, seed=seed), 8) == first
    assert dist_seed(2**32 - 1) == dist_seed(2**32 - 2) == 2**32 - 2 and dist_seed(2**32 + 5) == 5


def test_a_grammar_and_a_penalty_together_keep_to_the_grammar(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    """The chain is told only of the token the grammar lets through: the penalties count what was written."""
    prompt = chat(tok, "Is the sky blue? Answer yes or no, three times.")
    inputs, outputs = np.zeros(IN_CAP, dtype=np.int32), np.zeros(OUT_CAP, dtype=np.int32)
    inputs[: len(prompt)] = prompt
    sampling = Sampling(temperature=1.0, seed=5, presence_penalty=1.5, frequency_penalty=1.0)
    grammar = 'root ::= ("yes" | "no") ", " ("yes" | "no") ", " ("yes" | "no")'
    request = SlotRequest(0, 1, 16, 0, inputs[: len(prompt)], outputs[:16], sampling, constraint=grammar)
    emits = handler.add(request, 0.0)
    while not any(e.status is not None for e in emits):
        emits = handler.step(0.0)
    final = next(e for e in emits if e.status is not None)
    text = tok.decode(outputs[: final.count])
    parts = text.split(", ")
    assert len(parts) == 3 and set(parts) <= {"yes", "no"}, text


def test_ignore_eos_runs_an_answer_that_would_stop_to_its_max_tokens(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    """vLLM's and llama.cpp's ``ignore_eos``: the end-of-generation tokens are never drawn (a bias of -inf)."""
    prompt = chat(tok, "What is the capital of France?")
    words, final = run(handler, prompt, Sampling(), 24)
    assert final.status == Status.STOP and len(words) < 24  # "The capital of France is Paris."
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=2)):
        words, final = run(handler, prompt, sampling, 24, wire.FLAG_IGNORE_EOS)
        assert final.status == Status.LENGTH and len(words) == 24
        assert handler.eog and not set(words.tolist()) & set(handler.eog)


def test_a_logit_bias_outside_the_vocabulary_is_a_bad_request(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    prompt = chat(tok, "Hi")
    _, final = run(handler, prompt, Sampling(logit_bias=((handler.n_vocab, 1.0),)))
    assert final.status == Status.BAD_REQUEST and final.count == 0
    assert answer(handler, prompt, Sampling(), 4)  # the handler serves on
