"""Interleaved A/B of `viasd generate` between two commits: did a change move decoding speed?

Each commit is checked out into a temporary worktree; for every prompt both run `viasd generate --json`
(a fresh process each: the model loads, then decodes) in an order that alternates per prompt, after
`--idle` seconds of quiet machine. Records (one JSONL line per run) carry the commit, the settings, the
tokens and viasd's own decode-only and wall statistics; the summary gives medians of per-prompt
ratios (head / base) and whether the tokens were the same.

    python benchmarks/ab.py --base 7dc7d6d --head HEAD --out /tmp/ab.jsonl      # ~4 min on the 1.5B
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import Records, environment, median

ROOT = Path(__file__).resolve().parents[1]


def _worktree(rev: str, where: Path) -> tuple[Path, str]:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(where), commit], check=True)
    return where, commit


def _prompts(limit: int) -> list[str]:
    from viasd.bench import load_tasks

    return [t.text for t in load_tasks("spec_bench", limit=limit)]


def _run(tree: Path, args, prompt: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, "-m", "viasd", "generate", "-m", args.model, "-s", args.strategy, "-n", str(args.max_tokens),
           "--json", "--quiet", prompt]
    got = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if got.returncode:
        raise SystemExit(f"ab.py: {tree.name}: viasd generate failed: {got.stderr.strip()[-500:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit before (any git revision)")
    ap.add_argument("--head", default="HEAD", help="the commit after (default: HEAD)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--strategy", default="ar")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=1, help="Spec-Bench prompts of each of its 6 categories")
    ap.add_argument("--idle", type=float, default=1.5, help="seconds of quiet machine before each run")
    ap.add_argument("--out", type=Path, required=True, help="JSONL records (must not exist: one run a file)")
    args = ap.parse_args()
    if args.out.exists() and args.out.stat().st_size:
        ap.error(f"--out {args.out} is not empty: one run a file")
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(args.out, environment())
    prompts = _prompts(args.limit)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"base": _worktree(args.base, Path(tmp) / "base"), "head": _worktree(args.head, Path(tmp) / "head")}
        try:
            ratios: dict[str, list[float]] = {"decode": [], "wall": []}
            same = 0
            for i, prompt in enumerate(prompts):
                got = {}
                for side in (("base", "head") if i % 2 == 0 else ("head", "base")):
                    time.sleep(args.idle)
                    tree, commit = sides[side]
                    out = _run(tree, args, prompt)
                    got[side] = out
                    records.write(run_id=run_id, side=side, commit=commit, prompt_index=i, model=args.model,
                                  strategy=args.strategy, max_tokens=args.max_tokens, token_ids=out["token_ids"],
                                  stats=out["stats"])
                b, h = got["base"]["stats"], got["head"]["stats"]
                ratios["decode"].append(h["decode_tokens_per_s"] / b["decode_tokens_per_s"])
                ratios["wall"].append(h["tokens_per_s"] / b["tokens_per_s"])
                same += got["base"]["token_ids"] == got["head"]["token_ids"]
                print(f"prompt {i}: decode {b['decode_tokens_per_s']:.1f} -> {h['decode_tokens_per_s']:.1f} tok/s", flush=True)
        finally:
            for tree, _ in sides.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"run {run_id}: head / base, median of per-prompt ratios: decode {median(ratios['decode']):.3f}, "
          f"wall {median(ratios['wall']):.3f}; same tokens {same}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
