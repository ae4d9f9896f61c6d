"""The step plan, sans I/O: which prompt tokens ride in a model step, what a step costs, and when a new prompt
gets its first token -- one code for both sides of the data path.

The slot server's model handler plans every step with :class:`StepPolicy` and learns step costs with
:class:`~edgepath.model.cost.CostModel`; it publishes the costs, the policy's knobs and what it has to do
(:class:`Load`) in its pool's load region.  An agent predicts a request's time to first token by running **the
same policy** forward over what it read (:func:`first_token_ms`): there is no second copy of the arithmetic to
drift apart.

**The policy** (one ``llama_decode`` per step over every running slot; on a CPU a prompt token costs about what a
decoded one does, and every decoding stream waits for the whole step), its objectives in order:

1. *Decoding never stops*: every decoding slot has its one token in every step.
2. *A stall is bounded*: while any slot decodes, a step is planned to cost at most ``stall_ms``.
3. *Prompts are prefilled in as few steps as that bound allows*, oldest first -- after the prompts of requests
   within their tenant's slot floor (:func:`prefill_order`): concentrating a prompt keeps most steps pure decode
   steps and gives its first token as early as the bound allows.
4. *A whole prompt at once when nothing decodes* (up to ``batch`` tokens): nobody waits on that step; other
   prompts join it only within the stall bound (and objective 6).
5. *Admitted prompts always progress*: a waiting prompt gets at least ``min_prefill`` tokens in every step (but the
   one that gives a floor's prompt its first token, objective 7).
6. *A later prompt never delays an earlier one's first token by much*: in a step where a prompt gets its first
   token, the prompts behind it add at most ``JOIN_SHARE`` of what the step costs up to it (``min_prefill`` aside).
   That first token was predicted, and the request admitted, without the prompts that arrived after it; letting
   them fill the stall bound made an admitted request wait for a newcomer's whole prompt (issue 34's serving runs:
   a 238-token prompt predicted at 0.43 s took 1.49 s, sharing its step with a 950-token one that came 10 ms
   later).  A prompt token costs about the same in a step of its own, so little is lost but a micro-batch.
7. *A floor's first token waits for no one*: the step where a prompt within its tenant's slot floor gets its first
   token carries nothing else -- no prompt behind it, and the streams decoding decode in the step right after
   (:func:`decodes`).  A floor is capacity a tenant can count on (docs/TENANTS.md).  The decoding streams lose
   nothing by it: each micro-batch of a step is computed in turn anyway, and their token comes when the step that
   carried both would have ended; the floor's comes a decode step earlier (40-50 ms on this project's 2-core
   machine with seven streams decoding).
8. *A floor lent out is quick to take back*: while a tenant with a slot floor holds fewer of the server's slots than
   its floor (:func:`floor_lent`), the prompts of requests outside every floor add at most ``lent_ms`` to a step
   (``min_prefill`` aside, a chunk's micro-batch included).  The floor's owner waits out the step under way when it
   comes -- a CPU step cannot be cut --, and a borrower's prompt made that step long: on this project's 2-core
   machine a 128-token prompt beside seven decoding streams took 300-330 ms, the decoding alone 40-50 ms.  A prompt
   cut into more chunks costs a micro-batch's fixed part per chunk (~9 ms there).
9. *A full house that can start every waiting prompt at once does*: while every slot of the server is taken
   (:attr:`Load.full`), if every waiting prompt fits the step whole within objectives 2, 7 and 8, objective 6's
   join share does not hold and they all get their first token in it.  No request can arrive there until a
   stream ends, and streams that start in one step end in one step: prompts started together leave the steps
   between them pure decode steps, where the join share spread their starts over several steps and put a prompt
   beside nearly every decode step (guidellm's closed loop, replayed on the cost model by
   :mod:`edgepath.bench.policy_sim`: each request's mean inter-token gap p50 50 -> 32 ms, llama-server's batching
   28; first token p50 0.5 -> 1.66 s, llama-server's 1.88; tokens per second the same).  When they do not all fit,
   gathering would only delay the first one's token without clearing the queue (retrying clients at 2x capacity
   lost 13 % of their first tokens within 5 s that way in the same replay; with the condition, none), so
   objective 6 holds.

**The cost of a step** (:class:`Costs`): ``overhead x micro-batches + prompt_ms x prompt tokens + decode_ms x
decoded tokens + context_ms x attended / 1000 + decode_context_ms x context / 1000``, where ``attended`` sums,
over the step's prompt tokens, the positions each one attends (its position + 1), and ``context`` the positions
the decoded tokens attend -- each as many as the longest decoding sequence holds, since llama.cpp pads every
stream of a micro-batch to the longest: attention grows with the context, the rest does not.  llama.cpp,
with one KV stream per sequence, computes a step in micro-batches -- one per run of consecutive sequence ids
among the decoding streams, and one more per prompt chunk beside them -- and each reads the weights once: a
step of seven decoding streams and 8 prompt tokens costs two micro-batches, twice the fixed part of a step of
either alone.  Measured at warm-up on the machine it runs on, then followed robustly by the model side
(:class:`~edgepath.model.cost.CostModel`): one pathological step -- a neighbour's burst, a stolen CPU -- moves it
little, and it returns to the calibration when steps run as measured again.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Costs:
    """Milliseconds a step costs: per micro-batch, per prompt token, per decoded token, per 1,000 positions
    attended by prompt tokens, per 1,000 positions attended by decoded tokens."""

    overhead_ms: float = 0.0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    context_ms: float = 0.0
    decode_context_ms: float = 0.0

    def __post_init__(self) -> None:
        values = (self.overhead_ms, self.prompt_ms, self.decode_ms, self.context_ms, self.decode_context_ms)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"step costs must be finite and >= 0 ms, got {values}")

    @property
    def known(self) -> bool:
        """Whether these are a cost model at all (a handler without one, such as echo, publishes zeros)."""
        return self.prompt_ms > 0 or self.decode_ms > 0

    def step_ms(self, step: Step) -> float:
        return (
            self.overhead_ms * step.ubatches
            + self.prompt_ms * step.prompt
            + self.decode_ms * step.decode
            + self.context_ms * step.attended / 1e3
            + self.decode_context_ms * step.context / 1e3
        )

    def scaled(self, factor: float) -> Costs:
        return Costs(*(value * factor for value in self.values()))

    def values(self) -> tuple[float, float, float, float, float]:
        return self.overhead_ms, self.prompt_ms, self.decode_ms, self.context_ms, self.decode_context_ms

    def published(self) -> Costs:
        """These costs as the load region carries them (float32): the planner uses exactly what agents read."""
        return Costs(*(_f32(value) for value in self.values()))


def _f32(value: float) -> float:
    return float(np.float32(value))


@dataclass(frozen=True, slots=True)
class Step:
    """The shape of one step: prompt tokens, decoded tokens (one per decoding stream), positions the prompt tokens
    attend, positions the decoded tokens attend, the micro-batches llama.cpp computes it in."""

    prompt: int = 0
    decode: int = 0
    attended: int = 0
    context: int = 0
    ubatches: int = 1

    @property
    def tokens(self) -> int:
        return self.prompt + self.decode


def chunk_attended(done: int, length: int) -> int:
    """Positions attended by ``length`` prompt tokens at positions ``done``.. (each attends itself and all
    before it)."""
    return length * done + length * (length + 1) // 2


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt in prefill: positions its sequence already holds (computed or reused), tokens still to compute."""

    done: int
    remaining: int


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """The policy's knobs (the llama handler's ``--handler-option`` values of the same names)."""

    stall_ms: float  # while slots decode, a step is planned within this many milliseconds
    min_prefill: int  # prompt tokens a step carries at least while a prompt waits
    batch: int  # tokens at most in one step (llama.cpp's n_batch)

    def __post_init__(self) -> None:
        if not self.stall_ms > 0 or not math.isfinite(self.stall_ms):
            raise ValueError(f"stall_ms must be > 0 milliseconds, got {self.stall_ms}")
        if self.min_prefill < 1:
            raise ValueError(f"min_prefill must be >= 1 token, got {self.min_prefill}")
        if self.batch < 2:
            raise ValueError(f"batch must be >= 2 tokens, got {self.batch}")


