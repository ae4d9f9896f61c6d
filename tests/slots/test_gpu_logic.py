"""The GPU poller's logic, checked on the CPU: the CUDA kernel runs ``ep_step`` (edgepath_step.h) and
``ep_poll_decide`` (edgepath_poll.h) from the same source the host compiles, so these tests exercise the
code the GPU runs, against small reference models written here."""

from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path

import pytest

from edgepath.contract.wire import TransitionRefused, step
from edgepath.native.abi import Event, State, StepError, ffi, lib

NATIVE = Path(__file__).resolve().parents[2] / "native"
M32 = 0xFFFFFFFF
M24 = 0xFFFFFF  # the state word's generation (ABI 10)
CLAIMANT_MAX = lib.EP_CLAIMANT_MAX
VALID = lib.EP_DOORBELL_VALID

# -- ep_step --------------------------------------------------------------------------------------


def word(gen: int, state: int, claimant: int, tenant: int = 0) -> int:
    return (tenant << 56) | ((gen & M24) << 32) | ((claimant & CLAIMANT_MAX) << 8) | (state & 0xFF)


def reference_step(cur: int, event: int, generation: int, holder: int) -> tuple[int, int | None]:
    """The slot state machine as the design states it: (rc, next word or None); ``holder`` is tenant << 24 |
    claimant, named by CLAIM and HANDOVER, and the tenant stays with the word until it is FREE."""
    st, gen, who, tenant = cur & 0xFF, (cur >> 32) & M24, (cur >> 8) & CLAIMANT_MAX, cur >> 56
    claimant, new_tenant = holder & CLAIMANT_MAX, holder >> 24
    if event == Event.CLAIM:
        if st != State.FREE:
            return StepError.STATE, None
        if claimant == 0:
            return StepError.EVENT, None
        return 0, word(gen + 1, State.CLAIMED, claimant, new_tenant)
    if event not in (Event.DOORBELL, Event.START, Event.COMPLETE, Event.RELEASE, Event.EXPIRE, Event.HANDOVER):
        return StepError.EVENT, None
    if event == Event.HANDOVER and claimant == 0:
        return StepError.EVENT, None
    if generation & M32 != gen:
        return StepError.STALE, None
    table = {
        Event.DOORBELL: (State.CLAIMED, State.READY, who, tenant),
        Event.START: (State.READY, State.RUNNING, who, tenant),
        Event.COMPLETE: (State.RUNNING, State.DONE, who, tenant),
        Event.RELEASE: (State.DONE, State.FREE, 0, 0),
        Event.EXPIRE: (State.CLAIMED, State.FREE, 0, 0),
        Event.HANDOVER: (State.DONE, State.CLAIMED, claimant, new_tenant),
    }
    need, to, keep, keep_tenant = table[Event(event)]
    if st != need:
        return StepError.STATE, None
    return 0, word(gen + 1 if event == Event.HANDOVER else gen, to, keep, keep_tenant)


STATES = [*State, 5, 0xFF]
EVENTS = [0, *Event, 8, -1]
GENERATIONS = [0, 1, 0x7FFFFF, M24]
CLAIMANTS = [0, 1, 77, CLAIMANT_MAX, CLAIMANT_MAX + 1, (9 << 24) | 3]


def _raw_step(cur: int, event: int, generation: int, claimant: int) -> tuple[int, int | None]:
    """ep_step straight through cffi, for codes ``step`` cannot name (events and states outside the enums)."""
    out = ffi.new("uint64_t *", 0xDEADBEEF)
    rc = lib.ep_step_word(cur, event, generation, claimant, out)
    if rc != 0:
        assert out[0] == 0xDEADBEEF, "a refused step must leave *next untouched"
        return rc, None
    return rc, int(out[0])


def test_ep_step_equals_reference_exhaustively() -> None:
    """Every state x event x (generation match / mismatch / wrap) x claimant, through the shared C step:
    ``edgepath.contract.wire.step`` for the defined states and events, the raw entry point for the rest."""
    checked = 0
    for st, ev, gen, who, claimant in itertools.product(STATES, EVENTS, GENERATIONS, [0, 5], CLAIMANTS):
        cur = word(gen, st, who, 2 if who else 0)
        for event_gen in (gen, (gen + 1) & M24, (gen - 1) & M24):
            rc, expect = reference_step(cur, ev, event_gen, claimant)
            assert _raw_step(cur, ev, event_gen, claimant) == (rc, expect), (hex(cur), ev, event_gen, claimant)
            if st in State.__members__.values() and ev in Event.__members__.values():
                try:
                    got = step(cur, Event(ev), event_gen, claimant)
                except TransitionRefused as exc:
                    assert rc != 0 and exc.reason == rc and exc.word == cur, (hex(cur), ev, event_gen, claimant)
                else:
                    assert rc == 0 and got == expect, (hex(cur), ev, event_gen, claimant, hex(got))
            checked += 1
    assert checked == len(STATES) * len(EVENTS) * len(GENERATIONS) * 2 * len(CLAIMANTS) * 3


