"""Sampling, apart from running the model: one :class:`SlotSampler` per running slot picks its next token from
the logits row the step left for it, and says how likely it and its likeliest alternatives were.

The handler (:mod:`edgepath.model.llama`) decides what is decoded and where the logits are; this module decides
which token they give -- as vLLM keeps its ``Sampler`` apart from its model runner -- so what shapes the choice
(sampling parameters, a constraint, log probabilities) is one place, and an engine that computes
logits elsewhere can use it as it is.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from edgepath.contract.wire import Sampling


class SlotSampler:
    """One slot's sampler: at temperature 0 greedy, an argmax over the logits row in numpy; otherwise a
    llama.cpp sampler chain built from the request's :class:`Sampling` -- top-k, top-p, temperature and a
    seeded draw (llama.cpp seeds are 32-bit: the low 32 bits of the request's seed).  With a constraint (a GBNF
    grammar, llama.cpp's grammar sampler) the token is drawn as without one and the grammar asked whether it
    may come next; only when it may not is the draw made again over the tokens the grammar allows (as
    llama-server does: asking about one token is far cheaper than masking the whole vocabulary every step).
    :meth:`close` frees the chain and the grammar; a sampler is used by one slot only (they keep the draw's and
    the grammar's state)."""

    def __init__(
        self,
        lib: Any,
        sampling: Sampling,
        n_vocab: int,
        top_logprobs: int | None = None,
        grammar: tuple[Any, str] | None = None,
    ) -> None:
        """``top_logprobs``: None, no log probabilities; else how many alternatives :meth:`logprobs` gives;
        ``grammar``: (the model's vocabulary, GBNF text) the output must match.  Raises RuntimeError when
        llama.cpp cannot make the chain (a grammar it cannot parse among the reasons)."""
        self._lib = lib
        self.sampling = sampling
        self.n_vocab = n_vocab
        self.top_logprobs = top_logprobs
        self._chain = None if sampling.temperature == 0.0 else _chain(lib, sampling)
        self._grammar = None
        if grammar is not None:
            self._grammar = lib.llama_sampler_init_grammar(grammar[0], grammar[1].encode(), b"root")
            if not self._grammar:
                self.close()
                raise RuntimeError("llama.cpp could not parse the request's grammar")
            self._one = np.zeros(1, dtype=_TOKEN_DATA)  # one candidate: may the drawn token come next?
            self._all = np.zeros(0, dtype=_TOKEN_DATA)  # every candidate, made when a draw is refused

    def sample(self, ctx: Any, index: int) -> int:
        """The next token from the logits of batch index ``index`` of the step just decoded on ``ctx``."""
        token = self._draw(ctx, index)
        if self._grammar is None:
            return token
        if not self._allows(token):
            token = self._draw_allowed(ctx, index)
        self._lib.llama_sampler_accept(self._grammar, token)
        return token

    def _draw(self, ctx: Any, index: int) -> int:
        if self._chain is None:
            return int(self.logits(ctx, index).argmax())
        return int(self._lib.llama_sampler_sample(self._chain, ctx, index))

    def _candidates(self, data: np.ndarray) -> Any:
        pointer = data.ctypes.data_as(self._lib.llama_token_data_p)
        return self._lib.llama_token_data_array(pointer, len(data), -1, False)

    def _allows(self, token: int) -> bool:
        one = self._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(self._candidates(one)))
        return bool(np.isfinite(one["logit"][0]))

    def _draw_allowed(self, ctx: Any, index: int) -> int:
        """The draw again, over the tokens the grammar allows next (the others' logits made -inf)."""
        lib = self._lib
        if len(self._all) != self.n_vocab:
            self._all = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        every = self._all
        every["id"] = np.arange(self.n_vocab, dtype=np.int32)
        every["logit"] = self.logits(ctx, index)
        every["p"] = 0.0
        candidates = self._candidates(every)
        lib.llama_sampler_apply(self._grammar, ctypes.byref(candidates))
        if self._chain is None:
            return int(every["logit"].argmax())
        lib.llama_sampler_apply(self._chain, ctypes.byref(candidates))
        token = int(candidates.data[candidates.selected].id)
        lib.llama_sampler_accept(self._chain, token)
        return token

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


def _chain(lib: Any, sampling: Sampling) -> Any:
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    if not chain:
        raise RuntimeError("llama_sampler_chain_init returned NULL")
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
