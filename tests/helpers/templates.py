"""Real chat templates, verbatim, as llama.cpp keeps them for its own chat tests (``models/templates/``): read from the
llama.cpp source inside the sdist of the llama-cpp-python the project pins (pyproject's ``model`` extra), which pip
fetches from PyPI once per machine -- the same sdist llama-server is built from (``edgepath bench`` / ``.ci/run``).
So the tests render the templates real models ship, and the repository carries none of them.

The templates are unpacked once into ``$XDG_CACHE_HOME/edgepath/chat-templates-<version>/`` (or read from the folder
``$EDGEPATH_CHAT_TEMPLATES`` names: the soft-RoCE lane's VMs, which have no network, get the host's that way); a test
that needs one where neither PyPI nor pip's cache can give the sdist fails within a minute, naming the command that
fetches it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = "/vendor/llama.cpp/models/templates/"


def _version() -> str:
    """The llama-cpp-python version pyproject pins (the one installed: scripts/install-llama)."""
    found = re.search(r'"llama-cpp-python==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml pins no llama-cpp-python==VERSION"
    return found.group(1)


def folder() -> Path:
    """The folder holding the templates, fetched and unpacked on first use."""
    given = os.environ.get("EDGEPATH_CHAT_TEMPLATES")
    if given:
        assert Path(given).is_dir(), f"EDGEPATH_CHAT_TEMPLATES names {given}, which is not a folder"
        return Path(given)
    version = _version()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgepath"
    folder = base / f"chat-templates-{version}"
    if folder.is_dir():
        return folder
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as work:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                   "--retries", "1", "--timeout", "20", f"llama-cpp-python=={version}", "-d", work]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        sdists = sorted(Path(work).glob("*.tar.gz"))
        assert done.returncode == 0 and sdists, (
            f"the chat templates come from the llama-cpp-python {version} sdist, which pip could not fetch "
            f"({done.stderr.strip()[-300:]}): run `{' '.join(command[:-2])}` where PyPI or pip's cache is reachable"
        )
        unpacked = Path(work) / "templates"
        unpacked.mkdir()
        with tarfile.open(sdists[0]) as sdist:
            for member in sdist.getmembers():
                if member.isfile() and MEMBERS in member.name and member.name.endswith(".jinja"):
                    source = sdist.extractfile(member)
                    assert source is not None
                    (unpacked / Path(member.name).name).write_bytes(source.read())
        assert any(unpacked.iterdir()), f"the llama-cpp-python {version} sdist holds no {MEMBERS}*.jinja"
        try:
            unpacked.rename(folder)  # whole or not at all: another test process may have made it meanwhile
        except OSError:
            assert folder.is_dir()
    return folder


def template_path(name: str) -> Path:
    """Where the template ``name`` (llama.cpp's file name, e.g. ``Qwen-Qwen3-0.6B.jinja``) is, unpacked."""
    path = folder() / name
    assert path.is_file(), f"llama.cpp's models/templates/ in the llama-cpp-python {_version()} sdist has no {name}"
    return path


def template(name: str) -> str:
    """The text of the template ``name``, verbatim."""
    return template_path(name).read_text()
