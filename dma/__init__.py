"""Slot pools, transports and pollers: the memory the requests land in."""
