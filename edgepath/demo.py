"""``edgepath demo``: the whole loopback data path in one process, N requests, what happened."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from edgepath.builder import build_agent, build_slot_server, data_path_keys, data_path_transport
from edgepath.config import AgentSettings, Capacity, DemoSettings, SlotServerSettings
from edgepath.dpu.frame import write_request
from edgepath.native.abi import Status, lib
from edgepath.peer_secret import fresh_keys, secret_given
from edgepath.runtime import runtime_dir

STAGES = ("claim", "write_to_ready", "handler", "result_back", "total")


@dataclass
class DemoReport:
    requests: int
    ok: int
    no_slot: int
    errors: int
    mismatches: int
    slots_free_after: int
    slots: int
    claims: int
    stage_us: dict[str, tuple[float, float, float]]  # p50, p99, max
    seconds: float

    def lines(self) -> list[str]:
        out = [
            f"requests {self.requests}: {self.ok} answered (echo verified), "
            f"{self.no_slot} refused with no slot (429), {self.errors} errors, {self.mismatches} wrong tokens",
            f"slots claimed {self.claims}; slots FREE after run {self.slots_free_after}/{self.slots}; "
            f"{self.requests / self.seconds:,.0f} requests/s",
            f"{'stage (us)':<16}{'p50':>10}{'p99':>10}{'max':>10}",
        ]
        for name, (p50, p99, mx) in self.stage_us.items():
            out.append(f"{name:<16}{p50:>10.1f}{p99:>10.1f}{mx:>10.1f}")
        return out


def run_demo(settings: DemoSettings, memory: str = "host") -> DemoReport:
    """Push ``settings.requests`` echo requests, ``settings.concurrency`` at a time, through a fresh slot server
    whose doorbells are polled by the CPU (``memory="host"``) or the CUDA poller (``"gpu"``), over the
    settings' data path (verbs needs ``slot_server_listen``, an IP:PORT of the device)."""
    requests, slots, concurrency, tokens, spin = (
        settings.requests,
        settings.slots,
        settings.concurrency,
        settings.tokens,
        settings.spin,
    )
    if concurrency > 256:
        raise ValueError(f"--concurrency must be at most 256, got {concurrency}")
    data_path = settings.data_path
    if data_path.kind == "verbs" and not settings.slot_server_listen:
        raise ValueError("--data-path verbs: give --slot-server-listen IP:PORT (an address of the RDMA device)")
    address = settings.slot_server_listen or str(runtime_dir() / f"demo-{time.monotonic_ns()}.sock")
    capacity = Capacity(tokens, tokens)
    agent_settings = AgentSettings(frames=max(concurrency, 1))
    # the slot server and the agent are this process's own: a secret made now, unless one was given
    given = secret_given(data_path.peer_secret_file)
    keys = data_path_keys(data_path) if given else fresh_keys("the demo's own peer secret")
    server = build_slot_server(
        SlotServerSettings(
            listen=address,
            slots=slots,
            memory=memory,
            capacity=capacity,
            spin=spin,
            hang_timeout=agent_settings.hang_timeout,
            data_path=data_path,
        ),
        keys,
    )
    worker = threading.Thread(target=server.serve, name="slot-server", daemon=True)
    worker.start()
    agent_transport = data_path_transport(data_path, agent_settings.hang_timeout, keys)
    try:
        agent = build_agent(agent_settings, capacity, agent_transport, (address,))
        link = agent.links[0]
        stamps = np.zeros((requests, len(STAGES)), dtype=np.int64)
        t_submit = {}
        ok = no_slot = errors = mismatches = sent = answered = 0
        rng = np.random.default_rng(7)
        payload = rng.integers(0, 131_072, size=(requests, tokens), dtype=np.int32)
        begin = time.perf_counter()
        deadline = begin + 120.0
        while answered < requests and time.perf_counter() < deadline:
            while sent < requests:
                index = agent.acquire()
                if index is None:
                    break
                write_request(agent.frames, index, payload[sent], request_id=sent, max_new_tokens=tokens)
                t0 = lib.ep_now_ns()
                status = agent.submit(index)
                if status is not None:
                    agent.release(index)
                    answered += 1
                    if status == Status.NO_SLOT:
                        no_slot += 1
                    else:
                        errors += 1
                else:
                    t_submit[index] = t0
                sent += 1
            for index in [d.index for d in agent.poll(timeout=1.0, spin=spin) if d.final]:
                t_end = lib.ep_now_ns()
                req = agent.frames.requests[index]
                res = agent.frames.results[index]
                rid = int(req["request_id"])
                if res["status"] == Status.OK:
                    ok += 1
                    n = int(res["output_count"])
                    if n != tokens or not np.array_equal(agent.frames.outputs[index, :n], payload[rid]):
                        mismatches += 1
                else:
                    errors += 1
                t0 = t_submit.pop(index)
                stamps[rid] = (
                    int(req["t_written_ns"]) - t0,
                    int(res["t_ready_ns"]) - int(req["t_written_ns"]),
                    int(res["t_done_ns"]) - int(res["t_start_ns"]),
                    t_end - int(res["t_done_ns"]),
                    t_end - t0,
                )
                agent.release(index)
                answered += 1
        seconds = time.perf_counter() - begin
        done = stamps[np.any(stamps != 0, axis=1)] / 1000.0
        stage_us = {
            name: (
                float(np.percentile(done[:, i], 50)),
                float(np.percentile(done[:, i], 99)),
                float(done[:, i].max()),
            )
            if len(done)
            else (0.0, 0.0, 0.0)
            for i, name in enumerate(STAGES)
        }
        # Let the server finish its last release before counting FREE slots.
        settle = time.monotonic() + 2.0
        while server.pool.free_count() < slots and time.monotonic() < settle:
            time.sleep(0.01)
        return DemoReport(
            requests,
            ok,
            no_slot,
            errors + (requests - answered),
            mismatches,
            server.pool.free_count(),
            slots,
            link.stats.claims,
            stage_us,
            seconds,
        )
    finally:
        server.close()
        worker.join(timeout=2.0)
        agent_transport.close()
        server.transport.close()
