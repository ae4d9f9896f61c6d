"""The llama handler's running requests, each on a llama.cpp sequence (its own KV stream), and that KV's
bookkeeping: where a request is placed, a gap between runs of sequence ids closed, what a finished one leaves.

A request runs on whichever free sequence already holds the longest prefix of its prompt
(:class:`~edgepath.model.prefix.PrefixBook`), or has a saved copy restored from host memory, or a running one's
computed prefix copied, and prefills only the rest; the count of reused tokens goes back as ``Emit.cached_tokens``.
A finished sequence keeps the KV of what it decoded for the next prompt that starts the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from edgepath.model.llama_context import LlamaContext
from edgepath.model.llama_options import LlamaOptions
from edgepath.model.prefix import PrefixBook, runs
from edgepath.model.sampler import SlotSampler
from edgepath.native.abi import Status
from edgepath.slots.handlers import SlotRequest

log = logging.getLogger("edgepath.model.llama")

#: a decoding sequence is moved to close a gap between runs of sequence ids only with this many tokens still to
#: decode: the copy of its KV costs about what one micro-batch does, and every later step saves one
COMPACT_MIN_LEFT = 8


@dataclass(slots=True)
class Sequence:
    """One running slot: its KV stream, where its prompt and output stand, and its sampler."""

    request: SlotRequest
    sampler: SlotSampler
    prompt_len: int
    stream: int = -1  # the llama.cpp sequence id (its own KV stream) it runs on; -1: not placed yet
    cached: int = 0  # prompt tokens whose KV was reused, not computed
    prefilled: int = 0  # prompt tokens in the KV cache so far (cached ones included)
    count: int = 0  # output tokens written
    logit_index: int = -1  # this step's batch index whose logits it samples from (-1: none)
    words: int = 1  # output words per token: 1, or a log-probability record (contract/wire/)

    @property
    def placed(self) -> int:
        """Output words written: what the slot server sends back."""
        return self.count * self.words

    @property
    def decoding(self) -> bool:
        """Whether its whole prompt is in the KV cache (it decodes a token a step)."""
        return self.prefilled == self.prompt_len

    def last_token(self) -> int:
        return int(self.request.output[(self.count - 1) * self.words])

    def output_tokens(self) -> np.ndarray:
        """The output's token ids (without their log-probability records)."""
        return self.request.output[: self.placed : self.words]


class Sequences:
    """The running requests by slot (``running``, in arrival order) and the KV of ``context``'s sequences under
    them, with ``book`` saying which sequence holds what."""

    def __init__(self, context: LlamaContext, book: PrefixBook, options: LlamaOptions) -> None:
        self.context = context
        self.book = book
        self.options = options
        self.running: dict[int, Sequence] = {}  # slot -> its sequence, in arrival order

    def place(self, seq: Sequence) -> None:
        """Give a request its sequence: afterwards that sequence's KV holds exactly positions 0..reuse-1 of
        the prompt (reused, not computed) and prefill starts there."""
        context, prompt = self.context, seq.request.tokens
        computed = {s.stream: s.request.tokens[: s.prefilled] for s in self.running.values() if s.stream >= 0}
        placement = self.book.place(prompt, self.options.prefix_cache, computed, seq.request.salt, seq.request.readable)
        stream, reuse = placement.stream, placement.reuse
        blob = placement.restore.blob if placement.restore is not None else None
        if placement.source is not None:
            blob = context.state_of(placement.source)
        if blob is not None:
            took = context.set_state(blob, stream)
            if placement.source is not None:  # a copy made for this placement only
                context.blobs.give(blob)
            if not took:
                log.warning("prefix cache: llama.cpp refused a sequence state of %d bytes", blob.nbytes)
                self.book.stats.hits -= 1
                self.book.stats.cached_tokens -= reuse
                self.book.stats.misses += 1
                reuse = 0
        context.forget(stream, reuse)
        if reuse:
            how = "in place"
            if placement.restore is not None:
                how = "restored from host memory"
            elif placement.source is not None:
                how = f"copied from running sequence {placement.source}"
            log.debug("prefix cache: %d of %d prompt tokens reused on sequence %d, %s", reuse, len(prompt), stream, how)
        seq.stream = stream
        seq.cached = seq.prefilled = reuse

    def compact(self) -> bool:
        """Close a gap between the decoding streams' runs of sequence ids, one sequence a step at most: llama.cpp
        computes a step in a micro-batch per run, each reading all the weights (8 streams decoding: 27 ms a step in
        one run, 71 ms in eight here, docs/MODEL.md), and streams that end leave gaps that new requests fill only
        under load.  The sequence's KV is copied whole (bit for bit: its next logits do not change).  Whether one
        moved."""
        decoding = {s.stream: s for s in self.running.values() if s.stream >= 0 and s.decoding}
        if not self.options.compact or runs(decoding) < 2:
            return False
        movable = {
            stream: seq.prompt_len + seq.count
            for stream, seq in decoding.items()
            if seq.request.max_new_tokens - seq.count >= COMPACT_MIN_LEFT
        }
        move = self.book.compaction(decoding, movable)
        if move is None:
            return False
        source, dest = move
        if not self.context.copy(source, dest):
            return False
        self.context.forget(source)
        self.book.move(source, dest)
        decoding[source].stream = dest
        log.debug("llama: sequence %d moved to %d: fewer runs of sequence ids to decode", source, dest)
        return True

    def release(self, seq: Sequence, status: Status) -> None:
        """A slot's request ends: its sequence stays with the KV of what it decoded (the prefix cache) after a
        normal end, and is emptied after a cancel or an error."""
        del self.running[seq.request.slot]
        seq.sampler.close()
        if seq.stream >= 0:
            kept = None
            if self.options.prefix_cache and status in (Status.STOP, Status.LENGTH):
                kept = self._keep(seq)
            if kept is None:
                self.context.forget(seq.stream)
            self.book.finished(seq.stream, kept)

    def _keep(self, seq: Sequence) -> np.ndarray | None:
        """What a finished sequence's KV holds (prompt, then the output tokens decoded so far), saved into
        host memory when the book wants it; None when there is nothing worth keeping."""
        context = self.context
        held = context.positions(seq.stream)
        if held <= 0:
            return None
        tokens = np.concatenate([seq.request.tokens, seq.output_tokens()])[:held].copy()
        nbytes = context.state_size(seq.stream)
        if self.book.capacity and self.book.wants(tokens, nbytes, seq.request.salt):
            blob = context.state_of(seq.stream)
            if blob is not None:
                dropped = self.book.save(tokens, blob, context.blobs.footprint(blob), seq.request.salt)
                for old in dropped:
                    context.blobs.give(old.blob)
                if dropped:
                    log.debug(
                        "prefix cache: saved %d tokens (%d bytes), dropped %d saved sequence(s); %d bytes held",
                        len(tokens),
                        nbytes,
                        len(dropped),
                        self.book.saved_bytes,
                    )
        return tokens

    def prefixes(self) -> list[tuple[int, np.ndarray]]:
        """The prompts of placed running requests (a request of the same salt arriving meanwhile copies what they
        computed), then what idle sequences and host memory hold (nothing with the prefix cache off)."""
        if not self.options.prefix_cache:
            return []
        running = [(seq.request.salt, seq.request.tokens) for seq in self.running.values() if seq.stream >= 0]
        return [*running, *self.book.held()]
