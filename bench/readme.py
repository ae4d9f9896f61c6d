"""The README's performance blocks: each is written by its benchmark command, never by hand."""

from __future__ import annotations

import re
from pathlib import Path


def rewrite_block(readme: Path, name: str, text: str) -> None:
    """Replace what is between the README's ``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->``
    with ``text``: every performance table there is written by its command, never by hand."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    content = readme.read_text()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(content):
        raise SystemExit(f"{readme}: no {begin} ... {end} block to rewrite")
    readme.write_text(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", content))