#: in a step where a prompt gets its first token, the prompts behind it may add at most this share of the step's cost
JOIN_SHARE = 0.25


class StepPolicy:
    """Plans each step's prompt tokens (see the module's objectives)."""

    def __init__(self, options: PolicyOptions) -> None:
        self.options = options

    def plan(
        self,
        costs: Costs,
        decoding: int,
        longest: int,
        waiting: Sequence[Prompt],
        runs: int = 1,
        floors: int = 0,
        lent_ms: float = 0.0,
        full: bool = False,
    ) -> list[int]:
        """Prompt tokens to compute this step from each waiting prompt, oldest first.

        ``decoding``: slots that decode one token each this step, the longest holding ``longest`` positions, in
        ``runs`` micro-batches; ``waiting``: the prompts in prefill, in the order they are served, the first
        ``floors`` of them within their tenant's slot floor; ``lent_ms``: while a floor is lent, what the others
        may add to the step (0: none is).  One count per waiting prompt, in order (0: it waits for a later step);
        the step holds ``decoding + sum(...)`` tokens, never more than ``batch``.  Each prompt chunk is charged a
        micro-batch of its own.  ``full``: every slot of the server is taken (objective 9)."""
        options = self.options
        if not lent_ms >= 0 or not math.isfinite(lent_ms):
            raise ValueError(f"plan: lent_ms must be finite and >= 0 ms, got {lent_ms}")
        if decoding < 0 or longest < 0 or runs < 0 or any(p.remaining < 1 or p.done < 0 for p in waiting):
            raise ValueError(
                f"plan: need decoding >= 0, longest >= 0, runs >= 0 and every waiting prompt >= 1 token, got "
                f"{decoding}, {longest}, {runs}, {[p.remaining for p in waiting]}"
            )
        room = options.batch - decoding
        if room < 1:
            raise ValueError(f"plan: {decoding} decoding slots leave no room in a batch of {options.batch}")
        if not waiting:
            return []
        if full:  # objective 9: every prompt whole in this step, if the bound allows, else as below
            gathered = self._fill(costs, decoding, longest, waiting, runs, floors, lent_ms, room, math.inf)
            if all(take == prompt.remaining for take, prompt in zip(gathered, waiting, strict=True)):
                return gathered
        return self._fill(costs, decoding, longest, waiting, runs, floors, lent_ms, room, JOIN_SHARE)

    def _fill(
        self,
        costs: Costs,
        decoding: int,
        longest: int,
        waiting: Sequence[Prompt],
        runs: int,
        floors: int,
        lent_ms: float,
        room: int,
        share: float,
    ) -> list[int]:
        """The plan of objectives 1-8, ``room`` tokens left in the batch, ``share`` the join share (objective 6;
        infinite: none, objective 9)."""
        options = self.options
        # The bound: what the step may cost beyond its decoding streams, spent oldest prompt first at each one's
        # own positions.  The floor: what it carries whatever the bound -- while streams decode, min_prefill in
        # all (admitted prompts always progress); while nobody decodes, the oldest prompt whole.
        # While a floor is lent, the others' prompts spend at most lent_ms of it (objective 8), a borrower's alone
        # no longer a whole prompt when nothing decodes.
        spent_ms = costs.step_ms(_decoding_step(decoding, longest, runs))
        room_ms = options.stall_ms - spent_ms
        lent_room = lent_ms if lent_ms else math.inf
        whole = not decoding and (floors > 0 or not lent_ms)
        floor = waiting[0].remaining if whole else options.min_prefill
        plan = []
        for index, prompt in enumerate(waiting):
            bound = room_ms if index < floors else min(room_ms, lent_room)
            within = _tokens_within(costs, bound - costs.overhead_ms, prompt.done)
            take = min(prompt.remaining, room, max(floor, within))
            plan.append(take)
            room -= take
            floor = max(0, floor - take)
            if take:
                added = costs.overhead_ms + _prompt_ms(costs, prompt.done, take)
                spent_ms += added
                room_ms -= added
                if index >= floors:
                    lent_room -= added
                if take == prompt.remaining and index < floors:  # a floor's first token: nothing else in its step
                    room_ms, floor = 0.0, 0
                elif take == prompt.remaining:  # its first token: those behind may delay it only a little
                    room_ms = min(room_ms, share * spent_ms)
        return plan


