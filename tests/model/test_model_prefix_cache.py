"""Prefix reuse on the real SmolLM2 GGUF: hits in place and from host memory, partial hits, eviction, running
sequences never short of cells, cancel during prefill, and exactness (greedy answers with and without a hit
are the same, token for token, but where two tokens are within the batch tolerance of each other)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

from helpers.model import stream_of

from edgepath.contract import wire
from edgepath.contract.wire import Sampling
from edgepath.edge.choices import choice_sampling
from edgepath.edge.text.tokenizer import GGUFTokenizer
from edgepath.model.gguf import default_model_path, deterministic_libs
from edgepath.model.known_answer import BATCH_TOLERANCE, FLASH_TOLERANCE, batch_tolerance
from edgepath.model.llama import LlamaHandler
from edgepath.model.llama_options import LlamaOptions
from edgepath.model.prefix import common_prefix
from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, HandlerConfig, SlotRequest

SLOTS = 2
IN_CAP = 512
OUT_CAP = 24
BASE = {"threads": "1", "ctx_per_slot": "512"}
#: what a logit may move by with how its step was batched, with the options these handlers run with (the default
#: flash attention)
TOLERANCE = batch_tolerance(LlamaOptions.parse(BASE, IN_CAP).flash_attn)
SYSTEM = (
    "You are the help desk of a small railway. You answer questions about routes, tickets, luggage, pets "
    "and refunds, politely and briefly. When you are not sure, say so and point to the ticket office."
)


@pytest.fixture(scope="module")
def tok() -> GGUFTokenizer:
    return GGUFTokenizer(default_model_path())


def chat(tok: GGUFTokenizer, *turns: str, system: str = SYSTEM) -> np.ndarray:
    """user, assistant, user, ... after the system prompt, as the edge renders and tokenizes a chat."""
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    frame = np.zeros(IN_CAP, dtype=np.int32)
    return frame[: tok.encode_chat_into(messages, frame)].copy()


class Slots:
    """Slot memory (int32 input and output areas per slot) and the loop the slot server runs."""

    def __init__(self, handler: LlamaHandler) -> None:
        self.handler = handler
        self.inputs = np.zeros((handler.slots, IN_CAP), dtype=np.int32)
        self.outputs = np.zeros((handler.slots, OUT_CAP), dtype=np.int32)

    def add(self, slot: int, prompt: np.ndarray, max_new: int = OUT_CAP) -> list[Emit]:
        self.inputs[slot, : len(prompt)] = prompt
        request = SlotRequest(
            slot, slot, max_new, 0, self.inputs[slot, : len(prompt)], self.outputs[slot, :max_new], Sampling()
        )
        return self.handler.add(request, 0.0)

    def drive(self, max_steps: int = 600) -> dict[int, Emit]:
        final: dict[int, Emit] = {}
        for _ in range(max_steps):
            if self.handler.wake_in(0.0) is None:
                return final
            for emit in self.handler.step(0.0):
                if emit.status is not None:
                    final[emit.slot] = emit
        raise AssertionError(f"still running after {max_steps} steps")

    def ask(self, slot: int, prompt: np.ndarray, max_new: int = OUT_CAP) -> tuple[list[int], Emit]:
        assert self.add(slot, prompt, max_new) == []
        final = self.drive()[slot]
        return self.outputs[slot, : final.count].tolist(), final


def handler_with(**options: str) -> LlamaHandler:
    return LlamaHandler.from_config(HandlerConfig(SLOTS, IN_CAP, OUT_CAP, {**BASE, **options}))


@dataclass(frozen=True)
class Greedy:
    """A greedy answer computed from scratch, with each position's runner-up and margin (its best token's logit
    less the runner-up's: log probabilities differ by what the logits do)."""

    ids: list[int]
    seconds: list[int]
    margins: list[float]

    def check(self, answer: list[int], whole: bool = True) -> None:
        """``answer`` is this one token for token -- but where the best two tokens are within twice the batch
        tolerance of each other it may take the runner-up (each logit moves by up to TOLERANCE with how a step
        was batched, on the default build: docs/MODEL.md, "Exactness"), and it goes its own way from there.
        ``whole``: as long as this one (else a beginning of it)."""
        for k, (got, want) in enumerate(zip(answer, self.ids, strict=False)):
            if got != want:
                assert got == self.seconds[k] and self.margins[k] <= 2 * TOLERANCE, (
                    f"token {k}: {got} where the answer computed from scratch has {want} (runner-up "
                    f"{self.seconds[k]}, {self.margins[k]:.3f} behind it in log probability): {answer} vs {self.ids}"
                )
                return
        assert len(answer) == len(self.ids) if whole else len(answer) <= len(self.ids), (answer, self.ids)


