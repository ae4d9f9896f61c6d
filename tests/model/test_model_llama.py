"""The llama.cpp slot handler on the real SmolLM2 GGUF: batching, in-place prompt reads, release of KV
cells, per-slot failures and bad configuration (prefix reuse off here: tests/model/test_model_prefix_cache.py).

A numpy buffer stands in for the slot pool's registered memory: the handler only ever sees views of it,
exactly as the slot server hands them over.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

from helpers.model import max_prompt_tokens, stream_of

from edgepath.contract.plan import Prompt, StepPolicy, decodes
from edgepath.contract.wire import Sampling
from edgepath.edge.text.tokenizer import GGUFTokenizer
from edgepath.handlers import load_handler
from edgepath.model.calibration import START_COSTS_ONE_THREAD
from edgepath.model.gguf import default_model_path
from edgepath.model.llama import LlamaHandler
from edgepath.model.llama_options import LlamaOptions
from edgepath.model.prefix import runs
from edgepath.model.threads import ThreadGovernor
from edgepath.native.abi import Status, ffi, lib
from edgepath.slots.handlers import Emit, HandlerConfig, HandlerError, Heartbeat, SlotRequest

SLOTS = 4
IN_CAP = 256
OUT_CAP = 64
# One thread: with the 2 CPUs shared by other jobs, llama.cpp's OpenMP barriers stall on a descheduled
# second thread (a step takes ~8x longer).
OPTIONS = {"threads": "1", "ctx_per_slot": "256", "prefix_cache": "off"}


def chat(tok: GGUFTokenizer, user: str) -> np.ndarray:
    """The model's chat template around one user message, as the edge tokenizes it (a 135M model
    answers to the point with this system message; with the template's default one it rambles)."""
    frame = np.zeros(IN_CAP, dtype=np.int32)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": user}]
    return frame[: tok.encode_chat_into(messages, frame)]


class Pool:
    """Slot memory: per slot an input area and an output area, int32, like the registered pool."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.inputs = np.zeros((slots, IN_CAP), dtype=np.int32)
        self.outputs = np.zeros((slots, OUT_CAP), dtype=np.int32)

    def request(
        self,
        slot: int,
        prompt: np.ndarray,
        max_new: int = OUT_CAP,
        sampling: Sampling | None = None,
        tenant: tuple[int, int] = (0, 0),  # its tenant's floor id and slot floor
    ) -> SlotRequest:
        self.inputs[slot, : len(prompt)] = prompt
        return SlotRequest(
            slot=slot,
            request_id=1000 + slot,
            max_new_tokens=max_new,
            flags=0,
            tokens=self.inputs[slot, : len(prompt)],
            output=self.outputs[slot, :max_new],
            sampling=sampling or Sampling(),
            tenant=tenant[0],
            floor=tenant[1],
        )


def drive(handler: LlamaHandler, max_steps: int = 400) -> dict[int, Emit]:
    """Step until nothing runs (bounded); the final Emit per slot."""
    final: dict[int, Emit] = {}
    for _ in range(max_steps):
        if handler.wake_in(0.0) is None:
            return final
        for emit in handler.step(0.0):
            if emit.status is not None:
                final[emit.slot] = emit
    raise AssertionError(f"handler still running after {max_steps} steps")


@pytest.fixture(scope="module")
def tok() -> GGUFTokenizer:
    return GGUFTokenizer(default_model_path())


@pytest.fixture(scope="module")
def handler():
    h = LlamaHandler.from_config(HandlerConfig(SLOTS, IN_CAP, OUT_CAP, dict(OPTIONS)))
    yield h
    h.close()


@pytest.fixture
def floors_handler():
    """A handler of a test's own: a slot floor a request names holds the others' prompts to ``lent_ms`` while it is
    lent (for an hour), which the module's handler must not carry into the tests after it."""
    h = LlamaHandler.from_config(HandlerConfig(SLOTS, IN_CAP, OUT_CAP, dict(OPTIONS)))
    yield h
    h.close()


def text_of(tok: GGUFTokenizer, pool: Pool, emit: Emit) -> str:
    return tok.decode(pool.outputs[emit.slot, : emit.count])


