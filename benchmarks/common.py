"""Helpers shared by the benchmark scripts: environment record, JSONL output, medians."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path


def environment() -> dict:
    import torch
    import transformers

    import viasd

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {
        "viasd": viasd.__version__,
        "git_commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


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


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
