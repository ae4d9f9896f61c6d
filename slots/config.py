"""What a slot server is made of, as plain data.

The defaults it shares with agents and the commands (a slot's capacity, a pool's slots, the hang timeout)
are declared where agents read them too: the pool layout (:mod:`edgepath.contract.pool`) and the transport
interface (:mod:`edgepath.transports.base`).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgepath.contract.pool import DEFAULT_CAPACITY, DEFAULT_SLOTS
from edgepath.slots.drain import DEFAULT_GRACE_PERIOD
from edgepath.transports.base import DEFAULT_HANG_TIMEOUT

#: where a pool may live (``--slots KIND:N``); :mod:`edgepath.slots.memory` implements each
SLOT_MEMORY = ("host", "gpu", "gpu-device")
#: seconds a model step may take before the slot server reports it: half the default hang timeout (a handler
#: that cannot beat from inside its steps is then halfway to being called hung)
STEP_BUDGET = DEFAULT_HANG_TIMEOUT / 2


@dataclass(frozen=True, kw_only=True)
class SlotServerConfig:
    """A slot server's pool and loop; durations in seconds.  The app layer's slot-server settings extend
    it with where it listens, which handler it runs and over which data path."""

    slots: int = DEFAULT_SLOTS
    input_capacity: int = DEFAULT_CAPACITY
    output_capacity: int = DEFAULT_CAPACITY
    lease: float = 1.0  # seconds a CLAIMED slot may wait for its doorbell
    spin: float = 0.0  # seconds to spin on the CQ before sleeping
    scan_interval: float = 0.05
    # "host": host memory, CPU poller; "gpu": host memory mapped into the GPU, CUDA poller;
    # "gpu-device": GPU memory registered with the NIC (transport.register_device), CUDA poller
    memory: str = "host"
    gpu_device: int = 0
    handoff_wait: float = 0.002  # seconds to wait for the GPU's hand-off after a doorbell arrives
    # seconds the next model step waits, after a slot is handed over to a reclaimer (docs/TENANTS.md), for its
    # request: the tenant under its floor then starts in that step, not in the one after it
    handover_wait: float = 0.05
    handler_deadline: float = 0.0  # > 0: one-shot handlers run on worker threads and are answered after this long
    stream_window: float = 0.002  # seconds within which streamed tokens after the first are coalesced
    step_budget: float = STEP_BUDGET  # a model step longer than this is logged and counted (heartbeat still)
    grace_period: float = DEFAULT_GRACE_PERIOD  # seconds a draining server (SIGTERM) finishes what it runs

    def __post_init__(self) -> None:
        if self.memory not in SLOT_MEMORY:
            raise ValueError(f"slot memory must be one of {', '.join(SLOT_MEMORY)}, got {self.memory!r}")
        if self.lease <= 0:
            raise ValueError(f"lease must be positive seconds, got {self.lease}")
        if self.handler_deadline < 0:
            raise ValueError(f"handler deadline must be >= 0 seconds (0: none), got {self.handler_deadline}")
        if self.handover_wait < 0:
            raise ValueError(f"hand-over wait must be >= 0 seconds, got {self.handover_wait}")
        if self.spin < 0:
            raise ValueError(f"spin must be >= 0 seconds, got {self.spin}")
        if self.stream_window < 0:
            raise ValueError(f"stream window must be >= 0 seconds, got {self.stream_window}")
        if self.grace_period < 0:
            raise ValueError(f"grace period must be >= 0 seconds, got {self.grace_period}")
        if not self.step_budget > 0:
            raise ValueError(f"step budget must be positive seconds, got {self.step_budget}")
