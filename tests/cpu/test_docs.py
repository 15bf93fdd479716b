"""The documents match the code: every variable the package reads is in README's settings table, and every
relative link in README.md, docs/, tests/README.md and benchmarks/README.md points at a file that exists."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "tests" / "README.md", ROOT / "benchmarks" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]


def test_every_variable_the_package_reads_is_in_the_readme_table():
    read = set()
    for source in (ROOT / "python" / "rocenante").rglob("*.py"):
        read |= set(re.findall(r"[\"'](ROCENANTE_[A-Z0-9_]*[A-Z0-9])[\"']", source.read_text()))
    assert read, "no variable found: the pattern no longer matches how the package reads them"
    table = {name for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `ROCENANTE_")
             for name in re.findall(r"`(ROCENANTE_[A-Z0-9_]+)`", line.split("|")[1])}
    assert read <= table, f"read by the package but missing from README's settings table: {sorted(read - table)}"


def test_every_relative_link_of_the_documents_resolves():
    broken = []
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if "://" not in target and not (document.parent / target).exists():
                broken.append(f"{document.relative_to(ROOT)}: {target}")
    assert not broken, broken
