"""llama.cpp as the llama handler runs it: the model loaded once, the one context every slot's sequence runs in,
the batch arrays its steps are built in, and the calls on a sequence's KV (its state copied, restored, emptied).

KV layout: one stream per llama.cpp sequence (``kv_unified = False``), ``sequences`` sequences of ``ctx_per_slot``
cells each, so a token attends over its own sequence's cells only and no sequence can crowd out another.  A step is
computed in micro-batches of consecutive sequence ids (:func:`micro_batches`), each reading the weights once.

Everything here is the handler's plumbing around ``llama_cpp``; what a step carries is the planner's
(:mod:`edgepath.model.planner`), which sequence a request runs on :mod:`edgepath.model.sequences`'.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgepath.model.blobs import BlobPool
from edgepath.model.gguf import ModelFileError, llama_cpp, load_model
from edgepath.model.llama_options import FLASH_ATTN, LlamaOptions
from edgepath.slots.handlers import HandlerError, Heartbeat

log = logging.getLogger("edgepath.model.llama")


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
    params.flash_attn_type = FLASH_ATTN[options.flash_attn]
    params.n_threads = params.n_threads_batch = options.threads
    params.no_perf = True
    return params


class Batch:
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

    def fill(self, n: int, first: int, length: int, sequence: int) -> None:
        """Positions ``first``.. of ``sequence`` at batch indices ``n``.. (``length`` of them)."""
        self.pos[n : n + length] = np.arange(first, first + length, dtype=np.int32)
        self.seq[n : n + length] = sequence

    def decode(self, lib: Any, ctx: Any, pointer: int, n: int) -> int:
        """``llama_decode`` of the batch's first ``n`` entries, their token ids read from ``pointer``."""
        self.batch.token = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int32))
        self.batch.n_tokens = n
        return int(lib.llama_decode(ctx, self.batch))


def _ubytes(blob: np.ndarray) -> Any:
    return blob.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))


