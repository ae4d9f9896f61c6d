"""The data-path fixtures (:mod:`helpers.datapath`) for the model suite's tests through slot servers."""

from helpers.datapath import new_agent, serve

__all__ = ["new_agent", "serve"]
