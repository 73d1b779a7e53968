"""What host code costs right after a pass: single operations of a decoding round, cold and warm.

Issue 41, point 4: a round's host time (sampling, acceptance, conversion between vocabularies,
bookkeeping). A pass streams the model's weights through the caches, so the first host code after it
finds its instructions and data gone. Each operation below runs once right after a one-row pass of
the model (cold) and once more at once (warm); the two alternate with passes `--rounds` times, on
viasd's compute thread, and the medians are reported. What the decoding loops were changed to avoid
is measured beside what they do now (`first_among` over numpy against a loop of Python floats, a
`Counter.update` against a loop).

    python benchmarks/cold_host.py --out benchmarks/out/cold-host.jsonl
    python benchmarks/cold_host.py --models qwen2.5-coder-0.5b --rounds 21 --out /tmp/c.jsonl

One JSONL record per (model, operation) with the run id, cold and warm medians in microseconds, and
the environment (CPU flags). Start from an empty output file.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Records, environment, median  # noqa: E402

HERE = Path(__file__).resolve().parent
TEXT = "    for i in range(len(xs)):\n        total += xs[i]"


def operations(loaded, drafter) -> dict:
    """name -> f(logits [1, V]) for the operations measured."""
    from viasd.decoding.acceptance import first_among
    from viasd.decoding.stats import DecodeStats
    from viasd.decoding.session import CallKind, pass_bytes
    from viasd.models.logits import PassOutput

    dec, stats, counts = loaded.decoder, DecodeStats(), collections.Counter()
    ids = sorted(np.random.default_rng(0).choice(min(40000, dec.lm_head.out_features), 5, replace=False).tolist())
    ids_np = np.asarray(ids)
    ops = {
        "nothing": lambda lg: None,
        "row = logits[0]": lambda lg: lg[0],
        "logits.shape[0]": lambda lg: lg.shape[0],
        "rows = logits.unbind(0)": lambda lg: lg.unbind(0),
        "rows by iteration: tuple(logits)": lambda lg: tuple(lg),
        "pass_bytes(decoder)": lambda lg: pass_bytes(dec, None),
        "PassOutput(logits, argmax)[0]": lambda lg: PassOutput(lg, [0])[0],
        "stats.observe_call": lambda lg: stats.observe_call(CallKind.DRAFT, rows=1, model="drafter", bytes_read=1),
        "Counter.update(2 items)": lambda lg: counts.update(["a", "b"]),
        "Counter += 1, twice": lambda lg: [counts.__setitem__(k, counts[k] + 1) for k in ("a", "b")],
        "first_among(5 ids): Python floats": lambda lg: first_among(lg[0], ids),
        "first_among(5 ids): numpy indexing": lambda lg: int(ids_np[np.argmax(lg[0].numpy()[ids_np])]),  # (before 6a2f242)
        "verifier tokenizer encode": lambda lg: loaded.vocabulary.encode(TEXT),
    }
    if drafter is not None:
        ops["drafter tokenizer encode"] = lambda lg: drafter.vocabulary.encode(TEXT)
    return ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="smollm2-135m", help="a model of another vocabulary whose tokenizer is timed too")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "cold-host.jsonl")
    args = ap.parse_args(argv)
    from viasd import compute, load_drafter, load_model

    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(args.out, environment())
    drafter = load_drafter(args.drafter, progress=False) if args.drafter else None
    print(f"run {run_id}; cold: right after a one-row pass; warm: the same call again at once (medians, us)")

    def measure(name: str) -> None:
        loaded = load_model(name, progress=False)
        dec = loaded.decoder
        cache = dec.new_cache(64)
        dec.forward([1, 2, 3], 0, cache, last_only=True)
        ops = operations(loaded, drafter)
        cold: dict[str, list[float]] = {k: [] for k in ops}
        warm: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(args.rounds):
            for op, f in ops.items():
                logits = dec.forward([7], 3, cache, last_only=True)  # [1, V]
                cache.rollback(3)
                t0 = time.perf_counter()
                f(logits)
                t1 = time.perf_counter()
                f(logits)
                t2 = time.perf_counter()
                cold[op].append(t1 - t0)
                warm[op].append(t2 - t1)
        for op in ops:
            c, w = 1e6 * median(cold[op]), 1e6 * median(warm[op])
            print(f"{name:20s} {op:38s} cold {c:7.1f}  warm {w:6.1f}")
            records.write(run_id=run_id, model=name, operation=op, cold_us=round(c, 2), warm_us=round(w, 2),
                          rounds=args.rounds, weight_bytes=dec.weight_bytes())

    for name in args.models.split(","):
        compute.run(lambda: measure(name))
    print(f"{args.out}: run {run_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
