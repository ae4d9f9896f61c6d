"""Sampling, apart from running the model: one :class:`SlotSampler` per running slot picks its next token from
the logits row the step left for it, and says how likely it and its likeliest alternatives were.

The handler (:mod:`edgepath.model.llama`) decides what is decoded and where the logits are; this module decides
which token they give -- as vLLM keeps its ``Sampler`` apart from its model runner -- so what shapes the choice
(sampling parameters, a constraint, log probabilities) is one place, and an engine that computes
logits elsewhere can use it as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgepath.contract.wire import Sampling


class SlotSampler:
    """One slot's sampler: at temperature 0 greedy, an argmax over the logits row in numpy; otherwise a
    llama.cpp sampler chain built from the request's :class:`Sampling` -- top-k, top-p, temperature and a
    seeded draw (llama.cpp seeds are 32-bit: the low 32 bits of the request's seed).  With a constraint (a GBNF
    grammar) the chain starts with llama.cpp's grammar sampler, which leaves only the tokens the grammar allows
    next and follows each token drawn (greedy then is the chain's argmax).  :meth:`close` frees the chain; a
    sampler is used by one slot only (the chain keeps the draw's and the grammar's state)."""

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
        self._chain = None if sampling.temperature == 0.0 and grammar is None else _chain(lib, sampling, grammar)

    def sample(self, ctx: Any, index: int) -> int:
        """The next token from the logits of batch index ``index`` of the step just decoded on ``ctx``."""
        if self._chain is None:
            return int(self.logits(ctx, index).argmax())
        return int(self._lib.llama_sampler_sample(self._chain, ctx, index))

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


def _chain(lib: Any, sampling: Sampling, grammar: tuple[Any, str] | None = None) -> Any:
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    if not chain:
        raise RuntimeError("llama_sampler_chain_init returned NULL")
    parts = []
    if grammar is not None:
        vocab, text = grammar
        parts.append(lib.llama_sampler_init_grammar(vocab, text.encode(), b"root"))
    if sampling.temperature == 0.0:
        parts.append(lib.llama_sampler_init_greedy())
        return _chained(lib, chain, parts, sampling)
    if sampling.top_k > 0:
        parts.append(lib.llama_sampler_init_top_k(sampling.top_k))
    if sampling.top_p < 1.0:
        parts.append(lib.llama_sampler_init_top_p(sampling.top_p, 1))
    parts.append(lib.llama_sampler_init_temp(sampling.temperature))
    parts.append(lib.llama_sampler_init_dist(sampling.seed & 0xFFFFFFFF))
    return _chained(lib, chain, parts, sampling)


def _chained(lib: Any, chain: Any, parts: list[Any], sampling: Sampling) -> Any:
    for part in parts:
        if not part:
            lib.llama_sampler_free(chain)
            raise RuntimeError(f"a llama.cpp sampler for {sampling} could not be created")
        lib.llama_sampler_chain_add(chain, part)  # the chain owns it from here
    return chain
