"""A started slot's request as the slot server reads it from the pool: checked against the slot and its agent's
reply entry (the slot server checks what any writer put there, the agent's checks notwithstanding), the words
after its prompt read (a constraint, logit biases), and handed to the model side as a
:class:`~edgepath.slots.handlers.SlotRequest` -- views into the slot, nothing copied."""

from __future__ import annotations

from edgepath.contract import wire
from edgepath.contract.pool import SlotPool
from edgepath.contract.wire import RequestHeader
from edgepath.slots.config import SlotServerConfig
from edgepath.slots.handlers import SlotRequest
from edgepath.slots.peers import AgentPeer


def read_request(pool: SlotPool, config: SlotServerConfig, slot: int, peer: AgentPeer | None) -> SlotRequest | str:
    """The request in ``slot``, or why it cannot run (its agent ``peer``'s reply entries bound its output)."""
    req = pool.slots.request_headers[slot]
    problem = _problem(req, config, peer)
    if problem is not None:
        return problem
    try:
        constraint, sampling = _read(pool, req, slot)
    except ValueError as exc:
        return str(exc)
    slots, max_new = pool.slots, req.max_new_tokens
    return SlotRequest(
        slot,
        req.request_id,
        max_new,
        req.flags,
        slots.tokens[slot, : req.token_count],
        slots.outputs[slot, :max_new],
        sampling,
        req.cache_salt,
        constraint,
        req.tenant,
        req.slot_floor,
    )


def _problem(req: RequestHeader, config: SlotServerConfig, peer: AgentPeer | None) -> str | None:
    """Why the request in a slot cannot run (None: it can)."""
    out_cap = config.output_capacity
    if peer is not None:
        out_cap = min(out_cap, peer.layout.output_capacity)
        if not 0 <= req.reply_index < peer.frames:
            return f"reply_index {req.reply_index} outside the agent's {peer.frames} frames"
    if req.output_offset:
        if req.output_offset > out_cap:
            return f"output_offset {req.output_offset} is past the {out_cap} output tokens of a reply entry"
        out_cap -= req.output_offset  # the migrated request's own output goes after what its answer has
    words = wire.input_words(req.token_count, req.flags)  # the prompt and its constraint
    problem = wire.request_problem(words, req.max_new_tokens, config.input_capacity, out_cap)
    if problem is None and req.logit_biases > wire.LOGIT_BIAS_MAX:
        problem = f"{req.logit_biases} logit biases; a request carries at most {wire.LOGIT_BIAS_MAX}"
    return problem


def _read(pool: SlotPool, req: RequestHeader, slot: int) -> tuple[str | None, wire.Sampling]:
    """The request's constraint (None: none) and its sampling, logit biases included (the words after its prompt,
    which :func:`_problem` found within the slot); ValueError naming what is wrong with them."""
    constraint: str | None = None
    logit_bias: wire.LogitBias = ()
    if req.flags & wire.FLAG_CONSTRAINT or req.logit_biases:
        after = pool.slots.tokens[slot, req.token_count : wire.input_words(req.token_count, req.flags)]
        constraint, logit_bias = wire.read_after_prompt(after, req.logit_biases)
    sampling = req.sampling(logit_bias)
    try:
        sampling.check()
    except wire.RequestInvalid as exc:
        raise ValueError(str(exc)) from None
    return constraint, sampling
