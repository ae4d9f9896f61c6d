"""Step policies at saturation, replayed on a step cost model: where a closed loop's time goes under each rule.

Issue 52 asked for a rule for how many prompt tokens a decode step may carry at saturation (guidellm's closed loop of
8 streams, 128-token prompts, 64 tokens each).  What a rule can change there is arithmetic before it is
measurement: this replays a closed loop step by step on :class:`~edgepath.contract.plan.Costs` (the handler's own
cost model: per micro-batch, per prompt token, per decoded token, attention), with the candidate rules side by side:

* ``edgepath`` -- the shipped :class:`~edgepath.contract.plan.StepPolicy` (a prompt within the stall bound in as
  few steps as it allows, later prompts held to the join share -- but at a full house that can start every waiting
  prompt at once: objective 9);
* ``without-9`` -- the same without objective 9 (the policy before issue 52);
* ``gather-always`` -- objective 9 without its condition: at a full house no join share, whatever fits;
* ``whole`` -- llama-server's default batching: every waiting prompt whole in the next step;
* ``budget-N`` -- Sarathi-style chunked prefill: every step carries the decoding rows and at most N prompt tokens.

The closed loop: each client sends its next request 5-40 ms (drawn) after its last one ended; every answer is
``--max-tokens`` long.  Per rule: TTFT p50, each request's mean inter-token gap p50 (guidellm's ITL) and output
tokens/s, after a warm-up, over ``--seeds`` seeds; ``--start together`` sends the first requests at once (as
guidellm does), ``spread`` over the first seconds.  Then retrying clients (:func:`retrying`) at ``--retry-loads``
times the capacity: what a rule costs where prompts arrive one by one.  Admission here is a free slot (the
agents' wait bound and the server's retry advice are left out), the same for every rule.  Figures are the cost
model's, not a server's: they show the shapes a rule makes (who waits for whose prompt), which is what the
profile of a real run (:mod:`edgepath.bench.step_profile`) is then read against.

    python -m edgepath.bench.policy_sim [--prompt 140 --max-tokens 64 --clients 8 --start together]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edgepath.bench.model_compare import FIRST_TOKEN_SOON_S
from edgepath.contract.plan import Costs, PolicyOptions, Prompt, StepPolicy, _shape
from edgepath.edge.retry import retry_delay

#: a rule: (costs, decoding streams, longest decoding position, waiting prompts, every slot taken) -> takes
Rule = Callable[[Costs, int, int, Sequence[Prompt], bool], list[int]]


def shipped(options: PolicyOptions, gathers: bool = True) -> Rule:
    """The shipped policy; ``gathers=False``: without objective 9 (the policy before issue 52)."""
    policy = StepPolicy(options)

    def rule(costs: Costs, decoding: int, longest: int, waiting: Sequence[Prompt], full: bool) -> list[int]:
        return policy.plan(costs, decoding, longest, waiting, 1 if decoding else 0, full=full and gathers)

    return rule


def gather_always(options: PolicyOptions) -> Rule:
    """Objective 9 without its condition: at a full house the prompts behind a first token fill the stall bound,
    whether or not they all start in that step."""
    policy = StepPolicy(options)

    def rule(costs: Costs, decoding: int, longest: int, waiting: Sequence[Prompt], full: bool) -> list[int]:
        runs, room = 1 if decoding else 0, options.batch - decoding
        if not full:
            return policy.plan(costs, decoding, longest, waiting, runs)
        return policy._fill(costs, decoding, longest, waiting, runs, 0, 0.0, room, math.inf)

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


@dataclass
class _Call:
    called: float  # ms: its first call
    prompt: int
    done: int = 0
    produced: int = 0
    first: float | None = None  # when its first token came
    ended: bool = False


@dataclass(frozen=True)
class Goodput:
    calls: int
    completed: int
    soon_per_s: float  # calls whose first token came within FIRST_TOKEN_SOON_S of their first call, a second


def retrying(
    rule: Rule,
    costs: Costs,
    slots: int,
    rate: float,
    prompts: tuple[int, int],
    max_tokens: int,
    seconds: float,
    seed: int,
    retries: int = 8,
) -> Goodput:
    """Poisson calls at ``rate`` a second for ``seconds``, each a prompt drawn log-uniformly from ``prompts``, on
    ``slots`` slots; a call that finds every slot taken is tried again as the openai SDK does without a server's
    advice (:func:`~edgepath.edge.retry.retry_delay`), up to ``retries`` times.  What the model side's rule
    changes is when each admitted call gets its first token, and so when its slot frees."""
    rng = random.Random(seed)
    calls: list[_Call] = []
    due: list[tuple[float, int, int]] = []  # (ms, call, attempts so far)
    at = 0.0
    low, high = math.log(prompts[0]), math.log(prompts[1])
    while True:
        at += rng.expovariate(rate) * 1e3
        if at >= seconds * 1e3:
            break
        calls.append(_Call(at, int(math.exp(rng.uniform(low, high)))))
        heapq.heappush(due, (at, len(calls) - 1, 0))
    running: list[_Call] = []
    now = 0.0
    while due or running:
        while due and due[0][0] <= now:
            when, index, attempts = heapq.heappop(due)
            if len(running) < slots:
                running.append(calls[index])
            elif attempts < retries:
                delay, _ = retry_delay(None, attempts, rng)
                heapq.heappush(due, (when + delay * 1e3, index, attempts + 1))
        if not running:
            now = due[0][0]
            continue
        decoding = [c for c in running if c.produced]
        waiting = [c for c in running if not c.produced]
        longest = max((c.prompt + c.produced for c in decoding), default=0)
        pending = [Prompt(c.done, c.prompt - c.done) for c in waiting]
        takes = rule(costs, len(decoding), longest, pending, len(running) >= slots) if pending else []
        now += costs.step_ms(_shape(len(decoding), longest, 1, pending, takes))
        for c in decoding:
            c.produced += 1
            if c.produced == max_tokens:
                c.ended = True
                running.remove(c)
        for c, take in zip(waiting, takes, strict=True):
            c.done += take
            if c.done == c.prompt:
                c.produced, c.first = 1, now
    soon = sum(c.first is not None and c.first - c.called <= FIRST_TOKEN_SOON_S * 1e3 for c in calls)
    return Goodput(len(calls), sum(c.ended for c in calls), soon / seconds)


def rules(options: PolicyOptions, budgets: Sequence[int]) -> dict[str, Rule]:
    out: dict[str, Rule] = {"edgepath": shipped(options), "without-9": shipped(options, False)}
    out["gather-always"] = gather_always(options)
    out["whole"] = whole
    out.update({f"budget-{n}": budget(n) for n in budgets})
    return out


def retry_table(args: argparse.Namespace, costs: Costs, options: PolicyOptions) -> list[str]:
    """Retrying clients at each of ``--retry-loads`` times the capacity: the requests a second the shipped rule
    completes at a full house of the same prompts (a closed loop of ``--clients``, each prompt the mean)."""
    low, high = args.retry_prompts
    mean = round((high - low) / math.log(high / low))
    full = simulate(shipped(options), costs, args.clients, mean, args.max_tokens, args.seconds, 1, True)
    capacity = full.output_tok_s / args.max_tokens
    soon = f"first tokens within {FIRST_TOKEN_SOON_S:g} s a second"
    head = " | ".join(f"{f:g}x: completed / {soon}" for f in args.retry_loads)
    lines = [
        "",
        f"retrying clients: Poisson calls of {low}-{high}-token prompts (log-uniform), {args.max_tokens} tokens each, "
        f"{args.clients} slots, {args.retry_seconds:g} s; capacity {capacity:.2f} requests/s; seeds {args.seeds}",
        "",
        f"| rule | {head} |",
        "|---|" + "---|" * len(args.retry_loads),
    ]
    for name, rule in rules(options, args.budgets).items():
        cells = []
        for fraction in args.retry_loads:
            runs = [
                retrying(rule, costs, args.clients, fraction * capacity, (low, high), args.max_tokens,
                         args.retry_seconds, seed)
                for seed in range(1, args.seeds + 1)
            ]  # fmt: skip
            done = " / ".join(f"{r.completed}/{r.calls}" for r in runs)
            cells.append(f"{done}; {' / '.join(f'{r.soon_per_s:.2f}' for r in runs)}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


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
    if args.retry_loads:
        lines += retry_table(args, costs, options)
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
    numbers = lambda kind: lambda s: [kind(x) for x in s.split(",") if x.strip()]  # noqa: E731
    p.add_argument("--retry-loads", type=numbers(float), default=[1.2, 2.0], help="retrying phases, x capacity")
    p.add_argument("--retry-prompts", type=numbers(int), default=[140, 1036], help="LOW,HIGH prompt tokens")
    p.add_argument("--retry-seconds", type=float, default=300.0)
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
    low_high = args.retry_prompts
    if len(low_high) != 2 or not 1 <= low_high[0] < low_high[1] or not all(f > 0 for f in args.retry_loads):
        p.error(f"--retry-prompts LOW,HIGH (1 <= LOW < HIGH) and --retry-loads > 0, got {low_high}, {args.retry_loads}")
    if args.retry_seconds <= 0:
        p.error(f"--retry-seconds must be > 0, got {args.retry_seconds}")
    print(table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
