"""What a request asks of the model side beyond its prompt -- its sampling, logit biases, whether end-of-generation
is drawn -- and the checks every request passes, the writer's and the slot server's the same."""

from __future__ import annotations

from dataclasses import dataclass

from edgepath.native.abi import lib

TOKEN_MIN = -(2**31)
TOKEN_MAX = 2**31 - 1


class RequestInvalid(ValueError):
    """A request that does not fit the slot format; the message says what is allowed."""


#: a request's logit biases: (token id, bias added to its logit) pairs, ids ascending, each id once
LogitBias = tuple[tuple[int, float], ...]
#: most logit biases one request carries (the bound OpenAI's API applies)
LOGIT_BIAS_MAX = int(lib.EP_LOGIT_BIAS_MAX)
#: the window of the presence, frequency and repetition penalties: the sequence's last tokens, prompt included
PENALTY_LAST_N = int(lib.EP_PENALTY_LAST_N)
#: the ranges the slot checks (an API may allow less): presence and frequency penalties, repetition penalty, bias
PENALTY_MAX, REPETITION_MAX, BIAS_MAX = 2.0, 10.0, 100.0


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters carried to the model side: in the request header, but for ``logit_bias``, whose pairs
    follow the prompt (:func:`after_prompt`) and whose count the header holds."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 0 (a zeroed header) or 1: no nucleus cut
    top_k: int = 0  # 0: off
    seed: int = 0
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 0 (a zeroed header) or 1: off
    logit_bias: LogitBias = ()

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (they need the sequence's last :data:`PENALTY_LAST_N` tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty not in (0.0, 1.0)

    @property
    def shaped(self) -> bool:
        """Whether anything but temperature, top-k and top-p shapes the draw (then even greedy needs llama.cpp's
        samplers: a bias or a penalty moves the likeliest token)."""
        return self.penalized or bool(self.logit_bias) or self.min_p > 0.0

    def check(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise RequestInvalid(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise RequestInvalid(f"top_p must be between 0 and 1 (0 or 1: off), got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise RequestInvalid(f"top_k must be a non-negative integer, got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise RequestInvalid(f"seed must be an unsigned 64-bit integer, got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestInvalid(f"min_p must be between 0 and 1 (0: off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_MAX <= value <= PENALTY_MAX:
                raise RequestInvalid(f"{name} must be between -{PENALTY_MAX:g} and {PENALTY_MAX:g}, got {value}")
        if not 0.0 <= self.repetition_penalty <= REPETITION_MAX:
            raise RequestInvalid(
                f"repetition_penalty must be between 0 and {REPETITION_MAX:g} (0 or 1: off), "
                f"got {self.repetition_penalty}"
            )
        check_logit_bias(self.logit_bias)


def check_logit_bias(logit_bias: LogitBias, vocab_size: int = 2**31) -> None:
    """RequestInvalid unless ``logit_bias`` is at most :data:`LOGIT_BIAS_MAX` pairs of ascending ids below
    ``vocab_size`` with finite biases within +-:data:`BIAS_MAX`."""
    if len(logit_bias) > LOGIT_BIAS_MAX:
        raise RequestInvalid(f"at most {LOGIT_BIAS_MAX} logit biases, got {len(logit_bias)}")
    last = -1
    for token, bias in logit_bias:
        if not last < token < vocab_size:
            raise RequestInvalid(
                f"logit bias token ids must ascend within 0..{vocab_size - 1}, got {token} after {last}"
            )
        if not -BIAS_MAX <= bias <= BIAS_MAX:
            raise RequestInvalid(
                f"a logit bias must be between -{BIAS_MAX:g} and {BIAS_MAX:g}, got {bias} (token {token})"
            )
        last = token


#: the sampling of a zeroed request header: greedy, no nucleus cut, no penalty
ZEROED = Sampling(0.0, 0.0, 0, 0, repetition_penalty=0.0)

#: the model's end-of-generation tokens are never drawn: the answer runs to its max_new_tokens (``ignore_eos``)
FLAG_IGNORE_EOS = lib.EP_FLAG_IGNORE_EOS


def request_problem(token_count: int, max_new_tokens: int, input_capacity: int, output_capacity: int) -> str | None:
    """Why a request with these counts cannot go into a slot of these capacities (None: it can)."""
    if token_count <= 0:
        return f"a request needs at least 1 token, got {token_count}"
    if token_count > input_capacity:
        return f"request has {token_count} tokens; a slot holds at most {input_capacity}"
    if not 0 <= max_new_tokens <= output_capacity:
        return f"max_new_tokens must be between 0 and {output_capacity}, got {max_new_tokens}"
    return None
