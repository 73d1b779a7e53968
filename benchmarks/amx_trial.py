"""The AMX trial kernel (rowexact.c impl 3, at this commit only) against the VNNI kernel: one
3072x576 product (smollm2's gate/up shape) of Q4_1 and Q8_0 blocks, single thread, at 1-16 rows;
checks that both give the reference kernel's results bit for bit, then prints median microseconds.

    python benchmarks/amx_trial.py
"""

import statistics
import sys
import time

import torch

from viasd.models import rowexact
from viasd.models.native import quantize

if not rowexact.amx_available():
    sys.exit("AMX is not available on this CPU")


def med(fn, reps=200):
    for _ in range(20):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


for name, ty in (("Q4_1", 3), ("Q8_0", 8)):
    w = torch.randn(3072, 576, generator=torch.Generator().manual_seed(ty)) * 0.05
    native = quantize({"w": w}, None, ty, names=["w"])["w"]
    k = rowexact.RowExactWeight(ty, native.data, 3072, 576)
    line = f"{name} 3072x576:"
    for T in (1, 4, 8, 12, 16, 64, 128):
        x = torch.randn(T, 576)
        assert torch.equal(k(x, impl=rowexact.AMX), k(x, impl=rowexact.REFERENCE))
        vnni, amx = med(lambda: k(x, impl=rowexact.VNNI)), med(lambda: k(x, impl=rowexact.AMX))
        line += f" T{T} vnni {vnni:.0f} amx {amx:.0f} |"
    print(line, flush=True)
