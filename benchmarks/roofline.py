"""How close each model's passes come to the machine's memory read bandwidth (issue 41's roofline).

Decoding one token reads every weight once, so a one-row pass takes at least the model's weight bytes
over the read bandwidth. This script measures that bandwidth itself and, in the same run, each model's
passes, and prints the share of the limit each pass reaches.

- Bandwidth: a C loop (compiled here with the system compiler, `-O3 -march=native -fopenmp`) XORs a
  2 GiB buffer in 64-bit words, on one thread and on every core; the best of 5 sweeps. These VMs share
  their memory bus and the figure moves by tens of per cent within minutes, so it is measured right
  before and right after each model's passes, and each share is taken against the mean of the two.
- Passes (`viasd.execution.timing.pass_times`, native weights, after a 64-position context; medians of
  `--reps` calls, row counts interleaved): verification passes of 1..8 rows with every row's logits,
  and the drafting pass (one row, the last row's logits only, the full LM head). `--drafters
  DRAFTER@VERIFIER`: also the drafting pass of a drafter model as `sd` runs it (`load_drafter`'s
  format, Q4_0, over `drafter_head`'s reduced head where the verifier ships one).
- Bytes: `Decoder.weight_bytes` (every product's stored blocks and the LM head; norms and the
  embedding rows a pass gathers are negligible).

One JSONL record per (model, pass) with the run id, the bandwidths around it, the CPU flags and the
environment; compare rows of one run only.

    python benchmarks/roofline.py --out benchmarks/out/roofline.jsonl
    python benchmarks/roofline.py --models smollm2-135m --reps 3 --gib 0.5 --out /tmp/r.jsonl   # smoke
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment  # noqa: E402
from load import cpu_flags  # noqa: E402

MODELS = "smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"
DRAFTERS = "qwen2.5-coder-0.5b@qwen2.5-coder-1.5b"
ROWS = 8

_SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <omp.h>

/* XOR every 64-bit word of p[0..n): a read of the whole buffer (8 independent lanes, vectorized) */
static uint64_t sweep(const uint64_t *p, size_t n) {
    uint64_t s[8] = {0};
    for (size_t i = 0; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] ^= p[i + j];
    return s[0] ^ s[1] ^ s[2] ^ s[3] ^ s[4] ^ s[5] ^ s[6] ^ s[7];
}

/* bytes per second of the best of `reps` sweeps of the buffer by `threads` threads (each its share) */
double read_bandwidth(const uint64_t *p, size_t n, int threads, int reps, uint64_t *sink) {
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        uint64_t acc = 0;
        double t0 = omp_get_wtime();
        #pragma omp parallel num_threads(threads) reduction(^:acc)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            size_t lo = n / nt * t, hi = t == nt - 1 ? n : n / nt * (t + 1);
            acc ^= sweep(p + lo, hi - lo);
        }
        double dt = omp_get_wtime() - t0;
        *sink ^= acc;
        if (n * 8.0 / dt > best) best = n * 8.0 / dt;
    }
    return best;
}
"""


def read_kernel():
    """The bandwidth loop, compiled once into a temporary library."""
    d = Path(tempfile.mkdtemp(prefix="viasd-roofline-"))
    (d / "read.c").write_text(_SOURCE)
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(d / "read.so"), str(d / "read.c")],
                   check=True)
    lib = ctypes.CDLL(str(d / "read.so"))
    lib.read_bandwidth.restype = ctypes.c_double
    lib.read_bandwidth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    return lib


