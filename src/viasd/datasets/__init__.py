"""Vendored evaluation prompts (see PROVENANCE.md beside this file)."""

from __future__ import annotations

import gzip
import json
from importlib.resources import files

SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def spec_bench(category: str | None = None) -> list[dict]:
    """Spec-Bench questions `{question_id, category, turns, reference?}`; MT-bench's eight
    sub-categories (writing, roleplay, ...) are reported as category "mt_bench" with `subcategory`."""
    rows = []
    for line in files(__package__).joinpath("spec_bench.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["category"] not in SPEC_BENCH_CATEGORIES:
            row = {**row, "subcategory": row["category"], "category": "mt_bench"}
        if category is None or row["category"] == category:
            rows.append(row)
    if category is not None and not rows:
        raise ValueError(f"unknown Spec-Bench category {category!r}: choose from {', '.join(SPEC_BENCH_CATEGORIES)}")
    return rows


def human_eval() -> list[dict]:
    """HumanEval problems `{task_id, prompt, canonical_solution, test, entry_point}`."""
    data = gzip.decompress(files(__package__).joinpath("HumanEval.jsonl.gz").read_bytes()).decode()
    return [json.loads(line) for line in data.splitlines() if line.strip()]
