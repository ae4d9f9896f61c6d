"""Sampling, apart from running the model: one :class:`SlotSampler` per running slot picks its next token from
the logits row the step left for it, and says how likely it and its likeliest alternatives were.

The handler (:mod:`edgepath.model.llama`) decides what is decoded and where the logits are; this module decides
which token they give -- as vLLM keeps its ``Sampler`` apart from its model runner -- so what shapes the choice
(sampling parameters, a constraint, log probabilities) is one place, and an engine that computes
logits elsewhere can use it as it is.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgepath.contract.wire import PENALTY_LAST_N, Sampling


class SlotSampler:
    """One slot's sampler: at temperature 0 with nothing else asked, greedy, an argmax over the logits row in numpy;
    otherwise a llama.cpp sampler chain built from the request's :class:`Sampling` in llama-server's order --
    logit biases, the penalties, top-k, top-p, min-p, temperature, then a seeded draw (llama.cpp seeds are 32-bit:
    the low 32 bits of the request's seed) or, at temperature 0, the likeliest token.  The penalties count the
    sequence's last :data:`~edgepath.contract.wire.PENALTY_LAST_N` tokens, its prompt's included, as llama-server's
    do: the chain is given the prompt's tail when it is made, and every token it picks.

    With a constraint (a GBNF grammar, llama.cpp's grammar sampler) the token is drawn as without one and the
    grammar asked whether it may come next; only when it may not is the draw made again over the tokens the grammar
    allows (as llama-server does: asking about one token is far cheaper than masking the whole vocabulary every
    step), and the chain is told only of the token kept.  :meth:`close` frees the chain and the grammar; a sampler
    is used by one slot only (they keep the draw's, the penalties' and the grammar's state)."""

    def __init__(
        self,
        lib: Any,
        sampling: Sampling,
        n_vocab: int,
        top_logprobs: int | None = None,
        grammar: tuple[Any, str] | None = None,
        prompt: np.ndarray | None = None,
        suppress: Sequence[int] = (),
    ) -> None:
        """``top_logprobs``: None, no log probabilities; else how many alternatives :meth:`logprobs` gives;
        ``grammar``: (the model's vocabulary, GBNF text) the output must match; ``prompt``: the sequence's prompt
        (its tail is what the penalties count first); ``suppress``: tokens never drawn (the end-of-generation tokens
        of a request that ignores them: a bias of -inf each, as llama-server's ``ignore_eos``).  Raises ValueError
        for a logit bias on a token the vocabulary does not have, RuntimeError when llama.cpp cannot make the chain
        (a grammar it cannot parse among the reasons)."""
        self._lib = lib
        self.sampling = sampling
        self.n_vocab = n_vocab
        self.top_logprobs = top_logprobs
        outside = [token for token, _ in sampling.logit_bias if not 0 <= token < n_vocab]
        if outside:
            raise ValueError(f"logit bias on token {outside[0]}, outside the vocabulary's 0..{n_vocab - 1}")
        self._chain = None
        if sampling.temperature != 0.0 or sampling.shaped or suppress:
            self._chain = _chain(lib, sampling, n_vocab, suppress)
            if sampling.penalized and prompt is not None:
                for token in prompt[-PENALTY_LAST_N:].tolist():
                    lib.llama_sampler_accept(self._chain, token)
        self._grammar = None
        if grammar is not None:
            self._grammar = lib.llama_sampler_init_grammar(grammar[0], grammar[1].encode(), b"root")
            if not self._grammar:
                self.close()
                raise RuntimeError("llama.cpp could not parse the request's grammar")
            self._one = np.zeros(1, dtype=_TOKEN_DATA)  # one candidate: may the drawn token come next?
        self._all = np.zeros(0, dtype=_TOKEN_DATA)  # every candidate, made when a draw needs them

    def sample(self, ctx: Any, index: int) -> int:
        """The next token from the logits of batch index ``index`` of the step just decoded on ``ctx``."""
        if self._grammar is None:
            return self._draw(ctx, index)
        token = self._peek(ctx, index)
        if not self._allows(token):
            token = self._draw_allowed(ctx, index)
        if self._chain is not None:
            self._lib.llama_sampler_accept(self._chain, token)
        self._lib.llama_sampler_accept(self._grammar, token)
        return token

    def _draw(self, ctx: Any, index: int) -> int:
        """The chain's pick, which the chain counts as the sequence's next token (``llama_sampler_sample``)."""
        if self._chain is None:
            return int(self.logits(ctx, index).argmax())
        return int(self._lib.llama_sampler_sample(self._chain, ctx, index))

    def _peek(self, ctx: Any, index: int) -> int:
        """The chain's pick, not yet counted: the grammar may refuse it."""
        if self._chain is None:
            return int(self.logits(ctx, index).argmax())
        candidates = self._candidates(self._every(ctx, index))
        self._lib.llama_sampler_apply(self._chain, ctypes.byref(candidates))
        return int(candidates.data[candidates.selected].id)

    def _every(self, ctx: Any, index: int) -> np.ndarray:
        """Every token of the vocabulary as a candidate, with its logit of batch index ``index``."""
        if len(self._all) != self.n_vocab:
            self._all = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        every = self._all
        every["id"] = np.arange(self.n_vocab, dtype=np.int32)
        every["logit"] = self.logits(ctx, index)
        every["p"] = 0.0
        return every

    def _candidates(self, data: np.ndarray) -> Any:
        pointer = data.ctypes.data_as(self._lib.llama_token_data_p)
        return self._lib.llama_token_data_array(pointer, len(data), -1, False)

    def _allows(self, token: int) -> bool:
        one = self._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(self._candidates(one)))
        return bool(np.isfinite(one["logit"][0]))

    def _draw_allowed(self, ctx: Any, index: int) -> int:
        """The draw again, over the tokens the grammar allows next (the others' logits made -inf); not counted."""
        lib = self._lib
        every = self._every(ctx, index)
        candidates = self._candidates(every)
        lib.llama_sampler_apply(self._grammar, ctypes.byref(candidates))
        if self._chain is None:
            return int(every["logit"].argmax())
        lib.llama_sampler_apply(self._chain, ctypes.byref(candidates))
        return int(candidates.data[candidates.selected].id)

    def logprobs(self, ctx: Any, index: int, token: int) -> tuple[float, np.ndarray, np.ndarray]:
        """``token``'s log probability and the ``top_logprobs`` likeliest ids with theirs (likeliest first), from
        the logits row the draw used: the model's distribution, a log-softmax of the raw logits before top-k,
        top-p and temperature shape the draw (as llama-server reports them by default), so they do not depend
        on the sampling parameters."""
        row = self.logits(ctx, index).astype(np.float64)
        high = row.max()
        total = high + np.log(np.exp(row - high).sum())
        top = self.top_logprobs or 0
        ids = np.argpartition(-row, top)[:top] if 0 < top < len(row) else np.arange(min(top, len(row)))
        ids = ids[np.argsort(-row[ids], kind="stable")]
        return float(row[token] - total), ids.astype(np.int32), (row[ids] - total).astype(np.float32)

    def logits(self, ctx: Any, index: int) -> np.ndarray:
        """The logits row of batch index ``index``: a view of llama.cpp's buffer, valid until the next decode."""
        return np.ctypeslib.as_array(self._lib.llama_get_logits_ith(ctx, index), (self.n_vocab,))

    def close(self) -> None:
        if self._chain is not None:
            self._lib.llama_sampler_free(self._chain)
            self._chain = None
        if getattr(self, "_grammar", None):
            self._lib.llama_sampler_free(self._grammar)
            self._grammar = None


#: llama.cpp's llama_token_data, as numpy lays out an array of them
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


#: the seed llama.cpp's draw takes for "draw a random seed" (LLAMA_DEFAULT_SEED)
_RANDOM_SEED = 0xFFFFFFFF


def dist_seed(seed: int) -> int:
    """The 32-bit seed of llama.cpp's draw for a request's seed: its low 32 bits -- but for 0xFFFFFFFF, which
    llama.cpp would replace by a random seed (a given seed must give the same answer again): 0xFFFFFFFE then."""
    low = seed & 0xFFFFFFFF
    return low - 1 if low == _RANDOM_SEED else low


def _chain(lib: Any, sampling: Sampling, n_vocab: int, suppress: Sequence[int] = ()) -> Any:
    """The llama.cpp chain of ``sampling``, in llama-server's order (``common/sampling.cpp``): logit biases first
    (the ``suppress`` tokens' -inf among them), then the penalties, top-k, top-p, min-p, temperature, the draw;
    greedy at temperature 0."""
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    if not chain:
        raise RuntimeError("llama_sampler_chain_init returned NULL")
    parts = []
    pairs = [*sampling.logit_bias, *((token, -math.inf) for token in suppress)]
    if pairs:
        biases = (lib.llama_logit_bias * len(pairs))(*pairs)
        parts.append(lib.llama_sampler_init_logit_bias(n_vocab, len(pairs), biases))  # copied
    if sampling.penalized:
        repetition = sampling.repetition_penalty or 1.0  # 0 (a zeroed header): off
        parts.append(
            lib.llama_sampler_init_penalties(
                n_vocab, PENALTY_LAST_N, repetition, sampling.frequency_penalty, sampling.presence_penalty
            )
        )
    if sampling.temperature == 0.0:
        parts.append(lib.llama_sampler_init_greedy())
    else:
        if sampling.top_k > 0:
            parts.append(lib.llama_sampler_init_top_k(sampling.top_k))
        if 0.0 < sampling.top_p < 1.0:
            parts.append(lib.llama_sampler_init_top_p(sampling.top_p, 1))
        if sampling.min_p > 0.0:
            parts.append(lib.llama_sampler_init_min_p(sampling.min_p, 1))
        parts.append(lib.llama_sampler_init_temp(sampling.temperature))
        parts.append(lib.llama_sampler_init_dist(dist_seed(sampling.seed)))
    if not all(parts):
        for part in [chain, *parts]:
            if part:
                lib.llama_sampler_free(part)
        raise RuntimeError(f"a llama.cpp sampler for {sampling} could not be created")
    for part in parts:
        lib.llama_sampler_chain_add(chain, part)  # the chain owns it from here
    return chain
