"""What the row-exact kernels' software prefetch saves: each model's one-row pass with the weights
prefetched a few blocks ahead (`rowexact.set_prefetch_rows(8)`, the default) and without (0),
interleaved in one process (`pass_times`, medians of 9 calls per round, `--rounds` rounds), native
weights. Results never depend on it. Only weights on the row-exact kernel are affected (on an
AVX2-only CPU: Q4_1, Q5_0, Q8_0; with AVX-512 VNNI: every type it takes).

    python benchmarks/prefetch.py --out benchmarks/out/prefetch.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Records, environment  # noqa: E402
from load import cpu_flags  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    from viasd import compute
    from viasd.execution.timing import pass_times
    from viasd.models import rowexact
    from viasd.models.loading import load_model

    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(args.out, {**environment(), "cpu_flags": cpu_flags()})
    print(f"run {run_id}")
    for name in args.models.split(","):
        model = load_model(name, progress=False)
        times: dict[int, list[float]] = {0: [], 8: []}
        for _ in range(args.rounds):
            for rows in (0, 8):
                rowexact.set_prefetch_rows(rows)
                times[rows].append(compute.run(lambda: pass_times(model.decoder, 1, reps=9, keep=False))[0])
        rowexact.set_prefetch_rows(8)
        off, on = statistics.median(times[0]), statistics.median(times[8])
        records.write(run_id=run_id, model=name, one_row_pass_s={"no_prefetch": off, "prefetch": on},
                      samples_s={"no_prefetch": times[0], "prefetch": times[8]}, speedup=round(off / on, 4),
                      rounds=args.rounds)
        print(f"{name}: one-row pass {off * 1e3:.2f} ms without prefetch, {on * 1e3:.2f} ms with: {off / on:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