class Bandwidth:
    def __init__(self, gib: float):
        self.lib = read_kernel()
        self.buf = np.ones(int(gib * (1 << 30)) // 8, dtype=np.uint64)  # touched: its pages exist before timing
        self.sink = ctypes.c_uint64(0)

    def measure(self, threads: int, reps: int = 5) -> float:
        """GB/s (1e9 bytes per second)."""
        return self.lib.read_bandwidth(self.buf.ctypes.data, self.buf.size, threads, reps, ctypes.byref(self.sink)) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=MODELS, help="comma-separated zoo names (default: %(default)s)")
    p.add_argument("--reps", type=int, default=9, help="calls per pass shape (median) (default: %(default)s)")
    p.add_argument("--gib", type=float, default=2.0, help="the bandwidth buffer's size (default: %(default)s GiB)")
    p.add_argument("--drafters", default=DRAFTERS,
                   help="comma-separated DRAFTER@VERIFIER: drafting passes as sd runs them ('' for none) (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    pairs = [tuple(x.split("@")) for x in args.drafters.split(",") if x]
    if any(len(x) != 2 for x in pairs):
        p.error(f"--drafters: expected DRAFTER@VERIFIER pairs, got {args.drafters!r}")
    if args.out.exists() and args.out.stat().st_size:
        p.error(f"{args.out} is not empty: one run per file")

    from viasd import compute
    from viasd.execution.timing import pass_times
    from viasd.models.loading import load_drafter, load_model
    from viasd.routing.resolve import drafter_head

    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    env = {**environment(), "cpu_flags": cpu_flags()}
    cores = os.cpu_count() or 1
    bw = Bandwidth(args.gib)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"run {run_id}; {cores} cores; " + ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in env["cpu_flags"]))
    print(f"{'model':<20} {'pass':<14} {'MB':>7} {'ms':>8} {'GB/s':>7} {'limit GB/s':>10} {'share':>6} {'rows/1':>7}")
    # the sweeps run on viasd's compute thread: an OpenMP region opened on any other thread starts a
    # second libgomp team, and with more workers than cores every pass after it sleeps between ops
    # (viasd.compute); smollm2's pass took 14 ms instead of 3 on the AMX Xeon that way
    sweeps = lambda: (bw.measure(1), bw.measure(cores))  # noqa: E731

    def measure(name: str, weights: str, nbytes: int, passes, extra: dict | None = None) -> None:
        """`passes()` -> [(label, rows, seconds)] (the first: the one-row pass the others are compared
        with), between two bandwidth sweeps; one record each."""
        before = compute.run(sweeps)
        cases = compute.run(passes)
        after = compute.run(sweeps)
        limit = (before[1] + after[1]) / 2
        with open(args.out, "a") as f:
            for label, rows, seconds in cases:
                gbs = nbytes / seconds / 1e9
                rec = {"run_id": run_id, "model": name, "weights": weights, "pass": label, "rows": rows,
                       "last_only": not label.startswith("verify"), "seconds": seconds, "weight_bytes": nbytes, "gb_per_s": round(gbs, 3),
                       "bandwidth_gb_per_s": {"one_core_before": round(before[0], 3), "all_cores_before": round(before[1], 3),
                                              "one_core_after": round(after[0], 3), "all_cores_after": round(after[1], 3)},
                       "limit_share": round(gbs / limit, 4), "vs_one_row": round(seconds / cases[0][2], 4), "reps": args.reps,
                       **(extra or {}), "env": env}
                f.write(json.dumps(rec) + "\n")
                print(f"{name:<20} {label:<14} {nbytes / 1e6:>7.0f} {seconds * 1e3:>8.2f} {gbs:>7.1f} {limit:>10.1f} "
                      f"{gbs / limit:>6.0%} {seconds / cases[0][2]:>7.2f}")
        print(f"{'':<20} bandwidth before / after: one core {before[0]:.1f} / {after[0]:.1f}, "
              f"all cores {before[1]:.1f} / {after[1]:.1f} GB/s")

    for name in args.models.split(","):
        model = load_model(name, progress=False)
        dec = model.decoder

        def passes(dec=dec):
            verify = pass_times(dec, ROWS, reps=args.reps, keep=False)  # [ROWS] seconds, every row's logits
            draft = pass_times(dec, 1, reps=args.reps, last_only=True, keep=False)[0]
            return [("verify x1", 1, verify[0]), ("draft x1", 1, draft)] + [(f"verify x{r}", r, verify[r - 1]) for r in (2, 4, 8)]
        measure(name, getattr(model, "weights", "native"), dec.weight_bytes(None, 0, True), passes)
        del model, dec, passes
    for name, of in pairs:  # a drafter model's drafting pass as sd runs it: its format, the head it drafts with
        verifier, drafter = load_model(of, progress=False), load_drafter(name, progress=False)
        # (built on the compute thread, as generate does)
        head = compute.run(lambda verifier=verifier, drafter=drafter: drafter_head(verifier, drafter))
        measure(name, drafter.weights, drafter.decoder.weight_bytes(None, 0, head if head is not None else True),
                lambda dec=drafter.decoder, head=head:
                    [("drafter x1", 1, pass_times(dec, 1, reps=args.reps, last_only=True, keep=False, head=head)[0])],
                {"drafter_of": of, "head_vocab": len(head) if head is not None else None})
        del verifier, drafter, head
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