def test_claim_wraps_generation_and_full_cycle_returns_to_free() -> None:
    w = word(M24, State.FREE, 0)
    w = step(w, Event.CLAIM, 0, 9)
    assert w == word(0, State.CLAIMED, 9)
    for ev in (Event.DOORBELL, Event.START, Event.COMPLETE, Event.RELEASE):
        w = step(w, ev, 0)
    assert w == word(0, State.FREE, 0)


# -- ep_poll_decide (compiled with gcc from the header the kernel includes) -----------------------

IDLE, ACCEPT, REJECT, WAIT, EXPIRE, DROP = range(6)

_HARNESS = r"""
#include <stdio.h>
#include <inttypes.h>
#include "edgepath_poll.h"
int main(void) {
    unsigned long long s, d, seen, e; unsigned g, slot;
    while (scanf("%llx %llx %llx %x %llx %u", &s, &d, &seen, &g, &e, &slot) == 6)
        printf("%d\n", ep_poll_decide(s, d, seen, g, e, slot));
    printf("%" PRIx64 "\n", ep_ring_value(0xfffffffeu, 70000u));
    return 0;
}
"""


def reference_decide(state: int, bell: int, seen: int, req_gen: int, expire: int, slot: int) -> int:
    """When the kernel trusts a doorbell: fresh, well-formed, for the current CLAIMED generation,
    whose request header names that generation; expire requests otherwise."""
    rung = IDLE
    if bell not in (seen, 0):
        dgen, sgen = bell >> 32, (state >> 32) & M24
        if bell & M32 != VALID | slot:
            return REJECT
        if dgen == sgen and state & 0xFF == State.CLAIMED and req_gen == sgen:
            return ACCEPT
        ahead = (dgen - sgen) & M24  # generations wrap at 2^24
        if dgen > M24 or ahead == 0 or ahead >= 1 << 23:
            return REJECT
        rung = WAIT
    if expire:
        return EXPIRE if expire == state and state & 0xFF == State.CLAIMED else DROP
    return rung


@pytest.fixture(scope="module")
def decide_harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot compile the poll-decision harness")
    out = tmp_path_factory.mktemp("poll") / "decide"
    src = out.with_suffix(".c")
    src.write_text(_HARNESS)
    subprocess.run([gcc, "-std=c11", "-O1", "-Wall", "-Werror", f"-I{NATIVE}", str(src), "-o", str(out)], check=True)
    return out


def _decide_cases() -> list[tuple[int, int, int, int, int, int]]:
    cases = []
    slot = 3
    for gen, st, who in itertools.product([0, 7, M24], [*State], [0, 4]):
        state = word(gen, st, who, 3 if who else 0)
        bells = {0}
        for g in (gen, (gen + 1) & M24, (gen - 1) & M24, (gen + 0x800000) & M24, gen | 0x1000000):
            good = (g << 32) | VALID | slot
            bells |= {good, good & ~VALID, (g << 32) | VALID | (slot + 1), good | 0x10000}
        for bell, req_gen, expire in itertools.product(
            sorted(bells), [gen, (gen - 1) & M24], [0, state, word(gen, State.CLAIMED, who), word(gen + 1, st, who)]
        ):
            for seen in {0, bell, (gen << 32) | VALID | slot}:
                cases.append((state, bell, seen, req_gen, expire, slot))
    return cases


def test_poll_decision_equals_reference(decide_harness: Path) -> None:
    cases = _decide_cases()
    text = "".join(f"{s:x} {d:x} {seen:x} {g:x} {e:x} {slot}\n" for s, d, seen, g, e, slot in cases)
    out = subprocess.run([str(decide_harness)], input=text, capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == len(cases) + 1
    got = [int(x) for x in out[:-1]]
    expect = [reference_decide(*c) for c in cases]
    wrong = [(tuple(hex(v) for v in c), g, e) for c, g, e in zip(cases, got, expect, strict=True) if g != e]
    assert not wrong, wrong[:5]
    assert {ACCEPT, REJECT, WAIT, EXPIRE, DROP, IDLE} <= set(got)
    assert int(out[-1], 16) == (0xFFFFFFFE << 32) | (70000 & 0xFFFF)


def test_poll_decision_follows_one_claim() -> None:
    """A claim's life as the kernel sees it: unrung (idle), rung (accept), the same bell again (idle)."""
    claimed = word(5, State.CLAIMED, 2)
    bell = (5 << 32) | VALID | 3
    assert reference_decide(claimed, 0, 0, 5, 0, 3) == IDLE
    assert reference_decide(claimed, bell, 0, 5, 0, 3) == ACCEPT
    assert reference_decide(word(5, State.RUNNING, 2), bell, bell, 5, 0, 3) == IDLE
    # a late doorbell of generation 5 once the slot is claimed again in generation 6
    assert reference_decide(word(6, State.CLAIMED, 2), bell, (6 << 32) | VALID | 3, 6, 0, 3) == REJECT
