"""Probe: a CLI call's time to its first token and wall time, `ar` against `pld`, with the pass-time
measurement taken in the call (`VIASD_NO_TIMING_CACHE=1`, as every call was before session 19) and
read back from the cache directory (`pass_times.json`, written by the first call that measures).

Each round runs, one after another, `viasd generate -s ar`, `-s pld` measuring afresh, and `-s pld`
reading the kept measurement, as separate processes on the same prompt (greedy, `--json`).

    python benchmarks/first_token.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--out FILE]

Appends JSONL records (run id, environment with CPU flags, commit) to
benchmarks/out/first-token.jsonl (untracked); compare rows of one run only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, per_model_run  # noqa: E402

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."
ROUNDS = 3
CASES = (("ar", "ar", True), ("pld-measured", "pld", True), ("pld-kept", "pld", False))


def call(model: str, strategy: str, fresh: bool) -> dict:
    env = {**os.environ, "VIASD_NO_TIMING_CACHE": "1" if fresh else "0"}
    out = subprocess.run([sys.executable, "-m", "viasd", "generate", PROMPT, "-m", model, "-s", strategy, "-n", "128", "--json"],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["stats"]


def main() -> None:
    models, run_id, records = per_model_run(__doc__, Path(__file__).parent / "out" / "first-token.jsonl")
    for model in models:
        call(model, "pld", False)  # the kept measurement exists before the rounds (the model converted, the kernels built)
        seen: dict[str, list[dict]] = {name: [] for name, _, _ in CASES}
        for i in range(ROUNDS):
            for name, strategy, fresh in CASES:
                s = call(model, strategy, fresh)
                seen[name].append(s)
                records.write(run_id=run_id, model=model, case=name, round=i, first_token_s=s["first_token_s"], wall_s=s["wall_s"],
                              decode_tokens_per_s=s["decode_tokens_per_s"], new_tokens=s["new_tokens"])
        for name, _, _ in CASES:
            print(f"{model:22s} {name:13s} first token {median([s['first_token_s'] for s in seen[name]]):.2f} s  "
                  f"wall {median([s['wall_s'] for s in seen[name]]):.2f} s  (medians of {ROUNDS}; run {run_id})", flush=True)


if __name__ == "__main__":
    main()
