"""`generate` called from different Python threads of one process: the thread that loaded the model,
a second thread, then the first again (smollm2 `ar`, decode-only tokens/s). Before the compute thread
(`git checkout 403746d`), the second thread ran at 0.6-0.7x and slowed the first once it had run
(libgomp throttles its spin-waiting once two threads own OpenMP teams); since, every caller gets the
same speed. Records (JSONL, with the CPU flags) in --out.

    python benchmarks/threads.py --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Records, environment  # noqa: E402
from load import cpu_flags  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT = "Write a short story about a robot learning to paint."


def main(argv=None) -> int:
    from viasd.api import generate
    from viasd.models.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "out" / "threads.jsonl"))
    args = p.parse_args(argv)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-threads"
    records = Records(Path(args.out), {**environment(), "cpu_flags": cpu_flags()})
    first, second = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    model = first.submit(load_model, args.model, progress=False).result()

    def rate() -> float:
        return generate(PROMPT, model, strategy="ar", max_new_tokens=64, progress=False).stats.decode_tokens_per_s

    first.submit(rate).result()  # warm-up
    for phase, pool in (("loading thread", first), ("second thread", second), ("loading thread again", first)):
        for _ in range(args.repeats):
            r = pool.submit(rate).result()
            records.write(run_id=run_id, phase=phase, model=args.model, decode_tokens_per_s=r)
            print(f"{phase:22} {r} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
