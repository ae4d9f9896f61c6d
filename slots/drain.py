"""When a stopping slot server may exit, sans I/O: it has told its agents, and what it runs is done.

On SIGTERM (a platform replacing the pod, a rolling restart) a slot server says in its pool header that it is
draining; every agent reads that word with the heartbeat at its next link check and claims nothing more there.
The server keeps serving what it holds -- requests claimed before an agent noticed included -- and exits when:

* no agent is connected (nobody can claim or wait for anything), or
* every slot is FREE and :data:`NOTICE` seconds have passed since it said so (every agent has looked by then:
  an edge checks its links every 0.25 s, an agent process every 0.1 s), or
* the grace period is over: what still runs is then lost with the connections, and each agent moves those
  requests to another slot server (docs/MIGRATION.md).
"""

from __future__ import annotations

from dataclasses import dataclass

#: seconds a draining server waits, idle, for every agent to have read that it drains: four times the slowest
#: agent's link check, so a claim made just before an agent noticed is served, not cut off by the exit
NOTICE = 1.0
#: seconds a slot server finishes what it runs after SIGTERM, by default (``--grace-period``): within
#: Kubernetes' default terminationGracePeriodSeconds (30), leaving time to exit
DEFAULT_GRACE_PERIOD = 25.0


@dataclass(frozen=True)
class Drain:
    """A drain that began at ``started`` (monotonic seconds), allowed ``grace`` seconds."""

    started: float
    grace: float
    notice: float = NOTICE

    def over(self, now: float, idle: bool, agents: int) -> str | None:
        """Why the server may exit now (None: not yet); ``idle``: every slot FREE; ``agents``: connected."""
        if agents == 0:
            return "no agent is connected"
        if idle and now - self.started >= min(self.notice, self.grace):
            return "every slot is free and every agent has been told"
        if now - self.started >= self.grace:
            return f"the grace period of {self.grace:g} s is over: what still runs moves to other slot servers"
        return None
