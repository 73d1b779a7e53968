"""The documentation stays a reference, not a lab notebook (issue 63).

- `benchmarks/results/` holds at most 30 files, every one cited by name from docs/*.md or README.md,
  and every `benchmarks/results/...` path the docs cite exists;
- docs/performance.md (one current table per benchmark) fits 250 lines, benchmarks/README.md 300 and
  README.md 250;
- no run id (`20261205T110738`) or commit hash (7-40 hex digits) appears in README.md or docs/*.md,
  except in the tables of docs/performance.md, which name each record's commit and run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PERFORMANCE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"

RUN_ID = re.compile(r"\b\d{8}T\d{4,6}")
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
CITED_PATH = re.compile(r"benchmarks/results/([\w./+-]*[\w+-])")


def _text(paths: list[Path]) -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in paths)


def _records() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def test_results_are_few():
    assert len(_records()) <= 30, f"benchmarks/results/ holds {len(_records())} files (at most 30): keep the cited ones"


def test_every_record_is_cited():
    text = _text([*DOCS, README])
    uncited = [name for name in _records() if name not in text]
    assert not uncited, f"records no doc cites (cite them in docs/performance.md or remove them): {uncited}"


def test_every_cited_record_exists():
    text = _text([*DOCS, README, ROOT / "benchmarks" / "README.md"])
    missing = sorted({m for m in CITED_PATH.findall(text) if not (RESULTS / m).exists()})
    assert not missing, f"cited but not in benchmarks/results/: {missing}"


@pytest.mark.parametrize(("path", "limit"), [
    ("docs/performance.md", 250),
    ("benchmarks/README.md", 300),
    ("README.md", 250),
])
def test_length(path, limit):
    lines = len((ROOT / path).read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"{path} has {lines} lines (at most {limit})"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_no_run_ids_or_commits(path):
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if path == PERFORMANCE and line.startswith("|"):
            continue  # performance.md's tables name each record's commit and run
        found += [f"{path.name}:{number}: {m}" for m in RUN_ID.findall(line) + COMMIT.findall(line)]
    assert not found, "run ids or commit hashes outside performance.md's tables:\n" + "\n".join(found)
