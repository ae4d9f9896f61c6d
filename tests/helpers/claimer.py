"""A claimer process for the multi-process tests: ``python tests/claimer.py MODE CONFIG_JSON``.

Modes (each prints one JSON line per step on stdout):
  cas    -- race raw remote CASes on a pool's state words, checking mutual exclusion with an owner word;
  agent  -- drive an in-process Agent against a slot server with unique tokens, checking every echo;
  stale  -- claim one slot, report it, wait for "ring" on stdin, then write + ring (a late writer).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from edgepath.contract.wire import SlotWord, claim_word
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.native.abi import State, Status
from edgepath.peer_secret import peer_keys
from edgepath.transports.base import Access
from edgepath.transports.registry import make_transport


def race_cas(cfg: dict) -> dict:
    """Claim/release slots by remote CAS; while owning one, mark and re-check an owner word."""
    t = make_transport(cfg["transport"], peer_keys(None), **cfg["options"])
    local = t.register("local", 64, Access.NONE)
    conn = t.connect(cfg["address"], [], {})
    pool = conn.remote["pool"]
    me, slots = cfg["claimant"], cfg["slots"]
    words = local.buf[:8].view(np.uint64)
    owner = local.buf[8:16].view(np.uint64)
    rng = np.random.default_rng(me)
    wins = violations = attempts = 0
    while time.time() < cfg.get("start_at", 0):  # all claimers start together, whatever their start-up took
        time.sleep(0.001)
    deadline = time.monotonic() + cfg["seconds"]
    while wins < cfg["iterations"] and time.monotonic() < deadline:
        slot = int(rng.integers(slots))
        conn.read(local, 0, pool, 8 * slot, 8)
        cur = int(words[0])
        if SlotWord.unpack(cur).state != State.FREE:
            continue
        attempts += 1
        mine = claim_word(cur, me)
        if conn.compare_and_swap(pool, 8 * slot, cur, mine) != cur:
            continue
        wins += 1
        owner_off = cfg["owners_offset"] + 8 * slot
        conn.read(local, 8, pool, owner_off, 8)
        violations += int(owner[0]) != 0
        owner[0] = me
        conn.write(local, 8, pool, owner_off, 8)
        conn.read(local, 8, pool, owner_off, 8)
        violations += int(owner[0]) != me
        owner[0] = 0
        conn.write(local, 8, pool, owner_off, 8)
        free = SlotWord(mine >> 32, State.FREE, 0).pack()
        violations += conn.compare_and_swap(pool, 8 * slot, mine, free) != mine
    t.close()
    return {"wins": wins, "attempts": attempts, "violations": violations}


def drive_agent(cfg: dict) -> dict:
    """Unique tokens per request; every answer must echo exactly what this process sent."""
    t = make_transport(cfg["transport"], peer_keys(None), **cfg["options"])
    agent = Agent(
        t,
        frames=cfg["window"],
        input_capacity=cfg["tokens"],
        output_capacity=cfg["tokens"],
        max_servers=1,
        max_slots_per_server=256,
    )
    agent.attach(cfg["address"])
    me, n, tokens = cfg["claimant"], cfg["requests"], cfg["tokens"]
    counts = {"ok": 0, "no_slot": 0, "other": 0, "mismatch": 0}
    sent = answered = 0
    expect: dict[int, np.ndarray] = {}
    deadline = time.monotonic() + cfg["seconds"]
    while answered < n and time.monotonic() < deadline:
        while sent < n and (index := agent.acquire()) is not None:
            ids = (np.arange(tokens, dtype=np.int32) + sent * 7 + me * 1_000_003) % 131_072
            write_request(agent.frames, index, ids, request_id=sent, max_new_tokens=tokens)
            sent += 1
            status = agent.submit(index)
            if status is None:
                expect[index] = ids
                continue
            counts["no_slot" if status == Status.NO_SLOT else "other"] += 1
            answered += 1
            agent.release(index)
        for index in [d.index for d in agent.poll(timeout=1.0) if d.final]:
            res = agent.frames.results[index]
            if int(res["status"]) == Status.OK:
                counts["ok"] += 1
                got = agent.frames.outputs[index, : int(res["output_count"])]
                counts["mismatch"] += not np.array_equal(got, expect.pop(index))
            else:
                counts["other"] += 1
                expect.pop(index)
            answered += 1
            agent.release(index)
    counts["answered"] = answered
    t.close()
    return counts


def stale(cfg: dict) -> None:
    t = make_transport(cfg["transport"], peer_keys(None), **cfg["options"])
    agent = Agent(
        t,
        frames=1,
        input_capacity=cfg["tokens"],
        output_capacity=cfg["tokens"],
        max_servers=1,
        max_slots_per_server=256,
    )
    link = agent.attach(cfg["address"])
    slot, gen = agent.claims.claim(link)
    print(json.dumps({"slot": slot, "generation": gen}), flush=True)
    if sys.stdin.readline().strip() != "ring":
        return
    write_request(agent.frames, 0, [5, 6, 7], request_id=1, max_new_tokens=3)
    agent.claims.send(link, 0, slot, gen, 3)
    answered = agent.poll(timeout=cfg.get("wait", 1.0))
    print(json.dumps({"rang": True, "answered": answered}), flush=True)
    t.close()


if __name__ == "__main__":
    mode, config = sys.argv[1], json.loads(sys.argv[2])
    if mode == "stale":
        stale(config)
    else:
        print(json.dumps({"cas": race_cas, "agent": drive_agent}[mode](config)), flush=True)