def kv_empty(handler: LlamaHandler) -> bool:
    """No llama.cpp sequence holds a cell (prefix reuse off: a finished request leaves nothing)."""
    return all(handler.kv_positions(stream) == 0 for stream in range(handler.slots))


def test_the_step_cost_model_is_measured_by_this_machines_warm_up_steps(caplog: pytest.LogCaptureFixture) -> None:
    """Not the start constants of another machine: the five costs fitted to the warm-up's steps, as logged, and
    what the agents read is what the handler plans with."""
    with caplog.at_level(logging.INFO, logger="edgepath.model.llama"):
        h = LlamaHandler.from_config(HandlerConfig(SLOTS, IN_CAP, OUT_CAP, dict(OPTIONS)))
    try:
        line = next(r.getMessage() for r in caplog.records if "step cost model from" in r.getMessage())
        logged = [float(v) for v in re.findall(r"([\d.]+) ms per", line)]
        base = h.cost.base
        costs = base.values()
        assert logged == [pytest.approx(v, abs=6e-3) for v in costs]  # logged rounded
        assert base.prompt_ms > 0 and base.decode_ms > 0 and h.cost.factor == 1.0
        assert base != START_COSTS_ONE_THREAD  # measured, not the start
        load = h.load()
        assert load.costs == h.cost.costs() and load.options == h.planner.policy.options  # what the agents read
        assert load.options.min_prefill == h.options.min_prefill and load.options.batch == h.batch_capacity
    finally:
        h.close()