@pytest.fixture(scope="module")
def reference(tok: GGUFTokenizer):
    """Greedy answers computed from scratch (prefix reuse off), by prompt, with each token's two likeliest."""
    handler = handler_with(prefix_cache="off")
    top = 2
    words = wire.record_words(top)
    inputs = np.zeros(IN_CAP, dtype=np.int32)
    outputs = np.zeros(OUT_CAP * words, dtype=np.int32)
    answers: dict[bytes, Greedy] = {}

    def answer(prompt: np.ndarray) -> Greedy:
        key = prompt.tobytes()
        if key not in answers:
            inputs[: len(prompt)] = prompt
            request = SlotRequest(0, 0, OUT_CAP, wire.logprobs_flags(top), inputs[: len(prompt)], outputs, Sampling())
            assert handler.add(request, 0.0) == []
            final = Slots(handler).drive()[0]
            records = wire.read_records(outputs[: final.count], top)  # its count is in output words
            assert records.top_ids[:, 0].tolist() == records.ids.tolist()  # greedy: the likeliest each time
            margins = records.top_logprobs[:, 0] - records.top_logprobs[:, 1]
            answers[key] = Greedy(records.ids.tolist(), records.top_ids[:, 1].tolist(), margins.tolist())
        return answers[key]

    yield answer
    handler.close()


@pytest.fixture
def cached():
    handler = handler_with()
    yield Slots(handler)
    handler.close()


def test_a_shared_system_prompt_is_reused_and_the_answers_are_exact(tok, reference, cached: Slots) -> None:
    first = chat(tok, "How do I get a refund?")
    _, miss = cached.ask(0, first)
    assert miss.cached_tokens == 0
    for slot, question in enumerate(("Can I bring my dog?", "Is there wifi on board?", "Where can I eat?")):
        prompt = chat(tok, question)
        answer, hit = cached.ask(slot % SLOTS, prompt)
        shared = common_prefix(prompt, first)
        assert hit.cached_tokens == shared > len(tok.encode(SYSTEM))  # a partial hit: up to where they differ
        reference(prompt).check(answer)
    stats = cached.handler.book.stats
    assert (stats.hits, stats.misses) == (3, 1)
    assert cached.handler.stats.prompt_tokens < sum(len(chat(tok, q)) for q in ("a", "b", "c", "d"))


def test_the_same_prompt_again_reuses_all_but_its_last_token(tok, reference, cached: Slots) -> None:
    prompt = chat(tok, "What is the luggage limit?")
    cached.ask(0, prompt)
    answer, hit = cached.ask(1, prompt)  # another slot: the request finds the sequence that holds it
    assert hit.cached_tokens == len(prompt) - 1
    reference(prompt).check(answer)


def test_a_conversation_continues_from_its_last_turn(tok, reference, cached: Slots) -> None:
    turn1 = chat(tok, "Can I change my ticket?")
    ids, _ = cached.ask(0, turn1)
    reply = tok.decode(np.array(ids, dtype=np.int32))
    turn2 = chat(tok, "Can I change my ticket?", reply, "And how much does it cost?")
    answer, hit = cached.ask(1, turn2)
    assert hit.cached_tokens >= len(turn1)  # the whole first turn, and the answer as far as it tokenizes alike
    reference(turn2).check(answer)


def test_a_saved_copy_is_restored_after_its_sequence_was_reused(tok, reference, cached: Slots) -> None:
    prompt = chat(tok, "Do children travel free?")
    cached.ask(0, prompt)
    # Both sequences now serve unrelated requests (a different system prompt): the prefix survives only in
    # host memory.
    for slot in range(SLOTS):
        cached.add(slot, chat(tok, f"Count to {slot + 2}.", system="You are terse."), 4)
    cached.drive()
    assert all(held is None or common_prefix(held, prompt) < 16 for held in cached.handler.book.holding())
    follow_up = chat(tok, "Do children travel free on weekends?")
    answer, hit = cached.ask(1, follow_up)
    assert hit.cached_tokens == common_prefix(follow_up, prompt)
    assert cached.handler.book.stats.restored == 1
    reference(follow_up).check(answer)


