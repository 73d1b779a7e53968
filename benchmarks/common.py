"""Helpers shared by the benchmark scripts: environment record, JSONL output, medians."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def environment() -> dict:
    """viasd's bench environment record (the git commit of the checkout included) and the time."""
    from viasd.bench import environment as viasd_environment

    return {**viasd_environment(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


class Records:
    """Append-only JSONL writer: one line per measurement, flushed at once (Ctrl-C loses nothing written)."""

    def __init__(self, path: Path, env: dict):
        self.path = path
        self.env = env
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **record) -> dict:
        record = {**record, "env": self.env}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def per_model_run(doc: str, out: Path) -> tuple[list[str], str, Records]:
    """The command line of a probe over models (`--models a,b`, `--out FILE`): the models, a new run
    id and the records file with this run's environment."""
    import argparse
    import uuid

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--out", type=Path, default=out)
    args = ap.parse_args()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    return args.models.split(","), run_id, Records(args.out, environment())


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
