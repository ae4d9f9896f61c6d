"""llama.cpp over the slot pool: one context, one KV stream per running request, continuous batching.

Every :meth:`LlamaHandler.step` is ONE ``llama_decode`` over every running slot: the next token of each
decoding slot, plus the prompt tokens that the step planner (:mod:`edgepath.model.planner`, by the one
:class:`~edgepath.contract.plan.StepPolicy`) plans for the slots still in prefill.  Each slot picks its tokens with
its own :class:`~edgepath.model.sampler.SlotSampler` (the handler runs the model, the sampler turns a logits row
into a token) and writes them in place into the slot's output area.

The prompt ids are never turned into Python objects: they are read from the slot's memory when they are
decoded (not copied at :meth:`~LlamaHandler.add`).  When a step decodes one slot's prompt chunk alone (a
request arriving at an idle server: the time-to-first-token path), the batch's token pointer IS the
slot's memory; when it mixes several slots, each chunk is moved into the batch array by one memcpy.

The handler is the step loop; its parts each have a module of their own: the options (:mod:`llama_options`),
llama.cpp's context and batch (:mod:`llama_context`), the known-answer check (:mod:`answer_check`), the warm-up
that calibrates the step cost model (:mod:`calibration`), the running sequences and their KV (:mod:`sequences`),
the step planner (:mod:`planner`), the CPU-thread governor (:mod:`threads`) and the step log (:mod:`step_log`):
``edgepath -v`` logs every step (logger ``edgepath.model.llama``) and :attr:`LlamaHandler.stats` keeps the totals.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from edgepath.contract import wire
from edgepath.contract.plan import Load, Step, chunk_attended
from edgepath.model.answer_check import check_numbers
from edgepath.model.calibration import START_COSTS_ONE_THREAD, warm_up
from edgepath.model.cost import CostModel
from edgepath.model.llama_context import LlamaContext, micro_batches
from edgepath.model.llama_options import LlamaOptions
from edgepath.model.planner import Parts, StepPlanner
from edgepath.model.prefix import PrefixBook
from edgepath.model.sampler import SlotSampler
from edgepath.model.sequences import Sequence, Sequences
from edgepath.model.step_log import StepLog
from edgepath.model.threads import ThreadGovernor, next_threads, read_sample
from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, HandlerConfig, HandlerError, Heartbeat, SlotRequest

log = logging.getLogger("edgepath.model.llama")

MAX_SEQ = 256  # LLAMA_MAX_SEQ in llama.cpp: sequence ids are bits of a 256-bit set


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
        self.options = options
        self.slots = slots
        self.ctx_per_slot = options.ctx_per_slot
        self.batch_capacity = batch
        self.context = context = LlamaContext(options, slots, batch)
        self.n_vocab, self.eog = context.n_vocab, context.eog
        self.cost = CostModel(START_COSTS_ONE_THREAD.scaled(1.0 / options.threads))
        self.governor = ThreadGovernor(options.threads) if options.share_cpus and options.threads > 1 else None
        self.book = PrefixBook(slots, int(options.cache_mb * 2**20) if options.prefix_cache else 0, options.cache_min)
        self.blobs = context.blobs  # the memory of the book's blobs and of sequences copied on the step loop
        self.sequences = Sequences(context, self.book, options)
        self.planner = StepPlanner(options, batch, self.cost, self.sequences, self.n_vocab, slots)
        self.record = StepLog(self.book)
        self.stats = self.record.stats
        try:
            if options.known_answer != "off":
                check_numbers(context, options)
            warm_up(context, self.cost, slots, batch, options.ctx_per_slot)
        except BaseException:
            self.close()
            raise
        self.last_token_pointer = 0  # where the last llama_decode read its token ids (tests check it)

    @classmethod
    def from_config(cls, config: HandlerConfig) -> LlamaHandler:
        return cls(config.slots, LlamaOptions.parse(config.options, config.input_capacity + config.output_capacity))

    def beat_within_steps(self, heartbeat: Heartbeat) -> None:
        """Advance the slot server's heartbeat from inside ``llama_decode`` (:meth:`LlamaContext.beat_within_steps`),
        so a long prompt step that makes progress is not taken for a hang."""
        self.context.beat_within_steps(heartbeat)

    # -- BatchHandler ------------------------------------------------------------------------------
    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        slot, running = request.slot, self.sequences.running
        if not 0 <= slot < self.slots:
            raise ValueError(f"llama: slot {slot} is outside this handler's {self.slots} slots")
        if slot in running:
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
        context = self.context
        try:
            grammar = None if request.constraint is None else (context.vocab, request.constraint)
            suppress = self.eog if request.flags & wire.FLAG_IGNORE_EOS else ()
            sampler = SlotSampler(context.lib, request.sampling, self.n_vocab, top, grammar, request.tokens, suppress)
        except ValueError as exc:
            log.warning("slot %d: bad request: %s", slot, exc)
            return [Emit(slot, 0, Status.BAD_REQUEST)]
        except RuntimeError:
            log.exception("slot %d: cannot build a sampler for %s", slot, request.sampling)
            return [Emit(slot, 0, Status.HANDLER_ERROR)]
        running[slot] = Sequence(request, sampler, prompt_len, words=words)
        self.planner.learn(request)  # learned here, not on every step: nothing is lent without a request
        return []

    def step(self, now: float) -> list[Emit]:
        if not self.sequences.running:
            return []
        started = time.perf_counter()
        parts, bad = self.planner.plan()
        out = [self._finish(seq, Status.BAD_REQUEST) for seq in bad]
        if not parts:
            return out
        context, arrays = self.context, self.context.arrays
        segments, n = self._fill(parts)
        prompt_tokens = attended = longest = 0
        for seq, first, length, _ in segments:
            if seq.decoding:
                longest = max(longest, first)
            else:
                prompt_tokens += length
                attended += chunk_attended(first, length)
        if len(parts) == 1 and not parts[0][0].decoding:
            # One slot's prompt chunk alone: llama.cpp reads the ids straight from the slot.
            seq, first, length = parts[0]
            pointer = seq.request.tokens[first : first + length].ctypes.data
        else:
            for seq, first, length, start in segments:
                if not seq.decoding:
                    np.copyto(arrays.tokens[start : start + length], seq.request.tokens[first : first + length])
            pointer = arrays.tokens.ctypes.data
        self.last_token_pointer = pointer
        before = read_sample(time.perf_counter()) if self.governor is not None else None
        decode_start = time.perf_counter()
        rc = context.decode(pointer, n)
        decoded = time.perf_counter()
        if rc != 0:
            log.error("llama_decode failed (%d) on a batch of %d tokens over %d slots", rc, n, len(parts))
            for seq, *_ in parts:
                out.append(self._finish(seq, Status.HANDLER_ERROR))
            return out
        shape = Step(
            prompt_tokens,
            n - prompt_tokens,
            attended,
            (n - prompt_tokens) * (longest + 1),
            micro_batches([(seq.stream, length) for seq, _, length in parts], context.ubatch),
        )
        self.cost.observe(shape, (decoded - decode_start) * 1e3, now)
        ran_on = self.governor.threads if self.governor is not None else self.options.threads
        if before is not None and self.governor is not None:
            threads = next_threads(self.governor, before, decoded, self.cost.base.step_ms(shape) / 1e3)
            if threads is not None:
                context.set_threads(threads)
                self.stats.thread_changes += 1
        for seq, first, length in parts:
            if not seq.decoding:
                seq.prefilled = first + length
            if seq.logit_index >= 0:
                out.append(self._sample(seq))
        # after the step: the load published next, and the next step's plan, see the runs it leaves
        if self.sequences.compact():
            self.stats.compactions += 1
        ended = time.perf_counter()
        self.record.account(n, prompt_tokens, len(parts), started, decode_start, decoded, ended, shape.ubatches, ran_on)
        self.record.summary(now)
        return out

    def _fill(self, parts: Parts) -> tuple[list[tuple[Sequence, int, int, int]], int]:
        """The batch's positions, sequence ids and logit marks for ``parts`` (a decoding sequence's last token too):
        the parts with the batch index each starts at, and how many tokens the step has."""
        arrays = self.context.arrays
        segments = []
        n = 0
        for seq, first, length in parts:
            segments.append((seq, first, length, n))
            n += length
        arrays.logits[:n] = 0
        for seq, first, length, start in segments:
            if seq.decoding:
                arrays.tokens[start] = seq.last_token()
            arrays.fill(start, first, length, seq.stream)
            if first + length == seq.prompt_len or seq.count > 0:
                arrays.logits[start + length - 1] = 1
                seq.logit_index = start + length - 1
            else:
                seq.logit_index = -1
        return segments, n

    def cancel(self, slot: int) -> bool:
        seq = self.sequences.running.get(slot)
        if seq is not None:
            self._finish(seq, Status.CANCELLED)
        return True

    def wake_in(self, now: float) -> float | None:
        return 0.0 if self.sequences.running else None

    def close(self) -> None:
        for seq in list(self.sequences.running.values()):
            self._finish(seq, Status.CANCELLED)
        self.context.close()

    def _sample(self, seq: Sequence) -> Emit:
        ctx = self.context.ctx
        token = seq.sampler.sample(ctx, seq.logit_index)
        if self.context.is_eog(token):
            return self._finish(seq, Status.STOP)
        output = seq.request.output
        if seq.sampler.top_logprobs is None:
            output[seq.count] = token
        else:
            wire.write_record(output, seq.count, token, *seq.sampler.logprobs(ctx, seq.logit_index, token))
        seq.count += 1
        if seq.placed + seq.words > len(output) or seq.prompt_len + seq.count > self.ctx_per_slot:
            return self._finish(seq, Status.LENGTH)
        return Emit(seq.request.slot, seq.placed, cached_tokens=seq.cached)

    def _finish(self, seq: Sequence, status: Status) -> Emit:
        """The slot's final report; its sequence's KV is kept or emptied (:meth:`Sequences.release`)."""
        self.sequences.release(seq, status)
        return Emit(seq.request.slot, seq.placed, status, cached_tokens=seq.cached)

    # -- inspection ----------------------------------------------------------------------------------
    def kv_positions(self, stream: int) -> int:
        """How many positions llama.cpp sequence ``stream`` holds in its KV stream (0: none)."""
        return self.context.positions(stream)

    @property
    def running(self) -> int:
        return len(self.sequences.running)

    # -- ReportsLoad: what the slot server publishes for the agents' admission -----------------------
    def load(self) -> Load:
        """What the step policy will plan from, as the agents replay it (:meth:`StepPlanner.load`)."""
        return self.planner.load()

    # -- HoldsPrefixes: what the slot server publishes in its pool's prefix table --------------------
    def prefixes_version(self) -> int:
        return self.book.version

    def prefixes(self) -> list[tuple[int, np.ndarray]]:
        """What the pool's prefix table publishes (:meth:`Sequences.prefixes`)."""
        return self.sequences.prefixes()
