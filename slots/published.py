"""What a slot server publishes in its pool for the agents' admission: the handler's load (the load region the
agents replay the step policy from) and the prefixes it holds (the prefix table), each rewritten only when it has
changed, and always before a finished slot is freed -- an agent that sees a slot free sees the work and the
prefixes left behind it."""

from __future__ import annotations

from edgepath.contract import wire
from edgepath.contract.plan import Load
from edgepath.slots.handlers import BatchHandler, HoldsPrefixes, ReportsLoad
from edgepath.slots.memory import PoolMemory


class Published:
    """The load and prefix table of ``handler`` as ``memory``'s pool publishes them."""

    def __init__(self, handler: BatchHandler, memory: PoolMemory) -> None:
        self.memory = memory
        holder = handler if isinstance(handler, HoldsPrefixes) else None
        #: the handler whose prefixes the pool's table publishes (None: it holds none, or the pool has no table)
        self._holder = holder if len(memory.pool.prefixes) else None
        self._prefixes_version: int | None = None
        #: the handler whose load the pool header publishes (None: it reports none; the pace word stays 0)
        self._reporter = handler if isinstance(handler, ReportsLoad) else None
        #: the load last published
        self.load = Load()
        self._load_fields = wire.load_record(self.load)
        self.publish()  # a handler may hold prefixes and report a load from the start

    def publish(self) -> None:
        """Both, where changed."""
        self.publish_prefixes()
        self.publish_load()

    def publish_prefixes(self) -> None:
        """Rewrite the pool's prefix table when what the handler holds has changed."""
        holder = self._holder
        if holder is None:
            return
        version = holder.prefixes_version()
        if version == self._prefixes_version:
            return
        self._prefixes_version = version
        self.memory.publish_prefixes(wire.prefix_table(holder.prefixes(), len(self.memory.pool.prefixes)))

    def publish_load(self) -> None:
        """Rewrite the pool's load region when the handler's load has changed."""
        if self._reporter is None:
            return
        self.load = self._reporter.load()
        fields = wire.load_record(self.load)
        if fields.tobytes() != self._load_fields.tobytes():
            self._load_fields = fields
            self.memory.publish_load(fields)
