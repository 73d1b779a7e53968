"""Probe: the pass times a server keeps when a burst of requests arrives before any measurement.

Eight `pld` requests are submitted at once to a fresh in-process `Worker` (no warm-up, nothing kept
on disk: `VIASD_NO_TIMING_CACHE=1`); the first one measures the model's pass costs of 1-5 rows, which
the process keeps. Printed and recorded: what was kept (after the requests' own learning) against a
measurement taken alone afterwards. Before session 19 the burst's measurement ran in steps shared
with the other requests' prompts.

    python benchmarks/burst_pass_times.py [--models smollm2-135m] [--out FILE]

Appends JSONL records (run id, environment with CPU flags, commit) to
benchmarks/out/burst-pass-times.jsonl (untracked).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

os.environ["VIASD_NO_TIMING_CACHE"] = "1"
sys.path.insert(0, str(Path(__file__).parent))
from common import per_model_run  # noqa: E402


def main() -> None:
    from viasd import load_model
    from viasd.execution.timing import pass_times
    from viasd.server.engine import Job, Worker

    models, run_id, records = per_model_run(__doc__, Path(__file__).parent / "out" / "burst-pass-times.jsonl")
    for name in models:
        model = load_model(name, progress=False)
        worker = Worker(model, max_batch=8, max_queue=16)
        loop = asyncio.new_event_loop()
        prompts = [f"Write a short story about a {w} who learns to fly." for w in "cat dog fish bird horse mouse frog snake".split()]
        jobs = [Job(p, {"strategy": "pld", "max_new_tokens": 48, "chat": True}, [], loop, stream=False) for p in prompts]
        for job in jobs:
            worker.submit(job)

        async def finish():
            for job in jobs:
                while (await job.next_event())[0] not in ("done", "error", "cancelled"):
                    pass

        loop.run_until_complete(finish())
        kept = list(model.decoder.pass_times[5, False])
        model.decoder.pass_times.clear()
        alone = pass_times(model.decoder, 5)
        worker.shutdown()
        records.write(run_id=run_id, model=name, kept_s=kept, alone_s=alone)
        print(f"{name}: kept {[round(t * 1e3, 1) for t in kept]} ms, alone {[round(t * 1e3, 1) for t in alone]} ms (run {run_id})")


if __name__ == "__main__":
    main()