def test_requests_arriving_together_compute_their_shared_prefix_once(tok, reference) -> None:
    """The second request waits while the first computes the system prompt, then copies it from the first's
    (running) sequence and computes only its own question."""
    handler = handler_with()
    slots = Slots(handler)
    try:
        prompts = [chat(tok, "Can I bring my bicycle?"), chat(tok, "Can I bring my cat?")]
        for slot, prompt in enumerate(prompts):
            assert slots.add(slot, prompt) == []
        final = slots.drive()
        shared = common_prefix(*prompts)
        assert (final[0].cached_tokens, final[1].cached_tokens) == (0, shared)
        assert handler.book.stats.shared == 1
        assert handler.stats.prompt_tokens == len(prompts[0]) + len(prompts[1]) - shared
        assert handler.blobs.lent == len(handler.book.saved)  # the copy's memory went back to the pool
        for slot, prompt in enumerate(prompts):
            reference(prompt).check(slots.outputs[slot, : final[slot].count].tolist())
    finally:
        handler.close()


def test_the_n_choices_of_one_prompt_compute_it_once(tok) -> None:
    """OpenAI's ``n``: the same prompt in four slots at once, each choice with its own seed (the edge's
    ``seed + index``) -- the first computes the prompt, the three others copy it and compute only its last token
    (whose logits they sample from), then each samples its own answer."""
    handler = LlamaHandler.from_config(HandlerConfig(4, IN_CAP, OUT_CAP, BASE))
    slots = Slots(handler)
    try:
        prompt = chat(tok, "Tell me about the night train.")
        for choice in range(4):
            slots.inputs[choice, : len(prompt)] = prompt
            sampling = choice_sampling(Sampling(temperature=1.0, seed=5), choice)
            request = SlotRequest(
                choice, choice, OUT_CAP, 0, slots.inputs[choice, : len(prompt)], slots.outputs[choice], sampling
            )
            assert handler.add(request, 0.0) == []
        final = slots.drive()
        assert [final[c].cached_tokens for c in range(4)] == [0] + [len(prompt) - 1] * 3
        assert handler.book.stats.shared == 3
        assert handler.stats.prompt_tokens == len(prompt) + 3  # once, and one token for each other choice
        answers = {tuple(slots.outputs[c, : final[c].count].tolist()) for c in range(4)}
        assert len(answers) > 1  # sampled with their own seeds, the choices differ
    finally:
        handler.close()


def test_least_recently_used_copies_are_evicted_within_the_capacity(tok) -> None:
    handler = handler_with(cache_mb="2")  # room for two of these ~40-token sequences (23 KB of KV per token)
    slots = Slots(handler)
    mapped = handler.blobs.allocated  # by the warm-up
    try:
        prompts = [chat(tok, "Hello!", system=f"You are assistant number {i} of {'x' * (20 + i)}") for i in range(4)]
        for i, prompt in enumerate(prompts):  # four conversations with nothing in common beyond the template
            slots.ask(i % SLOTS, prompt, 8)
        book = handler.book
        assert book.stats.saved == 4 and book.stats.evicted == 4 - len(book.saved) >= 1
        assert 0 < book.saved_bytes <= book.capacity
        # the evicted copies' memory went back to the pool and held the later ones: less mapped than saved
        assert handler.blobs.lent == len(book.saved) and handler.blobs.allocated - mapped < book.stats.saved
        kept = [int(common_prefix(s.tokens, p) == len(p)) for p in prompts for s in book.saved]
        assert sum(kept[-len(book.saved) :]) == 1  # the last conversation is kept ...
        assert sum(kept[: len(book.saved)]) == 0  # ... the first, least recently used, is gone
    finally:
        handler.close()