def decodes(waiting: Sequence[Prompt], takes: Sequence[int], floors: int) -> bool:
    """Whether the streams decoding decode in the step of ``takes``: not when it gives a prompt within its tenant's
    slot floor (the first ``floors`` of ``waiting``) its first token (objective 7)."""
    return not any(take and take == p.remaining for p, take in zip(waiting[:floors], takes[:floors], strict=True))


def within_floor(tenant: int, floor: int, rank: int) -> bool:
    """The per-server rule, for one request: whether a tenant's ``rank``-th request running on one slot server (1: its
    oldest there) is *within* its slot ``floor`` -- what the step policy serves first (:func:`prefill_order`).  A
    tenant without a floor id (0) has no floor."""
    return tenant != 0 and rank <= floor


def under_floor(tenant: int, floor: int, holdings: Mapping[int, int]) -> bool:
    """The per-tenant rule: whether ``tenant`` holds fewer slots than its ``floor``, ``holdings`` counting its slots
    (across every pool an agent reads, when an agent asks whether it may take a slot back -- dpu/floor_book.py --;
    its running requests on one server, when the server asks whether a floor is lent out: :func:`floor_lent`).  A
    tenant without a floor id (0) is never under a floor."""
    return tenant != 0 and holdings.get(tenant, 0) < floor


