"""Typed views of the request and result headers in registered memory (each checked against its C struct in
native/edgepath_slot.h when the class is made), and the statuses and flag a result and a request read by."""

from __future__ import annotations

import inspect
import math
import operator
from typing import Any, ClassVar

from edgepath.contract.wire.immediates import progress_count, progress_generation, progress_word
from edgepath.contract.wire.sampling import ZEROED, LogitBias, Sampling
from edgepath.contract.wire.state import TENANT_MAX
from edgepath.native.abi import Status, ffi, lib


class StructView:
    """A typed view of one C struct in registered memory, through a cffi pointer (reading a field costs
    about a tenth of a numpy structured field).  Subclasses declare the struct's scalar fields as
    annotations; each becomes a property read through the pointer, and the declaration is checked
    against the C header when the class is made, so a field added to the ABI cannot go unseen."""

    __slots__ = ("_p",)
    ctype: ClassVar[str]

    def __init__(self, pointer: Any) -> None:
        self._p = pointer

    def __init_subclass__(cls, struct: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.ctype = f"struct {struct} *"
        fields = [name for name, f in ffi.typeof(f"struct {struct}").fields if f.type.kind == "primitive"]
        declared = [name for name in inspect.get_annotations(cls) if name != "ctype"]
        if declared != fields:
            raise TypeError(
                f"{cls.__name__} declares {declared}, but struct {struct} (native/edgepath_slot.h) has {fields}: "
                "declare exactly the header's scalar fields, in order"
            )
        for name in fields:
            setattr(cls, name, property(operator.attrgetter(f"_p.{name}"), _setter(name)))

    @classmethod
    def at(cls, address: int) -> Any:
        """A view of the struct at ``address`` (memory its owner keeps alive)."""
        return cls(ffi.cast(cls.ctype, address))


def _setter(name: str) -> Any:
    def set_field(self: StructView, value: Any) -> None:
        setattr(self._p, name, value)

    return set_field


class RequestHeader(StructView, struct="ep_request_header"):
    """A slot's or a frame's request header: the writer's fields, the agent's stamp, sampling."""

    __slots__ = ()
    request_id: int
    token_count: int
    max_new_tokens: int
    flags: int  # FLAG_STREAM: stream the output
    generation: int  # the claim's generation, stamped by the agent
    t_receive_ns: int  # CLOCK_MONOTONIC, at the edge: the request arrived ...
    t_tokenized_ns: int  # ... its ids are in the frame ...
    t_written_ns: int  # ... the agent sends it
    doorbell: int  # the word rung into doorbell[slot] (doorbell_word)
    reply_index: int
    top_k: int
    temperature: float
    top_p: float
    seed: int
    stream_window_us: int
    max_wait_ms: int  # the requester's bound on waiting for its first token (0: the agent's default)
    predicted_ttft_us: int  # the agent's prediction at claim time (0: none made) ...
    predicted_wait_us: int  # ... and the wait in it (the prediction minus its own prompt on an idle server)
    output_offset: int  # a migrated request: output tokens its answer already has; its output goes after them
    migrations: int  # how often it has moved to another slot server
    cache_salt: int  # the prefix cache's namespace (cache_salt()): KV and placement only from the same salt
    tenant: int  # the tenant's id in the state words (0: no floor and no cap), claimed with: the state word's tenant
    slot_floor: int  # that tenant's slot floor
    slot_cap: int  # that tenant's slot cap (0: none)
    min_p: float  # sampling, continued (ABI 14): 0 = off
    presence_penalty: float  # 0 = off
    frequency_penalty: float  # 0 = off
    repetition_penalty: float  # 0 or 1 = off
    logit_biases: int  # (id, bias) pairs at the end of the constraint words after the prompt
    reserved32: int

    def fill(
        self,
        request_id: int,
        token_count: int,
        max_new_tokens: int,
        flags: int,
        sampling: Sampling,
        t_receive_ns: int,
        t_tokenized_ns: int,
    ) -> None:
        """The writer's fields (values already checked); the agent stamps the rest when it sends."""
        lib.ep_request_fill(
            self._p,
            request_id,
            token_count,
            max_new_tokens,
            flags,
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            sampling.seed,
            sampling.min_p,
            sampling.presence_penalty,
            sampling.frequency_penalty,
            sampling.repetition_penalty,
            len(sampling.logit_bias),
            t_receive_ns,
            t_tokenized_ns,
        )

    def bound(self, max_wait_ms: int) -> None:
        """The requester's bound on waiting for the first token (0: the agent's default)."""
        self._p.max_wait_ms = max_wait_ms

    def salted(self, salt: int) -> None:
        """The prefix cache namespace the request reads and writes (:func:`cache_salt`; 0: none)."""
        self._p.cache_salt = salt

    def floored(self, tenant: int, slot_floor: int, slot_cap: int = 0) -> None:
        """The request's tenant's id in the state words (0: a tenant with neither a slot floor nor a slot cap), its
        floor and its cap: what the agent claims with (the state word's tenant), decides a reclaim by and counts a
        cap by, across every edge (docs/TENANTS.md)."""
        if not 0 <= tenant <= TENANT_MAX:
            raise ValueError(f"tenant floor id must be in 0..{TENANT_MAX}, got {tenant}")
        if not 0 <= slot_floor <= 0xFFFFFFFF or not 0 <= slot_cap <= 0xFFFFFFFF:
            raise ValueError(f"slot floor and cap must be in 0..{0xFFFFFFFF}, got {slot_floor} and {slot_cap}")
        self._p.tenant = tenant
        self._p.slot_floor = slot_floor if tenant else 0
        self._p.slot_cap = slot_cap if tenant else 0

    def predicted(self, ttft_ms: float, wait_ms: float) -> None:
        """The agent's prediction at claim time, for the edge's ``Server-Timing`` and metrics."""
        p = self._p
        p.predicted_ttft_us = min(int(ttft_ms * 1e3), 0xFFFFFFFF)
        p.predicted_wait_us = min(int(wait_ms * 1e3), 0xFFFFFFFF)

    def migrate(self, token_count: int, max_new_tokens: int, output_offset: int, migrations: int) -> None:
        """The request moves to another slot server: its prompt is the old prompt and the answer so far, it may
        produce what is left, and its output goes after the ``output_offset`` tokens its answer has."""
        p = self._p
        p.token_count = token_count
        p.max_new_tokens = max_new_tokens
        p.output_offset = output_offset
        p.migrations = migrations

    def unsent(self) -> None:
        """Not sent yet (``t_written_ns`` 0): the writer clears it and :meth:`stamp` sets it when the agent sends the
        request -- at once, or at the hand-over of a slot taken back for it (docs/TENANTS.md) -- so the writer can
        tell the two apart."""
        self._p.t_written_ns = 0

    def stamp(self, generation: int, slot: int, reply_index: int) -> None:
        """What a claim decides, just before the request is written: the generation claimed, the doorbell
        word that rings for it, the reply entry, the time."""
        lib.ep_request_stamp(self._p, generation & 0xFFFFFFFF, slot, reply_index)

    def streaming(self, default_window: float) -> float | None:
        """None: the request wants only its final result; else the seconds within which its streamed tokens
        after the first are coalesced (``default_window`` when the request names none)."""
        p = self._p
        if not p.flags & FLAG_STREAM:
            return None
        us = p.stream_window_us
        return us / 1e6 if us else default_window

    def sampling(self, logit_bias: LogitBias = ()) -> Sampling:
        """The request's sampling parameters, with ``logit_bias`` read from the words after its prompt
        (:func:`read_after_prompt`; the header holds only their count).  A zeroed header, greedy, is one shared
        value: no allocation."""
        p = self._p
        temperature, top_p, top_k, seed = p.temperature, p.top_p, p.top_k, p.seed
        min_p, presence, frequency, repetition = p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        if not (temperature or top_p or top_k or seed or min_p or presence or frequency or repetition or logit_bias):
            return ZEROED
        return Sampling(temperature, top_p, top_k, seed, min_p, presence, frequency, repetition, logit_bias)


class ResultHeader(StructView, struct="ep_result_header"):
    """A slot's or a reply entry's result header: whose result, how it ended, what is placed so far."""

    __slots__ = ()
    request_id: int
    generation: int
    slot: int
    status: int  # a Status
    output_count: int
    t_ready_ns: int  # CLOCK_MONOTONIC, at the slot server: the poller saw the doorbell ...
    t_start_ns: int  # ... the handler started ...
    t_done_ns: int  # ... it finished
    progress: int  # progress_word(generation, tokens placed so far): see placed_for
    t_first_ns: int
    cached_tokens: int  # prompt tokens the model side took from its prefix cache (sent with every progress word)
    prefill_us: int  # its uncached prompt's cost on an idle server (the step cost model; with cached_tokens)
    refusal_wait_us: int  # OVER_BOUND: the least predicted wait among the servers tried
    refusal_bound_ms: int  # OVER_BOUND: the bound the agent applied
    retry_after_ms: int  # NO_SLOT, OVER_BOUND, SLOT_CAP: when a retry is predicted to be admitted (0: no estimate)
    reserved32: int

    def begin(self, request_id: int, generation: int, slot: int) -> None:
        """A slot starts running a request: whose it is, when (now), nothing produced yet."""
        lib.ep_result_begin(self._p, request_id, generation & 0xFFFFFFFF, slot)

    def first_token(self, t_first_ns: int) -> None:
        """When the first output token was produced (sent with every progress word)."""
        self._p.t_first_ns = t_first_ns

    def cached(self, tokens: int) -> None:
        """How many prompt tokens the model side reused from its prefix cache (not recomputed)."""
        self._p.cached_tokens = tokens

    def prefill(self, seconds: float) -> None:
        """What the request's uncached prompt costs on an idle server, by the model side's cost model."""
        self._p.prefill_us = min(int(seconds * 1e6), 0xFFFFFFFF)

    def placed(self, generation: int, count: int) -> None:
        """``count`` output tokens of ``generation`` are placed (the progress word)."""
        self._p.progress = progress_word(generation, count)

    def end(self, generation: int, status: int, output_count: int) -> None:
        """The final result: how it ended, how many tokens, when (now)."""
        lib.ep_result_end(self._p, generation & 0xFFFFFFFF, status, output_count)

    def refuse(self, status: int) -> None:
        """An answer without a slot (NO_SLOT, OVER_BOUND, SLOT_CAP, UNAVAILABLE, BAD_REQUEST), written by an agent
        process (an OVER_BOUND's wait is already written: :meth:`over_bound`)."""
        p = self._p
        p.status = status
        p.output_count = 0

    def over_bound(self, wait_ms: float, bound_ms: float, retry_ms: float) -> None:
        """Refused OVER_BOUND: the least predicted wait among the servers, the bound it is over and when to come
        back, for the edge's answer."""
        p = self._p
        p.status = Status.OVER_BOUND
        p.output_count = 0
        p.refusal_wait_us = min(int(wait_ms * 1e3), 0xFFFFFFFF)
        p.refusal_bound_ms = min(round(bound_ms), 0xFFFFFFFF)
        p.retry_after_ms = min(math.ceil(retry_ms), 0xFFFFFFFF)

    def no_slot(self, retry_ms: float) -> None:
        """Refused NO_SLOT: when the first slot is predicted to free (0: no estimate)."""
        p = self._p
        p.status = Status.NO_SLOT
        p.output_count = 0
        p.retry_after_ms = min(math.ceil(retry_ms), 0xFFFFFFFF)

    def capped(self, retry_ms: float) -> None:
        """Refused SLOT_CAP: the request's tenant holds its slot cap across every pool; when one of its slots is
        predicted to free (0: no estimate)."""
        p = self._p
        p.status = Status.SLOT_CAP
        p.output_count = 0
        p.retry_after_ms = min(math.ceil(retry_ms), 0xFFFFFFFF)

    def placed_for(self, generation: int) -> int | None:
        """Output tokens placed for ``generation`` as the progress word says, or None when the word is
        another generation's (a late write for an older request of the same entry)."""
        word = self._p.progress
        return progress_count(word) if progress_generation(word) == generation & 0xFFFFFFFF else None


#: final statuses that mean "the model side ran the request" (output, if any, is valid)
FINISHED = (Status.OK, Status.LENGTH, Status.STOP, Status.CANCELLED, Status.RECLAIMED)
#: statuses the data path answers before any slot ran the request
REFUSALS = (Status.NO_SLOT, Status.OVER_BOUND, Status.SLOT_CAP, Status.UNAVAILABLE, Status.BAD_REQUEST)
FLAG_STREAM = lib.EP_FLAG_STREAM
