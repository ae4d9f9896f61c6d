"""Where edgepath's local endpoints live by default, and logging set-up shared by the commands."""

from __future__ import annotations

import logging
import os
from pathlib import Path


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    path = Path(base) / f"edgepath-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def default_address(role: str) -> str:
    """Default loopback address of ``role`` ("slot-server", "agent")."""
    return str(runtime_dir() / f"{role}.sock")


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
