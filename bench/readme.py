"""The performance page's blocks (docs/PERFORMANCE.md): each is written by its benchmark command, never by hand.

Every benchmark command that reports figures takes ``--doc PAGE`` (``--readme`` is its old name and still
works): it rewrites the block between ``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->`` in that
page, and a plot it draws is copied next to the page and linked from the block by its file name.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

#: the page that holds every performance block, from the repository's root
PERFORMANCE_DOC = "docs/PERFORMANCE.md"


def rewrite_block(doc: Path, name: str, text: str) -> None:
    """Replace what is between the page's ``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->``
    with ``text``: every performance table there is written by its command, never by hand."""
    begin, end = block_markers(name)
    content = doc.read_text()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(content):
        raise SystemExit(f"{doc}: no {begin} ... {end} block to rewrite")
    doc.write_text(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", content))


def block_markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name``."""
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def place_plot(doc: Path, png: Path, name: str) -> str:
    """Copy ``png`` next to ``doc`` as ``name`` and return the link to it from the page (its file name)."""
    target = doc.parent / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(png, target)
    return name