def test_every_step_is_the_one_the_published_load_plans(floors_handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    """One planner on both sides: before each step the handler's load, replayed through the policy, says how many
    prompt and decoded tokens the step will carry -- and the step carries exactly those: a floor lent out or not,
    and the step that gives a floor's prompt its first token without the streams decoding (objective 7)."""
    handler = floors_handler
    pool = Pool()
    for slot, question in enumerate(["Name a colour.", "What is the capital of France?"]):
        handler.add(pool.request(slot, chat(tok, question), max_new=12), 0.0)
    steps, lent, alone = 0, set(), 0

    def replay() -> None:
        nonlocal steps, alone
        load = handler.load()
        lent.add(load.lent_ms)
        policy = StepPolicy(load.options)
        plan = (load.costs, load.decoding, load.longest, list(load.waiting), load.runs, load.floors, load.lent_ms)
        takes = policy.plan(*plan, load.full)
        decoded = load.decoding if decodes(load.waiting, takes, load.floors) else 0
        alone += load.decoding > decoded
        before = (handler.stats.prompt_tokens, handler.stats.decode_tokens)
        handler.step(0.0)
        steps += 1
        after = (handler.stats.prompt_tokens - before[0], handler.stats.decode_tokens - before[1])
        assert after == (sum(takes), decoded)

    while handler.load().waiting:  # the two without a floor start decoding
        replay()
    # slot 2's tenant has a floor of 2: its prompt first, in a step of its own, and while it holds 1 of its 2 the
    # others' prompts are held to lent_ms (objective 8); its stream outlasts the others'
    mine = chat(tok, "Count to twenty, one number per line.")
    handler.add(pool.request(2, mine, max_new=40, tenant=(1, 2)), 0.0)
    assert handler.load().floors == 1 and handler.load().lent_ms == handler.planner.lent_ms > 0
    while handler.wake_in(0.0) is not None and steps < 200:
        replay()
    assert steps > 3 and handler.wake_in(0.0) is None
    assert alone == 1  # the floor's first-token step, its two streams decoding in the next
    assert lent == {handler.planner.lent_ms, 0.0}  # lent while the others ran, not before the floor was known nor after


def test_a_full_house_gathers_its_prompts_in_the_step_its_published_load_plans(
    handler: LlamaHandler, tok: GGUFTokenizer
) -> None:
    """Objective 9 on the real handler: with every slot taken, the prompts behind one that gets its first token
    join its step within the stall bound -- the step the load the agents read plans, not the join share's."""
    pool = Pool()
    for slot in range(SLOTS - 2):
        handler.add(pool.request(slot, chat(tok, "Count to ten."), max_new=16), 0.0)
    while handler.load().waiting:
        handler.step(0.0)
    for slot, question in ((SLOTS - 2, "Name a colour."), (SLOTS - 1, "What is the capital of France?")):
        handler.add(pool.request(slot, chat(tok, question), max_new=4), 0.0)
    load = handler.load()
    assert load.full and load.slots == SLOTS and load.decoding == SLOTS - 2 and len(load.waiting) == 2
    plan = (load.costs, load.decoding, load.longest, list(load.waiting), load.runs, load.floors, load.lent_ms)
    takes = StepPolicy(load.options).plan(*plan, load.full)
    assert takes == [p.remaining for p in load.waiting]  # both whole, in one step
    assert StepPolicy(load.options).plan(*plan, False)[1] < load.waiting[1].remaining  # the join share would not
    before = (handler.stats.prompt_tokens, handler.stats.decode_tokens)
    handler.step(0.0)
    assert (handler.stats.prompt_tokens - before[0], handler.stats.decode_tokens - before[1]) == (sum(takes), 2)
    drive(handler)


def test_built_in_spec_loads_the_real_model(tok: GGUFTokenizer) -> None:
    h = load_handler("llama", HandlerConfig(2, IN_CAP, OUT_CAP, dict(OPTIONS)))
    try:
        assert isinstance(h, LlamaHandler)
        pool = Pool(2)
        assert h.add(pool.request(0, chat(tok, "What is the capital of France?"), 24), 0.0) == []
        final = drive(h)
        assert final[0].status in (Status.STOP, Status.LENGTH)
        assert "Paris" in text_of(tok, pool, final[0])
    finally:
        h.close()


def test_eog_stops_without_being_written(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    pool = Pool()
    handler.add(pool.request(0, chat(tok, "What is 2+2? Answer with a number only."), OUT_CAP), 0.0)
    final = drive(handler)
    assert final[0].status == Status.STOP
    assert 0 < final[0].count < OUT_CAP
    written = pool.outputs[0, : final[0].count]
    eog = [t for t in written.tolist() if handler.context.is_eog(t)]
    assert eog == []
    assert kv_empty(handler)


def test_length_when_output_is_full(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    pool = Pool()
    handler.add(pool.request(1, chat(tok, "Write a long story about a dragon."), 3), 0.0)
    final = drive(handler)
    assert final[1] == Emit(1, 3, Status.LENGTH)
    assert kv_empty(handler)


def test_progress_is_reported_per_step_and_never_goes_back(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    pool = Pool()
    for slot in range(SLOTS):
        handler.add(pool.request(slot, chat(tok, f"Count to {slot + 3}."), 12), 0.0)
    seen: dict[int, list[int]] = {slot: [] for slot in range(SLOTS)}
    for _ in range(200):
        if handler.wake_in(0.0) is None:
            break
        step = handler.step(0.0)
        assert len({e.slot for e in step}) == len(step)  # at most one report per slot per step
        for emit in step:
            seen[emit.slot].append(emit.count)
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] >= 1


def test_batched_greedy_matches_each_prompt_alone(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    prompts = [chat(tok, q) for q in ("Name a fruit.", "What is 2+2?", "Name a color.", "Say yes.")]
    alone = []
    for prompt in prompts:
        pool = Pool()
        handler.add(pool.request(0, prompt, 8), 0.0)
        final = drive(handler)
        alone.append(pool.outputs[0, : final[0].count].tolist())
    pool = Pool()
    for slot, prompt in enumerate(prompts):
        handler.add(pool.request(slot, prompt, 8), 0.0)
    final = drive(handler)
    together = [pool.outputs[slot, : final[slot].count].tolist() for slot in range(SLOTS)]
    # Without flash attention llama.cpp's CPU results do not depend on the batch's shape: token for token.
    assert together == alone


def test_lone_prompt_is_decoded_straight_from_slot_memory(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    pool = Pool()
    handler.add(pool.request(2, chat(tok, "Hi"), 2), 0.0)
    handler.step(0.0)
    start = pool.inputs[2].ctypes.data
    assert start <= handler.last_token_pointer < start + pool.inputs[2].nbytes
    drive(handler)


def test_mixed_batch_reads_the_prompt_from_the_slot_when_it_decodes_it(
    handler: LlamaHandler, tok: GGUFTokenizer
) -> None:
    """Slot 1's prompt is overwritten in slot memory after add() but before it is decoded: the model
    answers the new prompt, so nothing was copied at add() time."""
    first = chat(tok, "What is the capital of France?")
    second = chat(tok, "What is the capital of Japan?")
    assert len(first) == len(second)

    def run(prompt: np.ndarray, overwrite: np.ndarray | None) -> list[int]:
        pool = Pool()
        handler.add(pool.request(0, chat(tok, "Tell me a joke."), 30), 0.0)
        handler.step(0.0)  # slot 0 is decoding from here on
        handler.add(pool.request(1, prompt, 6), 0.0)
        if overwrite is not None:
            pool.inputs[1, : len(overwrite)] = overwrite
        handler.step(0.0)
        assert handler.last_token_pointer == handler.context.arrays.tokens.ctypes.data  # a mixed batch
        final = drive(handler)
        return pool.outputs[1, : final[1].count].tolist()

    france, japan = run(first, None), run(second, None)
    assert france != japan
    assert "Paris" in tok.decode(np.array(france)) and "Tokyo" in tok.decode(np.array(japan))
    assert run(first, overwrite=second) == japan


def test_cancel_clears_the_sequence_and_others_keep_running(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    pool = Pool()
    handler.add(pool.request(0, chat(tok, "Tell me about the sea."), 40), 0.0)
    handler.add(pool.request(3, chat(tok, "Tell me about the sky."), 40), 0.0)
    for _ in range(6):
        handler.step(0.0)
    sea, sky = stream_of(handler, 0), stream_of(handler, 3)
    assert handler.kv_positions(sky) > 0
    assert handler.cancel(3) is True
    assert handler.kv_positions(sky) == 0
    assert handler.kv_positions(sea) > 0
    final = drive(handler)
    assert set(final) == {0} and final[0].count > 0


def test_bad_token_id_fails_that_slot_only(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    pool = Pool()
    good = chat(tok, "Name an animal.")
    bad = good.copy()
    bad[3] = handler.n_vocab + 7
    handler.add(pool.request(0, good, 5), 0.0)
    handler.add(pool.request(1, bad, 5), 0.0)
    final = drive(handler)
    assert final[1] == Emit(1, 0, Status.BAD_REQUEST)
    assert final[0].status in (Status.LENGTH, Status.STOP) and final[0].count > 0
    assert kv_empty(handler)


class FailingDecode:
    """llama_cpp with ``llama_decode`` failing once (as it does on an out-of-memory compute buffer):
    isolates the handler's error path; everything else is the real library."""

    def __init__(self, lib: object) -> None:
        self._lib = lib
        self.failed = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    def llama_decode(self, ctx: object, batch: object) -> int:
        if not self.failed:
            self.failed = True
            return -3
        return self._lib.llama_decode(ctx, batch)


def test_model_error_fails_the_batch_slots_and_the_handler_keeps_serving(
    handler: LlamaHandler, tok: GGUFTokenizer
) -> None:
    pool = Pool()
    handler.add(pool.request(0, chat(tok, "Name a fruit."), 4), 0.0)
    handler.step(0.0)
    handler.add(pool.request(1, chat(tok, "Name a tree."), 4), 0.0)
    real = handler.context.lib
    handler.context.lib = FailingDecode(real)
    try:
        final = {e.slot: e for e in handler.step(0.0)}
    finally:
        handler.context.lib = real
    assert final[0].status == Status.HANDLER_ERROR and final[0].count == 1
    assert final[1] == Emit(1, 0, Status.HANDLER_ERROR)
    assert handler.running == 0 and kv_empty(handler)
    handler.add(pool.request(1, chat(tok, "What is the capital of France?"), 12), 0.0)
    assert "Paris" in text_of(tok, pool, drive(handler)[1])


def test_prompt_longer_than_the_slot_context_is_refused(tok: GGUFTokenizer) -> None:
    config = HandlerConfig(1, 64, 8, {"ctx_per_slot": "32", "threads": "1", "prefix_cache": "off"})
    assert max_prompt_tokens(config) == 32
    assert max_prompt_tokens(HandlerConfig(1, 16, 8, {"ctx_per_slot": "32"})) == 16
    assert max_prompt_tokens(HandlerConfig(1, 300, 100, {})) == 300  # default: input + output
    h = LlamaHandler.from_config(config)
    try:
        inputs = np.full(64, 42, dtype=np.int32)
        outputs = np.zeros(8, dtype=np.int32)
        too_long = SlotRequest(0, 1, 8, 0, inputs[:33], outputs)
        assert h.add(too_long, 0.0) == [Emit(0, 0, Status.BAD_REQUEST)]
        fits = SlotRequest(0, 2, 8, 0, inputs[:30], outputs)
        assert h.add(fits, 0.0) == []
        final = drive(h)
        # 30 prompt positions + at most 3 outputs (the last one is never decoded): 32 positions used.
        assert final[0] == Emit(0, 3, Status.LENGTH)
    finally:
        h.close()


def test_max_new_tokens_zero_is_answered_at_once(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    pool = Pool()
    assert handler.add(pool.request(0, chat(tok, "Hi"), 0), 0.0) == [Emit(0, 0, Status.LENGTH)]
    assert handler.wake_in(0.0) is None


def test_sampling_is_seeded_per_slot(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    prompt = chat(tok, "Write one word.")

    def sample(seed: int) -> list[int]:
        pool = Pool()
        handler.add(pool.request(0, prompt, 10, Sampling(temperature=1.5, top_p=0.95, top_k=50, seed=seed)), 0.0)
        final = drive(handler)
        return pool.outputs[0, : final[0].count].tolist()

    assert sample(7) == sample(7)
    assert len({tuple(sample(seed)) for seed in range(1, 6)}) > 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"modle": "x.gguf"}, "unknown option(s) ['modle']; allowed: model="),
        ({"threads": "two"}, "threads: expected an integer >= 1, got 'two'"),
        ({"ctx_per_slot": "8"}, "ctx_per_slot: expected an integer >= 16, got '8'"),
        ({"batch": "1"}, "batch: expected an integer >= 2, got '1'"),
        ({"chunk": "32"}, "unknown option(s) ['chunk']; allowed: model="),
        ({"stall_ms": "0"}, "stall_ms: expected a number > 0, got '0'"),
        ({"stall_ms": "nan"}, "stall_ms: expected a number > 0, got 'nan'"),
        ({"stall_ms": "soon"}, "stall_ms: expected a number > 0, got 'soon'"),
        ({"min_prefill": "0"}, "min_prefill: expected an integer >= 1, got '0'"),
        ({"ubatch": "0"}, "ubatch: expected an integer >= 1, got '0'"),
        ({"prefix_cache": "yes"}, "prefix_cache: expected one of on, off, got 'yes'"),
        ({"flash_attn": "fast"}, "flash_attn: expected one of off, on, auto, got 'fast'"),
        ({"deterministic": "on", "flash_attn": "auto"}, "deterministic=on needs flash_attn=off, got flash_attn=auto"),
        ({"cache_mb": "-1"}, "cache_mb: expected a number >= 0, got '-1'"),
        ({"cache_min": "0"}, "cache_min: expected an integer >= 1, got '0'"),
        ({"known_answer": "/no/such.json"}, "known_answer: '/no/such.json' is not a references file ("),
    ],
)
def test_bad_options_name_what_is_allowed(options: dict[str, str], message: str) -> None:
    with pytest.raises(HandlerError) as err:
        LlamaHandler.from_config(HandlerConfig(1, 16, 16, options))
    assert message in str(err.value)


def test_flash_attention_is_on_as_llama_server_runs_it_and_off_for_deterministic_answers() -> None:
    """The default is llama.cpp's (auto: on for the CPU backend), as llama-server's users run it; deterministic=on
    promises logits that do not depend on batching, which flash attention breaks, so there it is off."""
    assert LlamaOptions.parse({}, 64).flash_attn == "auto"
    assert LlamaOptions.parse({"deterministic": "on"}, 64).flash_attn == "off"
    assert LlamaOptions.parse({"flash_attn": "off"}, 64).flash_attn == "off"


def test_missing_model_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    with pytest.raises(HandlerError, match=f"model file {path} does not exist"):
        LlamaHandler.from_config(HandlerConfig(1, 16, 16, {"model": str(path)}))


def test_non_gguf_file_names_the_path_and_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(HandlerError, match="is not a GGUF file"):
        LlamaHandler.from_config(HandlerConfig(1, 16, 16, {"model": str(path)}))


def test_truncated_gguf_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "truncated.gguf"
    with default_model_path().open("rb") as f:
        path.write_bytes(f.read(1 << 16))
    with pytest.raises(HandlerError, match=f"model file {path} is corrupt or unsupported"):
        LlamaHandler.from_config(HandlerConfig(1, 16, 16, {"model": str(path)}))


def test_batch_must_leave_room_for_prompts() -> None:
    with pytest.raises(HandlerError, match=r"batch must be > slots \(4\).*got 4"):
        LlamaHandler.from_config(HandlerConfig(4, 16, 16, {"batch": "4"}))


def test_too_many_slots_for_llama_cpp() -> None:
    with pytest.raises(HandlerError, match="slots must be between 1 and 256"):
        LlamaHandler.from_config(HandlerConfig(300, 16, 16, {}))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_flat_over_thousands_of_short_requests(tok: GGUFTokenizer) -> None:
    slots = 8
    # Prefix reuse on (the default), down to one token: every request reuses what a finished one left.
    options = {"threads": "1", "ctx_per_slot": "32", "cache_min": "1"}
    handler = LlamaHandler.from_config(HandlerConfig(slots, 32, 2, options))
    inputs = np.zeros((slots, 32), dtype=np.int32)
    outputs = np.zeros((slots, 2), dtype=np.int32)
    prompt = tok.encode("Hi there")

    def serve(n: int) -> None:
        started = 0
        free = list(range(slots))
        for _ in range(10 * n):
            while free and started < n:
                slot = free.pop()
                inputs[slot, : len(prompt)] = prompt
                request = SlotRequest(slot, started, 2, 0, inputs[slot, : len(prompt)], outputs[slot])
                free.extend(emit.slot for emit in handler.add(request, 0.0))
                started += 1
            if handler.wake_in(0.0) is None:
                if started == n:
                    return
                continue
            free.extend(e.slot for e in handler.step(0.0) if e.status is not None)
        raise AssertionError(f"{n} requests not served in {10 * n} steps")

    try:
        serve(200)  # warm up: allocator pools and llama.cpp's graph buffers reach their size
        before = rss_bytes()
        serve(2000)
        grown = rss_bytes() - before
        assert grown < 8 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 2000 requests"
        assert handler.running == 0 and handler.book.saved_bytes <= handler.book.capacity
        assert handler.book.stats.hits >= 2000  # the same prompt every time: its KV is reused
    finally:
        handler.close()


def test_steps_are_measured_and_summed_up_in_the_log(
    handler: LlamaHandler, tok: GGUFTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    pool = Pool()
    before = handler.stats.steps, handler.stats.prompt_tokens, handler.stats.decode_ms
    prompt = chat(tok, "Name a fruit.")
    handler.add(pool.request(0, prompt, 3), 0.0)
    handler.step(0.0)
    with caplog.at_level("DEBUG", logger="edgepath.model.llama"):
        while handler.wake_in(0.0) is not None:
            handler.step(3600.0)  # an hour later: time for the summary line
    assert handler.stats.steps > before[0] and handler.stats.prompt_tokens == before[1] + len(prompt)
    assert handler.stats.decode_ms > before[2]
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert steps and "llama_decode" in steps[0] and "python" in steps[0]
    summary = [r.getMessage() for r in caplog.records if r.levelname == "INFO" and "prefix cache:" in r.getMessage()]
    assert len(summary) == 1 and "steps" in summary[0]


def test_the_heartbeat_moves_inside_llama_decode(tok: GGUFTokenizer) -> None:
    """Given the slot server's heartbeat hook, llama.cpp advances the word between the nodes of its compute
    graph: one step (a prompt decoded in one llama_decode) moves it many times, so a long step that makes
    progress is never taken for a hang.  The handler itself never touches the word otherwise."""
    word = np.zeros(1, dtype=np.uint64)
    tick = int(ffi.cast("uintptr_t", ffi.addressof(lib, "ep_heartbeat_tick")))
    h = LlamaHandler.from_config(HandlerConfig(1, IN_CAP, OUT_CAP, dict(OPTIONS)))
    try:
        h.beat_within_steps(Heartbeat(tick, int(word.ctypes.data)))
        pool = Pool(1)
        assert h.add(pool.request(0, chat(tok, "Name three colours of the rainbow."), max_new=2), 0.0) == []
        h.step(0.0)  # one llama_decode: the whole prompt (nothing else runs)
        beats = int(word[0])
        assert beats > 10, beats  # one per graph node computed (hundreds), never only one per step
        drive(h)
        assert int(word[0]) > beats
    finally:
        h.close()


def test_the_load_it_reports_follows_its_prompts_and_streams(handler: LlamaHandler, tok: GGUFTokenizer) -> None:
    """What the slot server publishes for admission: prompt tokens still to compute, then a decoding stream."""
    pool = Pool()
    idle = handler.load()
    assert idle.idle and idle.published and idle.costs.prompt_ms > 0
    assert idle.options is not None and idle.options.stall_ms == handler.options.stall_ms
    prompt = chat(tok, "Name a colour.")
    handler.add(pool.request(0, prompt, 8), 0.0)
    waiting = handler.load()
    assert (waiting.waiting, waiting.decoding, waiting.longest) == ((Prompt(0, len(prompt)),), 0, 0)
    handler.step(0.0)  # the whole prompt in one step: nothing else runs
    decoding = handler.load()
    assert (decoding.waiting, decoding.decoding, decoding.longest) == ((), 1, len(prompt))  # the first token sampled
    assert decoding.runs == 1  # one stream decoding: one micro-batch
    handler.step(0.0)
    assert handler.load().longest == len(prompt) + 1
    drive(handler)
    assert handler.load().idle


def test_a_prompt_within_its_tenants_floor_is_computed_before_older_ones(
    floors_handler: LlamaHandler, tok: GGUFTokenizer
) -> None:
    """docs/TENANTS.md: a floor is a slot its tenant can always have, and a first token that does not wait behind
    the prompts of the tenants it was lent to; the load published says so, and the older prompts still finish."""
    handler = floors_handler
    pool = Pool()
    older = [chat(tok, f"Tell me a long story about the number {k}.") for k in range(2)]
    for slot, prompt in enumerate(older):
        handler.add(pool.request(slot, prompt, max_new=4), 0.0)
    mine = chat(tok, "Name a colour.")
    handler.add(pool.request(2, mine, max_new=4, tenant=(1, 1)), 0.0)
    assert handler.load().waiting[0] == Prompt(0, len(mine))  # served first, and published so
    (first,) = [e for e in handler.step(0.0) if e.slot == 2]
    assert first.count == 1  # its first token from the first step: nothing decodes, it was computed whole
    final = drive(handler)
    assert sorted(final) == [0, 1, 2] and all(final[slot].count == 4 for slot in final)


def test_a_sequence_copied_to_another_decodes_the_same_logits_bit_for_bit(handler: LlamaHandler) -> None:
    """What closing a gap between runs does to a sequence (``LlamaContext.copy``): its next token's logits on the new
    sequence are the ones it would have had on the old."""
    ids = (np.arange(64, dtype=np.int32) * 7919 + 11) % handler.n_vocab
    context = handler.context
    lib = context.lib
    context.clear()
    try:
        context.timed_step([(0, 0, 30, False)], ids)
        assert context.copy(0, 3) and handler.kv_positions(3) == handler.kv_positions(0) == 30

        def next_logits(seq: int) -> np.ndarray:
            context.timed_step([(seq, 30, 1, True)], ids)
            return np.ctypeslib.as_array(lib.llama_get_logits_ith(context.ctx, 0), shape=(handler.n_vocab,)).copy()

        assert np.array_equal(next_logits(0), next_logits(3))
    finally:
        context.clear()


def test_a_gap_between_decoding_streams_is_closed_by_moving_one_sequence(
    handler: LlamaHandler, tok: GGUFTokenizer
) -> None:
    """Three requests decode on three consecutive sequences; the middle one is cancelled: the other two would cost
    llama.cpp two micro-batches a step, so after the next step one of them moves next to the other -- its KV
    copied whole, the old sequence emptied, the published load one run -- and both requests finish."""
    pool = Pool()
    moved_before = handler.stats.compactions
    for slot in range(3):
        handler.add(pool.request(slot, chat(tok, "Count to twenty."), max_new=40), 0.0)
    for _ in range(20):  # until all three decode
        handler.step(0.0)
        if all(seq.count > 0 for seq in handler.sequences.running.values()):
            break
    streams = {slot: seq.stream for slot, seq in handler.sequences.running.items()}
    assert len(streams) == 3 and runs(streams.values()) == 1 and handler.stats.compactions == moved_before
    middle = sorted(streams, key=streams.__getitem__)[1]
    handler.cancel(middle)
    assert handler.load().runs == 2
    handler.step(0.0)
    assert handler.stats.compactions == moved_before + 1
    moved = next(slot for slot, seq in handler.sequences.running.items() if seq.stream != streams[slot])
    seq = handler.sequences.running[moved]
    assert handler.kv_positions(seq.stream) == seq.prompt_len + seq.count - 1  # all it held, on its new sequence
    assert handler.kv_positions(streams[moved]) <= 0  # the old one is empty
    assert runs(s.stream for s in handler.sequences.running.values()) == 1 and handler.load().runs == 1
    finals = drive(handler)
    assert {finals[slot].status for slot in streams if slot != middle} <= {Status.STOP, Status.LENGTH}


def test_steps_go_to_fewer_threads_while_they_wait_for_cpus_and_answer_the_same(tok: GGUFTokenizer) -> None:
    """The governor's choice reaches llama.cpp (``llama_n_threads``) both ways, and the tokens do not depend on it.
    The governor is set to see waiting (and then idle CPUs) on every step: what a CPU hog in another session does
    to the figures is docs/MODEL.md's to measure, not a unit test's."""
    prompt = chat(tok, "Name three colors.")
    options = {**OPTIONS, "threads": "2"}
    two = LlamaHandler.from_config(HandlerConfig(SLOTS, IN_CAP, OUT_CAP, options))
    try:
        lib = two.context.lib
        assert two.governor is not None and lib.llama_n_threads(two.context.ctx) == 2
        pool = Pool()
        two.governor = None  # every step on both threads
        two.add(pool.request(0, prompt, 12), 0.0)
        steady = pool.outputs[0, : drive(two)[0].count].tolist()
        two.governor = ThreadGovernor(2, wait_share=-1.0, hold=3600.0)  # every step "waited", and went slow:
        two.governor.ratios[1] = 0.0  # one thread is taken to go at any speed
        two.add(pool.request(0, prompt, 12), 0.0)
        assert pool.outputs[0, : drive(two)[0].count].tolist() == steady
        assert lib.llama_n_threads(two.context.ctx) == 1 and two.stats.thread_changes == 1
        two.governor.wait_share, two.governor.idle_share, two.governor.hold = 2.0, -1.0, 0.0  # CPUs idle
        two.add(pool.request(0, prompt, 12), 0.0)
        assert pool.outputs[0, : drive(two)[0].count].tolist() == steady
        assert lib.llama_n_threads(two.context.ctx) == 2 and two.stats.thread_changes == 2
    finally:
        two.close()
    off = LlamaHandler.from_config(HandlerConfig(SLOTS, IN_CAP, OUT_CAP, {**options, "share_cpus": "off"}))
    try:
        assert off.governor is None
    finally:
        off.close()
