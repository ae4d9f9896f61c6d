"""The data-path fixtures (:mod:`helpers.datapath`) for the slot-server suite."""

from helpers.datapath import make_server, new_agent, serve

__all__ = ["make_server", "new_agent", "serve"]