class LlamaContext:
    """The model llama.cpp loaded, one context of ``sequences`` sequences with room for ``batch`` tokens a step, and
    that context's batch arrays (``arrays``); ``blobs`` holds the memory of the sequence states copied out of it.
    HandlerError, one line saying what could not be had, where the model or the context cannot be."""

    def __init__(self, options: LlamaOptions, sequences: int, batch: int) -> None:
        try:
            self.lib = lib = llama_cpp(options.deterministic)
        except ModelFileError as exc:
            raise HandlerError(f"llama: {exc}") from exc
        self.ctx: Any = None
        try:
            self.model: Any = load_model(options.model, vocab_only=False)
        except ModelFileError as exc:
            raise HandlerError(f"llama: {exc}") from exc
        self.blobs = BlobPool()
        try:
            self.vocab = lib.llama_model_get_vocab(self.model)
            self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
            # what a request that ignores end-of-generation never draws (FLAG_IGNORE_EOS), as llama-server finds them
            self.eog = tuple(t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(self.vocab, t))
            params = context_params(lib, sequences, options, batch)
            self.ctx = lib.llama_init_from_model(self.model, params)
            if not self.ctx:
                raise HandlerError(
                    f"llama: llama.cpp could not create a context for {options.model} with {sequences} slots x "
                    f"{options.ctx_per_slot} positions (out of memory?)"
                )
            self.mem = lib.llama_get_memory(self.ctx)
            log.info(
                "llama: %s, %d slots x %d positions, %d threads, batch %d (micro-batch %d), stall %.0f ms, "
                "flash attention %s, prefix cache %s",
                options.model.name,
                sequences,
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
        self.ubatch = min(options.ubatch, batch)  # llama.cpp's n_ubatch (context_params)
        self.arrays = Batch(lib, batch)

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def decode(self, pointer: int, n: int) -> int:
        """One ``llama_decode`` of the first ``n`` entries of :attr:`arrays`, token ids read from ``pointer``."""
        return self.arrays.decode(self.lib, self.ctx, pointer, n)

    def timed_step(self, parts: list[tuple[int, int, int, bool]], ids: np.ndarray) -> float:
        """One throw-away ``llama_decode`` of ``parts`` (sequence, first position, tokens, logits for every token
        or only the last), token ids from ``ids``; the milliseconds it took."""
        arrays, n = self.arrays, 0
        arrays.logits[:] = 0
        for seq, first, length, every in parts:
            arrays.tokens[n : n + length] = ids[first : first + length]
            arrays.fill(n, first, length, seq)
            arrays.logits[n if every else n + length - 1 : n + length] = 1
            n += length
        started = time.perf_counter()
        rc = self.decode(arrays.tokens.ctypes.data, n)
        self.lib.llama_synchronize(self.ctx)
        took = time.perf_counter() - started
        if rc != 0:
            self.clear()
            raise HandlerError(f"llama: a warm-up step of {n} tokens failed (llama_decode returned {rc})")
        return took * 1e3

    # -- a sequence's KV -----------------------------------------------------------------------------
    def positions(self, stream: int) -> int:
        """How many positions llama.cpp sequence ``stream`` holds in its KV stream (0: none)."""
        return int(self.lib.llama_memory_seq_pos_max(self.mem, stream)) + 1

    def state_size(self, stream: int) -> int:
        return int(self.lib.llama_state_seq_get_size(self.ctx, stream))

    def state_of(self, stream: int) -> np.ndarray | None:
        """A copy of sequence ``stream``'s KV (llama.cpp's state blob, from :attr:`blobs`), or None if llama.cpp
        would not give it."""
        nbytes = self.state_size(stream)
        blob = self.blobs.take(nbytes)
        written = self.lib.llama_state_seq_get_data(self.ctx, _ubytes(blob), nbytes, stream)
        if written != nbytes:
            log.warning("prefix cache: llama.cpp wrote %d of %d bytes of sequence %d's state", written, nbytes, stream)
            self.blobs.give(blob)
            return None
        return blob

    def set_state(self, blob: np.ndarray, stream: int) -> bool:
        """Sequence ``stream``'s KV becomes ``blob``; whether llama.cpp took it."""
        return bool(self.lib.llama_state_seq_set_data(self.ctx, _ubytes(blob), blob.nbytes, stream))

    def copy(self, source: int, dest: int) -> bool:
        """Sequence ``dest``'s KV becomes a copy of ``source``'s (through llama.cpp's state of a sequence: the
        same bytes, so the same next logits); whether it took (``dest`` is left empty when not)."""
        blob = self.state_of(source)
        if blob is None:
            return False
        copied = self.set_state(blob, dest)
        self.blobs.give(blob)
        if not copied:
            log.warning("llama: llama.cpp refused sequence %d's state (%d bytes) on %d", source, blob.nbytes, dest)
            self.forget(dest)
            return False
        return True

    def forget(self, stream: int, first: int = -1) -> None:
        """Sequence ``stream``'s KV from position ``first`` on emptied (-1: all of it)."""
        self.lib.llama_memory_seq_rm(self.mem, stream, first, -1)

    def clear(self) -> None:
        """Every sequence's KV emptied."""
        self.lib.llama_memory_clear(self.mem, True)

    # -- the context's settings ----------------------------------------------------------------------
    def set_threads(self, threads: int) -> None:
        self.lib.llama_set_n_threads(self.ctx, threads, threads)

    def beat_within_steps(self, heartbeat: Heartbeat) -> None:
        """Advance the slot server's heartbeat from inside ``llama_decode``: llama.cpp calls its abort callback
        between the nodes of the compute graph (ggml's CPU backend), and this one only beats -- it returns
        false, never aborting -- so a long prompt step that makes progress is not taken for a hang."""
        self._beat = self.lib.ggml_abort_callback(heartbeat.function)  # kept alive: llama.cpp holds the pointer only
        self.lib.llama_set_abort_callback(self.ctx, self._beat, ctypes.c_void_p(heartbeat.word))

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None
