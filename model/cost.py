"""The step cost model of the slot server's handler: what a step costs on this machine, measured and followed.

The step policy (:mod:`edgepath.contract.plan`) plans with :class:`~edgepath.contract.plan.Costs`; this model is
where the handler gets them -- calibrated at warm-up on the machine it runs on, then followed robustly as steps run
-- and publishes them in the load region, so the agents' prediction replays the plan with the very costs the
handler used.  Only the model side measures steps; the agents read the costs (docs/MODEL.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from edgepath.contract.plan import Costs, Step


class CostModel:
    """The step costs: the calibration measured on this machine, followed online, robustly, within bounds.

    Online, over the last ``window`` steps within ``horizon_s`` seconds, two numbers are fitted: a speed factor
    ``f`` over the calibration's overhead, prompt, decode and decoded-context costs (the machine, or its
    neighbours, running faster or slower) and the prompt context cost ``c`` (per 1,000 positions prompt tokens
    attend: the warm-up's prompts are too short to show it, llama.cpp padding a sequence's KV window), by least
    squares with Huber weights (a step far off the fit weighs little) and a weak pull towards the calibration.
    ``f`` stays within ``bounds``, ``c`` within ``[0, bounds[1] x prompt_ms]``; with no recent step both return
    to the calibration.  So one step slowed 15x by a neighbour moves nothing, a machine that stays 2x slower is
    followed within a few steps, and a model that learned from starved steps cannot lock admission out: it returns
    to what was measured (issue 34's lock-out rested on a one-rate model pulled up 25x by such steps).  The bounds
    are not symmetric: neighbours make steps slower, never faster, so steps faster than calibrated are evidence
    that the calibration itself was starved (a slot server restarted beside a busy one, in the container lane,
    calibrated 3-5x slow) and are followed further down (1/5) than slower ones up (4x)."""

    #: a Huber weight's corner: a step within 25 % of the fit counts fully, beyond that less and less
    HUBER = 0.25
    #: how much the attended positions must vary across steps (relative to their mean) before they move the context
    #: cost away from the calibration's
    PRIOR = 0.05

    def __init__(
        self,
        base: Costs,
        window: int = 64,
        horizon_s: float = 30.0,
        bounds: tuple[float, float] = (0.2, 4.0),
        big: int = 4,
    ) -> None:
        if not base.known:
            raise ValueError(f"cost model: need a prompt or a decode cost > 0 ms, got {base}")
        if not (window >= 1 and horizon_s > 0 and 0 < bounds[0] <= 1 <= bounds[1] and big >= 1):
            raise ValueError(f"cost model: bad window {window}, horizon {horizon_s}, bounds {bounds}, big {big}")
        self.bounds = bounds
        self.horizon_s = horizon_s
        self.big = big  # steps of fewer tokens are too short to say much (timer and scheduler noise)
        self._steps: deque[tuple[float, float, float, float]] = deque(maxlen=window)  # when, base ms, attended, ms
        self._set_base(base)

    def _set_base(self, base: Costs) -> None:
        self.base = base
        self._flat = replace(base, context_ms=0.0)  # what the factor scales
        self._steps.clear()
        self._factor, self._context = 1.0, base.context_ms
        self._costs = base.published()

    @property
    def factor(self) -> float:
        return self._factor

    def costs(self) -> Costs:
        """The costs to plan and publish with now (as published: float32)."""
        return self._costs

    def observe(self, step: Step, ms: float, now: float) -> None:
        """A step of this shape took ``ms`` milliseconds at ``now`` (monotonic seconds)."""
        self.forget(now)
        if step.tokens < self.big or not math.isfinite(ms) or ms <= 0:
            return
        self._steps.append((now, self._flat.step_ms(step), step.attended / 1e3, ms))
        self._refit()

    def forget(self, now: float) -> None:
        """Drop what is older than the horizon (with nothing recent left, the calibration is what holds)."""
        steps = self._steps
        if steps and now - steps[0][0] > self.horizon_s:
            while steps and now - steps[0][0] > self.horizon_s:
                steps.popleft()
            self._refit()

    def _refit(self) -> None:
        base = self.base
        if not self._steps:
            self._factor, self._context = 1.0, base.context_ms
        else:
            data = np.array(self._steps)[:, 1:]
            x, z = data[:, 1] / data[:, 0], data[:, 2] / data[:, 0]  # per step: z = f + (f * c) * x
            f, c, c0 = self._factor, self._context, base.context_ms
            low, high = self.bounds
            for _ in range(3):  # iteratively reweighted: Huber weights on the relative residual
                fit = f * (1 + c * x)
                r = np.abs(z - fit) / np.maximum(fit, 1e-9)
                w = np.where(r <= self.HUBER, 1.0, self.HUBER / np.maximum(r, 1e-12))
                mx, mz = float(w @ x) / float(w.sum()), float(w @ z) / float(w.sum())
                # the slope only from how the context varies across steps, pulled towards the calibration's
                # (steps all of one shape say nothing of it); the level from the rest
                spread = float(w @ ((x - mx) ** 2)) + float(w.sum()) * (self.PRIOR * mx) ** 2 + 1e-18
                prior = f * c0
                slope = prior + float(w @ ((x - mx) * (z - mz - prior * (x - mx)))) / spread
                f = min(high, max(low, mz - max(0.0, slope) * mx))
                c = min(high * base.prompt_ms, max(0.0, slope / f))
            self._factor, self._context = f, c
        f = self._factor
        self._costs = replace(self._flat.scaled(f), context_ms=f * self._context).published()

    def calibrate(self, steps: Sequence[Step], ms: Sequence[float]) -> bool:
        """Set the calibration from measured steps (``steps[i]`` took ``ms[i]``): non-negative least squares
        over the five costs.  Whether it took: steps that make no cost model (too few, not finite, nothing
        rising with tokens) leave it as it was."""
        if len(steps) != len(ms) or len(steps) < 2 or not all(math.isfinite(t) and t > 0 for t in ms):
            return False
        x = np.array([[s.ubatches, s.prompt, s.decode, s.attended / 1e3, s.context / 1e3] for s in steps])
        y = np.array(ms, dtype=float)
        active = [i for i in range(5) if np.any(x[:, i] != x[0, i]) or i == 0]
        while True:
            solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            negative = [a for a, v in zip(active, solution, strict=True) if v < 0]
            if not negative:
                break
            active.remove(negative[0])
            if not active:
                return False
        values = [0.0] * 5
        for a, v in zip(active, solution, strict=True):
            values[a] = float(v)
        fitted = Costs(*values)
        if not fitted.known:
            return False
        if fitted.prompt_ms == 0 or fitted.decode_ms == 0:  # one kind unmeasured: it costs what the other does
            rate = fitted.prompt_ms or fitted.decode_ms
            fitted = replace(fitted, prompt_ms=fitted.prompt_ms or rate, decode_ms=fitted.decode_ms or rate)
        self._set_base(fitted)
        return True
