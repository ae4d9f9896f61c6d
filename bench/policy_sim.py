"""Step policies at saturation, replayed on a step cost model: where a closed loop's time goes under each rule.

Issue 52 asked for a rule for how many prompt tokens a decode step may carry at saturation (guidellm's closed loop of
8 streams, 128-token prompts, 64 tokens each).  What a rule can change there is arithmetic before it is
measurement: this replays a closed loop step by step on :class:`~edgepath.contract.plan.Costs` (the handler's own
cost model: per micro-batch, per prompt token, per decoded token, attention), with the candidate rules side by side:

* ``edgepath`` -- the shipped :class:`~edgepath.contract.plan.StepPolicy` (a prompt within the stall bound in as
  few steps as it allows, later prompts held to the join share but at a full house: objective 9);
* ``without-9`` -- the same without objective 9 (the join share at a full house too: the policy before issue 52);
* ``whole`` -- llama-server's default batching: every waiting prompt whole in the next step;
* ``budget-N`` -- Sarathi-style chunked prefill: every step carries the decoding rows and at most N prompt tokens.

Each client sends its next request a few milliseconds (``--turnaround``, drawn) after its last one ended; every
answer is ``--max-tokens`` long.  Per rule: TTFT p50, each request's mean inter-token gap p50 (guidellm's ITL) and
output tokens/s, after a warm-up, over ``--seeds`` seeds; ``--start together`` sends the first requests at once (as
guidellm does), ``spread`` over the first seconds.  Figures are the cost model's, not a server's: they show the
shapes a rule makes (who waits for whose prompt), which is what the profile of a real run
(:mod:`edgepath.bench.step_profile`) is then read against.

    python -m edgepath.bench.policy_sim [--prompt 140 --max-tokens 64 --clients 8 --start together]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edgepath.contract.plan import Costs, PolicyOptions, Prompt, StepPolicy, _shape

#: a rule: (costs, decoding streams, longest decoding position, waiting prompts, every slot taken) -> takes
Rule = Callable[[Costs, int, int, Sequence[Prompt], bool], list[int]]


def shipped(options: PolicyOptions, gathers: bool = True) -> Rule:
    """The shipped policy; ``gathers=False``: without objective 9 (the policy before issue 52)."""
    policy = StepPolicy(options)

    def rule(costs: Costs, decoding: int, longest: int, waiting: Sequence[Prompt], full: bool) -> list[int]:
        return policy.plan(costs, decoding, longest, waiting, 1 if decoding else 0, full=full and gathers)

    return rule


def whole(costs: Costs, decoding: int, longest: int, waiting: Sequence[Prompt], full: bool) -> list[int]:
    return [p.remaining for p in waiting]


def budget(tokens: int) -> Rule:
    def rule(costs: Costs, decoding: int, longest: int, waiting: Sequence[Prompt], full: bool) -> list[int]:
        left, takes = tokens, []
        for p in waiting:
            takes.append(min(p.remaining, left))
            left -= takes[-1]
        return takes

    return rule


@dataclass
class _Client:
    arrives: float  # ms: when its request reaches the model side
    done: int = 0  # prompt tokens computed
    produced: int = 0  # output tokens (0: in prefill)
    first: float = 0.0  # when its first token came


@dataclass(frozen=True)
class Result:
    ttft_p50_ms: float
    itl_p50_ms: float  # each request's mean gap, p50 over requests
    output_tok_s: float
    steps: int


def simulate(
    rule: Rule,
    costs: Costs,
    clients: int,
    prompt: int,
    max_tokens: int,
    seconds: float,
    seed: int,
    together: bool,
    turnaround_ms: tuple[float, float] = (5.0, 40.0),
    warmup_s: float = 20.0,
) -> Result:
    """A closed loop of ``clients`` on one server of as many slots, stepped by ``rule`` for ``seconds``."""
    rng = random.Random(seed)
    people = [_Client(0.0 if together else rng.uniform(0, 3000)) for _ in range(clients)]
    now, steps = 0.0, 0
    ended: list[tuple[float, float, float]] = []  # (arrived, first token, last token) per request
    while now < seconds * 1e3:
        decoding = [c for c in people if c.produced]
        waiting = sorted((c for c in people if not c.produced and c.arrives <= now), key=lambda c: c.arrives)
        if not decoding and not waiting:
            now = min(c.arrives for c in people)
            continue
        full = len(decoding) + len(waiting) == clients
        longest = max((prompt + c.produced for c in decoding), default=0)
        prompts = [Prompt(c.done, prompt - c.done) for c in waiting]
        takes = rule(costs, len(decoding), longest, prompts, full)
        now += costs.step_ms(_shape(len(decoding), longest, 1, prompts, takes))
        steps += 1
        for c in decoding:
            c.produced += 1
            if c.produced == max_tokens:
                ended.append((c.arrives, c.first, now))
                c.arrives, c.done, c.produced = now + rng.uniform(*turnaround_ms), 0, 0
        for c, take in zip(waiting, takes, strict=True):
            c.done += take
            if c.done == prompt:
                c.produced, c.first = 1, now
    counted = [r for r in ended if r[0] >= warmup_s * 1e3]
    if not counted:
        raise ValueError(f"no request ended after the {warmup_s:g} s warm-up within {seconds:g} s")
    span_s = (now - warmup_s * 1e3) / 1e3
    return Result(
        statistics.median(first - arrived for arrived, first, _ in counted),
        statistics.median((last - first) / (max_tokens - 1) for _, first, last in counted),
        len(counted) * max_tokens / span_s,
        steps,
    )


def rules(options: PolicyOptions, budgets: Sequence[int]) -> dict[str, Rule]:
    out: dict[str, Rule] = {"edgepath": shipped(options), "without-9": shipped(options, False), "whole": whole}
    out.update({f"budget-{n}": budget(n) for n in budgets})
    return out


def table(args: argparse.Namespace) -> str:
    costs = Costs(args.overhead_ms, args.prompt_ms, args.decode_ms, args.context_ms, args.decode_context_ms)
    options = PolicyOptions(args.stall_ms, args.min_prefill, args.batch)
    lines = [
        f"closed loop: {args.clients} clients, {args.prompt}-token prompts, {args.max_tokens} tokens each, first "
        f"requests {args.start}; costs {costs}; seeds {args.seeds}",
        "",
        "| rule | TTFT p50 ms | ITL p50 ms (each request's mean gap) | output tok/s |",
        "|---|---|---|---|",
    ]
    for name, rule in rules(options, args.budgets).items():
        together = args.start == "together"
        runs = [
            simulate(rule, costs, args.clients, args.prompt, args.max_tokens, args.seconds, seed, together)
            for seed in range(1, args.seeds + 1)
        ]
        ttft = " / ".join(f"{r.ttft_p50_ms:,.0f}" for r in runs)
        itl = " / ".join(f"{r.itl_p50_ms:.1f}" for r in runs)
        lines.append(f"| {name} | {ttft} | {itl} | {' / '.join(f'{r.output_tok_s:.0f}' for r in runs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--prompt", type=int, default=140, help="prompt tokens computed per request (128 + template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--start", choices=("together", "spread"), default="together")
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    # a quiet 2-core AMD EPYC at 2 threads, flash attention on (docs/MODEL.md): the shapes, not a calibration
    p.add_argument("--overhead-ms", type=float, default=9.0)
    p.add_argument("--prompt-ms", type=float, default=1.6)
    p.add_argument("--decode-ms", type=float, default=2.2)
    p.add_argument("--context-ms", type=float, default=0.3)
    p.add_argument("--decode-context-ms", type=float, default=1.0)
    p.add_argument("--stall-ms", type=float, default=1500.0)
    p.add_argument("--min-prefill", type=int, default=16)
    p.add_argument("--batch", type=int, default=1224)
    args = p.parse_args(argv)
    if min(args.clients, args.prompt, args.seeds) < 1 or args.max_tokens < 2 or args.seconds <= 20:
        p.error("--clients, --prompt, --seeds >= 1, --max-tokens >= 2 and --seconds > 20 (the warm-up)")
    print(table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
