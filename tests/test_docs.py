"""The README and docs/ hold together: every performance block a benchmark command rewrites is on the page the
commands are told to rewrite (so `make bench` and `--doc docs/PERFORMANCE.md` find it), none is left in the
README, the README stays short, and every relative link of the README and docs/ names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
#: the blocks and who writes them: bench/ingress.py, bench/edge_cpu.py, bench/stream.py, bench/model_report.py,
#: bench/report.py (`make bench`)
BLOCKS = ("ingress", "edge-cpu", "stream", "model", "datapath")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("name", BLOCKS)
def test_every_performance_block_is_on_the_performance_page_once(name: str) -> None:
    text = PERFORMANCE.read_text()
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end)
    assert "bench:" not in (ROOT / "README.md").read_text().replace("`edgepath bench", "")


def test_the_makefile_rewrites_the_performance_page() -> None:
    assert "--doc docs/PERFORMANCE.md" in (ROOT / "Makefile").read_text()


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_name_files_that_exist(page: Path) -> None:
    missing = [
        target
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