def prefill_order(tenants: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """The order prompts are served in: ``tenants`` holds each running request's tenant (its floor id, 0 for none)
    and that tenant's slot floor, in arrival order; the answer is their indexes, the requests within their tenant's
    floor first (:func:`within_floor`) then the rest, each group oldest first, and how many are within a floor (the
    first group's length).  A floor is a slot a tenant can always have (docs/TENANTS.md); served first, it is also a
    first token that does not wait behind the prompts of the tenants it was lent to.  A server's published waiting
    prompts are in this order, so the agent's prediction runs the same policy."""
    held: Counter[int] = Counter()
    first: list[int] = []
    rest: list[int] = []
    for index, (tenant, floor) in enumerate(tenants):
        held[tenant] += 1
        (first if within_floor(tenant, floor, held[tenant]) else rest).append(index)
    return first + rest, len(first)


def floor_lent(running: Sequence[tuple[int, int]], floors: Mapping[int, int]) -> bool:
    """Whether a slot floor is lent out on a server (objective 8): ``running`` holds each running request's tenant
    (its floor id) and that tenant's floor, ``floors`` the floor of every tenant with one that the server knows
    of; lent when one of those is under its floor by its running requests here (:func:`under_floor`) while a
    request outside every floor runs (that one holds a slot the owner can take back)."""
    held = Counter(tenant for tenant, _ in running)
    _, within = prefill_order(running)
    return within < len(running) and any(under_floor(tenant, floor, held) for tenant, floor in floors.items())


#: a slot floor learned from the requests that name it is forgotten once none has named it for this long (a tenant
#: gone from the tenants file, or silent): the slot server's handler and the agents forget alike (:class:`FloorMemory`)
FLOOR_MEMORY_S = 3600.0


class FloorMemory(Generic[T]):
    """What requests said of their tenants' slot limits (a floor; an agent also keeps the cap), by floor id, each
    forgotten :data:`FLOOR_MEMORY_S` after a request last said it.  Forgetting runs when something is learned --
    nothing can be lent or taken by a floor unless a request that names one arrives -- at most once a minute, so
    learning costs a dict store per request."""

    SWEEP_S = 60.0  # how often learning also forgets: a floor is forgotten within a minute of its hour

    def __init__(self, memory_s: float = FLOOR_MEMORY_S) -> None:
        self.memory_s = memory_s
        self._seen: dict[int, tuple[T, float]] = {}  # floor id -> (what was said, when last)
        self._swept = -math.inf

    def learn(self, tenant: int, value: T, now: float) -> None:
        """A request of ``tenant`` said ``value`` at ``now`` (monotonic seconds)."""
        if now - self._swept >= min(self.SWEEP_S, self.memory_s):
            self._swept = now
            self._seen = {t: (v, seen) for t, (v, seen) in self._seen.items() if now - seen < self.memory_s}
        self._seen[tenant] = (value, now)

    def table(self) -> dict[int, T]:
        """What is remembered, by floor id."""
        return {tenant: value for tenant, (value, _) in self._seen.items()}

    def __bool__(self) -> bool:
        return bool(self._seen)


def _decoding_step(decoding: int, longest: int, runs: int) -> Step:
    """The part of a step the decoding streams make (no micro-batch when none decode): each token attends as many
    positions as the longest stream holds after it."""
    return Step(0, decoding, 0, decoding * (longest + 1), min(max(1, runs), decoding))


def _prompt_ms(costs: Costs, done: int, tokens: int) -> float:
    """What ``tokens`` prompt tokens at positions ``done``.. add to a step."""
    return costs.prompt_ms * tokens + costs.context_ms * chunk_attended(done, tokens) / 1e3


def _tokens_within(costs: Costs, room_ms: float, done: int) -> int:
    """The most prompt tokens at positions ``done``.. that add at most ``room_ms`` to a step (0: none fit)."""
    if room_ms <= 0:
        return 0
    a = costs.context_ms / 2e3  # a * n^2 + b * n <= room
    b = costs.prompt_ms + costs.context_ms * (done + 0.5) / 1e3
    if a <= 0:
        n = math.floor(room_ms / b) if b > 0 else 1 << 30
    else:
        n = math.floor((-b + math.sqrt(b * b + 4 * a * room_ms)) / (2 * a))
    while n > 0 and _prompt_ms(costs, done, n) > room_ms:  # the root's rounding, never one token past the bound
        n -= 1
    return n


@dataclass(frozen=True, slots=True)
class Load:
    """What a slot server's model side publishes for admission: its costs and knobs, and what it has to do
    before a new prompt's first token (the streams decoding and the prompts in prefill, oldest first).
    ``costs`` all zero: the server publishes no load (a handler without a cost model, such as echo)."""

    costs: Costs = Costs()
    options: PolicyOptions | None = None
    decoding: int = 0
    longest: int = 0  # positions the longest decoding stream holds
    waiting: tuple[Prompt, ...] = ()
    runs: int = 0  # micro-batches the decoding streams take (runs of consecutive sequence ids)
    floors: int = 0  # the first ``floors`` of ``waiting`` are within their tenant's slot floor (objective 7)
    lent_ms: float = 0.0  # while a floor is lent out, what the other prompts may add to a step (objective 8)
    #: the server's slots (0: not known; never published -- an agent knows them from the pool header)
    slots: int = 0

    @property
    def published(self) -> bool:
        return self.options is not None and self.costs.known

    @property
    def pending_tokens(self) -> int:
        return sum(p.remaining for p in self.waiting)

    @property
    def idle(self) -> bool:
        return not self.decoding and not self.waiting

    @property
    def full(self) -> bool:
        """Every slot taken (objective 9): each running request decodes or waits in prefill."""
        return _full(self.slots, self.decoding, self.waiting)

    def planned_step(self, takes: Sequence[int]) -> Step:
        """The step the policy's ``takes`` (one per waiting prompt) make of this load."""
        decoding = self.decoding if decodes(self.waiting, takes, self.floors) else 0
        return _shape(decoding, self.longest, self.runs, self.waiting, takes)

    def decode_step_ms(self) -> float:
        """What a step of the streams decoding now costs, with no prompt beside them."""
        return self.costs.step_ms(_decoding_step(self.decoding, self.longest, self.runs))


#: steps one prediction follows at most (a prompt behind more is over any bound a person would set)
MAX_STEPS = 4096


@dataclass(frozen=True, slots=True)
class Prediction:
    """A request's predicted time to first token on one server, and the wait in it (milliseconds)."""

    ttft_ms: float
    wait_ms: float


def own_ms(load: Load, prompt: Prompt) -> float:
    """What ``prompt`` costs on the same server when idle: the part of its time to first token that is not
    waiting (the bound is on waiting, not on work)."""
    if not load.published:
        return 0.0
    return _run(load.costs, StepPolicy(load.options), 0, 0, 0, [prompt], 0.0)  # type: ignore[arg-type]


def predict(load: Load, prompt: Prompt, ahead: Sequence[Prompt] = (), under_way_ms: float | None = None) -> Prediction:
    """The time to first token of ``prompt`` arriving now at a server under ``load``, and its wait, by running
    the server's own policy forward.  ``ahead``: the requests claimed there and not yet taken by its model side,
    in the order it will take them (ahead of this one).  The step under way -- the first the policy plans from
    ``load`` -- counts for what is left of it after ``under_way_ms`` (how long it has run: the server's heartbeat
    and load version say, ABI 11), or half of it when that is not known (a request arrives, on average, half-way
    through a step); the request joins from the next step.  Streams ahead are taken to go on decoding (their
    lengths are unknown).  Half a step was the largest error per request: a 160-token prompt behind a 1.7 s step
    was predicted at 1.1 s and waited 1.9 s (docs/ADMISSION.md, "The step under way")."""
    if not load.published:
        return Prediction(0.0, 0.0)
    own = own_ms(load, prompt)
    if load.idle and not ahead:
        return Prediction(own, 0.0)
    policy = StepPolicy(load.options)  # type: ignore[arg-type]
    costs = load.costs
    decoding, longest, runs, waiting = load.decoding, load.longest, load.runs, list(load.waiting)
    floors = min(load.floors, len(waiting))
    elapsed = 0.0
    if decoding >= policy.options.batch:
        return Prediction(math.inf, math.inf)
    if decoding or waiting:  # the step under way: what is left of it, then the state after it
        takes = policy.plan(costs, decoding, longest, waiting, runs, floors, load.lent_ms, load.full)
        decoded = decodes(waiting, takes, floors)
        step = costs.step_ms(_shape(decoding if decoded else 0, longest, runs, waiting, takes))
        elapsed = 0.5 * step if under_way_ms is None else max(0.0, step - under_way_ms)
        decoding, longest, runs, waiting, floors = _advance(decoding, longest, runs, waiting, takes, floors, decoded)
    waiting += ahead
    waiting.append(prompt)
    ttft = _run(
        costs, policy, decoding, longest, runs, waiting, elapsed, floors=floors, lent_ms=load.lent_ms, slots=load.slots
    )
    return Prediction(ttft, max(0.0, ttft - own))


def _full(slots: int, decoding: int, waiting: Sequence[Prompt]) -> bool:
    """Whether ``decoding`` streams and ``waiting`` prompts take every one of ``slots`` (0: not known, never).
    An agent reads at most ``LOAD_PROMPTS`` prompts one by one (the rest summed): on a pool of more slots than
    that, with more prompts waiting, it does not see the house full that is."""
    return 0 < slots <= decoding + len(waiting)


def _shape(decoding: int, longest: int, runs: int, waiting: Sequence[Prompt], takes: Sequence[int]) -> Step:
    """The step the policy planned: the decoding streams' micro-batches, one more per prompt chunk."""
    step = _decoding_step(decoding, longest, runs)
    prompt = attended = chunks = 0
    for p, take in zip(waiting, takes, strict=True):
        if take:
            prompt += take
            attended += chunk_attended(p.done, take)
            chunks += 1
    return replace(step, prompt=prompt, attended=attended, ubatches=max(1, step.ubatches + chunks))


def _advance(
    decoding: int,
    longest: int,
    runs: int,
    waiting: Sequence[Prompt],
    takes: Sequence[int],
    floors: int = 0,
    decoded: bool = True,
) -> tuple[int, int, int, list[Prompt], int]:
    """The state after one step: decoding streams hold one more position each (``decoded``: they decoded in it);
    finished prompts decode (in the runs there are: the handler places a new sequence where it makes no new run if
    it can); the floors' prompts still waiting."""
    longest += 1 if decoding and decoded else 0
    left = []
    for index, (p, take) in enumerate(zip(waiting, takes, strict=True)):
        if take == p.remaining:
            decoding += 1
            longest = max(longest, p.done + take)
            floors -= index < floors
        else:
            left.append(Prompt(p.done + take, p.remaining - take))
    return decoding, longest, max(1, runs) if decoding else 0, left, floors


def _run(
    costs: Costs,
    policy: StepPolicy,
    decoding: int,
    longest: int,
    runs: int,
    waiting: list[Prompt],
    elapsed: float,
    ends: Sequence[int] = (),
    floors: int = 0,
    lent_ms: float = 0.0,
    slots: int = 0,
) -> float:
    """Milliseconds (from ``elapsed``) until the last of ``waiting`` has its prompt computed.  ``ends``: for as many
    of the streams decoding now, the tokens after which each ends (the others, and those that start decoding on
    the way, go on); ``floors``: the first of ``waiting`` within their tenant's slot floor; ``lent_ms``: the
    others' share of a step while a floor is lent, taken to stay lent; ``slots``: the server's (objective 9)."""
    last = len(waiting) - 1
    left = [e for e in ends if e > 0][:decoding]
    for _ in range(MAX_STEPS):
        if decoding >= policy.options.batch:
            return math.inf
        takes = policy.plan(costs, decoding, longest, waiting, runs, floors, lent_ms, _full(slots, decoding, waiting))
        decoded = decodes(waiting, takes, floors)
        elapsed += costs.step_ms(_shape(decoding if decoded else 0, longest, runs, waiting, takes))
        if takes[last] == waiting[last].remaining:
            return elapsed
        ended = sum(e == 1 for e in left) if decoded else 0
        left = [e - 1 for e in left if e > 1] if decoded else left
        decoding, longest, runs, waiting, floors = _advance(
            decoding - ended, longest, runs, waiting, takes, floors, decoded
        )
        runs = min(runs, decoding)
        last = len(waiting) - 1
    return math.inf
