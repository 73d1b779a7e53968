"""Probe: how much of what a model actually writes a reduced LM head holds (issue 11 item 3).

For each reduced vocabulary size N (routing/vocab.py: the DIMR calibration corpus' most frequent
tokens, Spec-Bench's dev split only, then by id), the share of the tokens `ar` wrote on held-out
prompts (Spec-Bench's evaluation split, question_id % 5 != 0, and HumanEval, which calibration never
sees) that fall inside it: the share of positions where a slim or drafting pass with that head can
judge the next token at all. The outputs are read from every `ar` record of the model in the tracked
benchmarks/results (deduplicated; no decoding here, so no timing); records go to benchmarks/out/
(untracked).

    python benchmarks/vocab_coverage.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--out FILE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import per_model_run  # noqa: E402

from viasd.models.loading import load_model  # noqa: E402
from viasd.routing.vocab import calibration_vocab, coverage  # noqa: E402

RESULTS = Path(__file__).parent / "results"
OUT = Path(__file__).parent / "out" / "vocab-coverage.jsonl"
SIZES = (2048, 4096, 8192, 16384, 32768)


def held_out_outputs(model_name: str) -> dict[tuple[str, str], list[int]]:
    """(task, prompt id) -> `ar`'s token ids, from every results file, held-out prompts only."""
    out: dict[tuple[str, str], list[int]] = {}
    for path in sorted(RESULTS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if not isinstance(r, dict) or r.get("method") != "ar" or not r.get("token_ids"):
                continue
            if (r.get("config") or {}).get("model") != model_name:
                continue
            task, pid = str(r.get("task", "")), str(r.get("prompt_id", ""))
            if task.startswith("spec_bench") and (not pid.isdigit() or int(pid) % 5 == 0):
                continue  # the dev split: calibration's own prompts
            out.setdefault((task, pid), r["token_ids"])
    return out


def main() -> int:
    models, run_id, records = per_model_run(__doc__, OUT)
    for name in models:
        outputs = held_out_outputs(name)
        tokens = [t for ids in outputs.values() for t in ids]
        model = load_model(name, progress=False)
        vocab_size = model.decoder.lm_head.out_features
        for size in SIZES:
            if size >= vocab_size:
                continue
            vocab = calibration_vocab(model, size)
            share = coverage(vocab, tokens)
            records.write(run_id=run_id, model=name, vocab_size=vocab_size, head_vocab=len(vocab), prompts=len(outputs),
                          tokens=len(tokens), coverage=round(share, 4))
            print(f"{name}: head of {len(vocab)} of {vocab_size} tokens holds {share:.1%} of {len(tokens)} tokens "
                  f"`ar` wrote on {len(outputs)} held-out prompts", flush=True)
        del model
    print(f"run {run_id}: {records.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