def test_running_sequences_always_find_their_cells(tok) -> None:
    """Host copies live outside the KV cache: with the cache full, every slot still runs to its whole
    ctx_per_slot, at the same time."""
    ctx = 64
    handler = LlamaHandler.from_config(
        HandlerConfig(SLOTS, IN_CAP, 128, {"threads": "1", "ctx_per_slot": str(ctx), "cache_mb": "2"})
    )
    slots = Slots(handler)
    slots.outputs = np.zeros((SLOTS, 128), dtype=np.int32)
    try:
        for i in range(3):
            slots.ask(0, chat(tok, "Hi", system=f"Assistant {i}: {'be brief. ' * 3}")[:40], 12)
        assert handler.book.saved_bytes > 0
        prompts = [chat(tok, "Tell me a long story.", system=f"Teller {i}.") for i in range(SLOTS)]
        for slot, prompt in enumerate(prompts):
            assert slots.add(slot, prompt, 128) == []
        final = slots.drive()
        for slot, prompt in enumerate(prompts):
            # Sampling stops at the sequence's end unless the model ends the story first.
            assert final[slot].status in (Status.LENGTH, Status.STOP)
            if final[slot].status == Status.LENGTH:
                assert final[slot].count == ctx - len(prompt) + 1
    finally:
        handler.close()


def test_cancel_during_prefill_releases_the_sequence(tok) -> None:
    handler = handler_with(batch="24")  # a long prompt needs several steps
    slots = Slots(handler)
    try:
        prompt = chat(tok, "Tell me everything about night trains.")
        assert len(prompt) > 48
        slots.add(0, prompt)
        handler.step(0.0)
        stream = stream_of(handler, 0)
        assert 0 < handler.kv_positions(stream) < len(prompt)
        assert handler.cancel(0) is True
        assert handler.kv_positions(stream) == 0 and handler.running == 0
        assert handler.book.holding()[stream] is None and handler.book.saved_bytes == 0
        _, again = slots.ask(1, prompt, 2)
        assert again.cached_tokens == 0  # nothing of the cancelled prefill was kept
    finally:
        handler.close()


def test_prefix_cache_off_reuses_nothing(tok) -> None:
    handler = handler_with(prefix_cache="off")
    slots = Slots(handler)
    try:
        prompt = chat(tok, "Hello!")
        slots.ask(0, prompt, 4)
        _, again = slots.ask(0, prompt, 4)
        assert again.cached_tokens == 0
        assert all(handler.kv_positions(s) == 0 for s in range(SLOTS))
    finally:
        handler.close()


def test_one_shared_kv_stream_works_too(tok, reference) -> None:
    """``kv_unified=on`` (measured slower: docs/MODEL.md) still serves -- the same answer as a stream per
    sequence -- and reuses prefixes."""
    handler = handler_with(kv_unified="on")
    slots = Slots(handler)
    try:
        first = chat(tok, "What is the capital of France?")
        ids, miss = slots.ask(0, first, 12)
        reference(first).check(ids, whole=False)
        assert miss.cached_tokens == 0
        _, hit = slots.ask(1, chat(tok, "What is the capital of Italy?"))
        assert hit.cached_tokens == common_prefix(first, chat(tok, "What is the capital of Italy?"))
    finally:
        handler.close()


@pytest.mark.parametrize(("flash_attn", "tolerance"), [("off", BATCH_TOLERANCE), ("auto", FLASH_TOLERANCE)])
def test_a_prompt_split_over_steps_gives_its_logits_within_the_batch_tolerance(flash_attn, tolerance) -> None:
    """Why reuse gives the same answer: a token's logits hardly depend on how the prompt before it was cut into
    steps -- on the default build (llamafile's kernels) within BATCH_TOLERANCE without flash attention, within
    FLASH_TOLERANCE with it (its kernel accumulates one query row and a tile of them differently), with the same
    best token."""
    from helpers.split_logits import differences

    found = differences(flash_attn=flash_attn)
    assert found.pop("argmax") == 1.0
    assert max(found.values()) <= tolerance, found


def test_deterministic_on_a_prompt_split_over_steps_gives_bit_identical_logits() -> None:
    """deterministic=on: llama.cpp without llamafile, loaded in a process of its own (the library is chosen before
    its first load): every cut gives the one step's logits bit for bit."""
    libs = deterministic_libs()
    if not (libs / "libllama.so").exists():
        pytest.fail(f"the deterministic=on build is not in {libs}: `make deterministic` builds it (make test does)")
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "helpers.split_logits", "--deterministic"],
        cwd=tests,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found.pop("argmax") == 1.0 and set(found.values()) == {0.0}, found
