"""Probe: per weight type, a product with plain weights against the same weights packed into each of
ggml's extra buffer types this CPU has (AMX, CPU_REPACK), one-row products as the forward graph runs
them (`ggml_kernels.matmul`), at 1, 4 and 8 rows; and viasd's row-exact kernel (ROW_EXACT, models/rowexact.py), which
multiplies every row of a block in one call. What `ggml_kernels._SLOWER_PACKED` is read from.

    python benchmarks/pack_types.py [--out FILE]

Random weights of Qwen2.5-1.5B's MLP shapes (8960x1536 and 1536x8960) and SmolLM2's (1536x576,
576x1536), quantized by ggml; medians of 30 calls. Appends JSONL records (run id, CPU flags) to
benchmarks/out/pack-types.jsonl (untracked); compare rows of one run only.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Records, environment, median  # noqa: E402

from viasd.models import ggml_kernels as gk  # noqa: E402
from viasd.models import rowexact  # noqa: E402
from viasd.models.native import quantize  # noqa: E402

OUT = Path(__file__).parent / "out" / "pack-types.jsonl"
TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_K": 12, "q5_K": 13, "q6_K": 14}
SHAPES = [(8960, 1536), (1536, 8960), (1536, 576), (576, 1536)]


def product_ms(w: gk.NativeTensor, rows: int, reps: int = 30) -> float:
    graph = gk._Graph(n_tensors=8)
    xt = graph.tensor(gk.F32, w.cols, rows)
    y = gk.matmul(graph, w, xt, rows)
    graph.finish(y)
    x, out = torch.randn(rows, w.cols), torch.empty(rows, w.rows)
    graph.bind(xt, x.data_ptr())
    graph.bind(y, out.data_ptr())
    for _ in range(3):
        graph.run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        graph.run()
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(args.out, {**environment(), "ggml": gk.lib().has})
    # (the row-exact kernel's AVX2 variant too: what a weight with no ggml layout here takes, `NativeTensor.pack`)
    kinds = ["plain"] + ([gk.ROW_EXACT] if rowexact.available() else []) + [name for name, _ in gk.lib().extra_buffer_types]
    g = torch.Generator().manual_seed(0)
    for rows, cols in SHAPES:
        w = torch.randn(rows, cols, generator=g) * 0.05
        for type_name, ggml_type in TYPES.items():
            if ggml_type >= 10 and cols % 256:  # K-quants: blocks of 256
                continue
            line = f"{rows}x{cols} {type_name}:"
            for kind in kinds:
                native = next(iter(quantize({"w": w}, None, ggml_type, names=["w"]).values()))
                if kind != "plain" and native.pack((kind,)) != kind:
                    line += f" {kind} -"
                    continue
                ms = {r: product_ms(native, r) for r in (1, 4, 8)}
                records.write(run_id=run_id, shape=[rows, cols], type=type_name, kernels=kind,
                              **{f"ms_{r}": round(t, 4) for r, t in ms.items()})
                line += f" {kind} {ms[1]:.3f}/{ms[4]:.3f}/{ms[8]:.3f} ms"
            print(line, flush=True)
    print(f"run {run_id}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
