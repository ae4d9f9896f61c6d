"""The step policy of the llama.cpp handler, sans I/O: which prompt tokens ride in the next step.

Every step is one ``llama_decode`` over every running slot.  On a CPU a prompt token costs about what a
decoded token costs (docs/MODEL.md has the measured table), so a step's time grows with the prompt tokens
it carries, and every decoding stream waits for the whole step.  The policy's objectives, in order:

1. **Decoding never stops.**  Every decoding slot has its one token in every step.
2. **A stall is bounded.**  While any slot decodes, a step is planned to take at most ``stall_ms`` (by the
   cost model below): that is the longest gap a stream sees between two tokens because of others' prompts.
3. **Prompts are prefilled in as few steps as that bound allows**, oldest first.  Spreading a prompt thinly
   over many steps (a fixed small chunk) makes *every* step long -- the streams' usual gap grows -- and
   delays the prompt's first token by one decode step per chunk; concentrating it keeps most steps pure
   decode steps and gives the first token as early as the bound allows.
4. **A whole prompt at once when nothing is decoding** (up to ``batch`` tokens): nobody waits on the step,
   and fewer, larger steps pay llama.cpp's per-step cost once.  Other prompts join that step only within
   the stall bound, since each one delays the first prompt's first token.
5. **New arrivals always progress**: a waiting prompt gets at least ``min_prefill`` tokens in every step,
   even when the decoding slots alone fill the bound -- under load a request admitted to a slot still
   reaches its first token (edgepath refuses what it cannot serve with 429; it never queues).

The cost model is learned from the steps as they run (:class:`CostModel`), so the bound holds in
milliseconds whatever the model, the thread count or the neighbours on the machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class CostModel:
    """A step's time as ``overhead_ms + token_ms * tokens``, tracked from observed steps.

    Two exponentially weighted estimates: the per-token cost from steps large enough for it to dominate
    (at least ``big`` tokens: the overhead is then a small part, and what is left of it is subtracted),
    the per-step overhead from every step's residual.  A start value comes from measurement
    (docs/MODEL.md); ``alpha`` is the weight of one new observation."""

    def __init__(self, overhead_ms: float, token_ms: float, alpha: float = 0.1, big: int = 16) -> None:
        if not (overhead_ms >= 0 and token_ms > 0 and 0 < alpha <= 1 and big >= 1):
            raise ValueError(
                f"cost model: need overhead_ms >= 0, token_ms > 0, 0 < alpha <= 1, big >= 1; "
                f"got {overhead_ms}, {token_ms}, {alpha}, {big}"
            )
        self.overhead_ms = overhead_ms
        self.token_ms = token_ms
        self.alpha = alpha
        self.big = big

    def observe(self, tokens: int, ms: float) -> None:
        """One step of ``tokens`` tokens took ``ms`` milliseconds."""
        if tokens <= 0 or not math.isfinite(ms) or ms < 0:
            return
        if tokens >= self.big:
            per_token = max(1e-3, (ms - self.overhead_ms) / tokens)
            self.token_ms += self.alpha * (per_token - self.token_ms)
        residual = ms - self.token_ms * tokens
        self.overhead_ms = max(0.0, self.overhead_ms + self.alpha * (residual - self.overhead_ms))

    def fit(self, tokens: Sequence[int], ms: Sequence[float]) -> None:
        """Start from measured steps (``tokens[i]`` took ``ms[i]``): the least-squares line through them.  A
        line that is no cost model (not rising, or no two sizes) leaves the estimates as they were."""
        if len(set(tokens)) < 2 or len(tokens) != len(ms) or not all(math.isfinite(t) and t >= 0 for t in ms):
            return
        mean_n, mean_ms = sum(tokens) / len(tokens), sum(ms) / len(ms)
        spread = sum((n - mean_n) ** 2 for n in tokens)
        slope = sum((n - mean_n) * (t - mean_ms) for n, t in zip(tokens, ms, strict=True)) / spread
        if slope <= 0:
            return
        self.token_ms = slope
        self.overhead_ms = max(0.0, mean_ms - slope * mean_n)

    def predict(self, tokens: int) -> float:
        """Milliseconds a step of ``tokens`` tokens should take."""
        return self.overhead_ms + self.token_ms * tokens

    def tokens_within(self, ms: float) -> int:
        """The most tokens a step may carry and still be predicted to end within ``ms`` (0: none fit)."""
        return max(0, math.floor((ms - self.overhead_ms) / self.token_ms))


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """The policy's knobs (the handler's ``--handler-option`` values of the same names)."""

    stall_ms: float  # while slots decode, a step is planned within this many milliseconds
    min_prefill: int  # prompt tokens a step carries at least while a prompt waits
    batch: int  # tokens at most in one step (llama.cpp's n_batch)

    def __post_init__(self) -> None:
        if not self.stall_ms > 0:
            raise ValueError(f"stall_ms must be > 0 milliseconds, got {self.stall_ms}")
        if self.min_prefill < 1:
            raise ValueError(f"min_prefill must be >= 1 token, got {self.min_prefill}")
        if self.batch < 2:
            raise ValueError(f"batch must be >= 2 tokens, got {self.batch}")


class StepPolicy:
    """Plans each step's prompt tokens (see the module's objectives); learns step costs as they come."""

    def __init__(self, options: PolicyOptions, cost: CostModel) -> None:
        self.options = options
        self.cost = cost

    def plan(self, decoding: int, waiting: Sequence[int]) -> list[int]:
        """Prompt tokens to decode this step from each waiting prompt.

        ``decoding``: slots that decode one token each this step; ``waiting``: the prompt tokens each
        prefilling slot still has to decode, oldest first.  Returns one count per waiting prompt, in the
        same order (0: that prompt waits for a later step); the step then holds ``decoding + sum(...)``
        tokens, never more than ``batch``."""
        if decoding < 0 or any(n < 1 for n in waiting):
            raise ValueError(f"plan: need decoding >= 0 and every waiting prompt >= 1 token, got {decoding}, {waiting}")
        room = self.options.batch - decoding
        if room < 1:
            raise ValueError(f"plan: {decoding} decoding slots leave no room in a batch of {self.options.batch}")
        bounded = self.cost.tokens_within(self.options.stall_ms) - decoding
        if decoding:
            allowed = min(room, max(self.options.min_prefill, bounded))
        else:
            # Nobody decodes: the oldest prompt goes whole; others join only within the stall bound.
            allowed = min(room, max(waiting[0] if waiting else 0, bounded))
        plan = []
        for remaining in waiting:
            take = min(remaining, allowed)
            plan.append(take)
            allowed -= take
        return plan

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` tokens took ``seconds`` in ``llama_decode``."""
        self.cost.observe(tokens, seconds * 1e3)
