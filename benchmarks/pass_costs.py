"""Probe: what a routed pass costs against a full pass, per model, at 1, 5 and 8 rows.

Routes: the shipped slim route (the slim verifier VIA-SD runs), the shipped drafting route where
there is one, and two reference routes: every attention sub-layer only, every MLP only (what the
rest of a layer costs beside its products). Each pass runs after a 64-token prompt on the default
(native) weights, rolled back after each call; medians of 15 calls, with the routes interleaved so
that a drift of the machine's speed touches them alike. Also the bytes each pass reads over a full
pass' (`Decoder.weight_bytes`: what `full_pass_equivalents_per_token` counts).

    python benchmarks/pass_costs.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--out FILE]

Appends JSONL records (run id, environment with CPU flags, commit) to
benchmarks/results/pass-costs.jsonl; compare rows of one run only.
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

from viasd.models.loading import load_model  # noqa: E402
from viasd.models.runtime import LayerMask  # noqa: E402
from viasd.routing.route import ModelFingerprint, Route, shipped_route_path  # noqa: E402

OUT = Path(__file__).parent / "results" / "pass-costs.jsonl"
ROWS = (1, 5, 8)
PROMPT = 64


def routes(model) -> dict[str, LayerMask | None]:
    n = model.config.n_layers
    out: dict[str, LayerMask | None] = {"full": None}
    for role in ("slim", "draft"):
        path = shipped_route_path(ModelFingerprint.of(model), role)
        if path is not None:
            out[f"shipped {role} ({path.name})"] = Route.load(path).mask
    out["attention only"] = LayerMask((True,) * n, (False,) * n)
    out["MLP only"] = LayerMask((False,) * n, (True,) * n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(args.out, environment())
    for name in args.models.split(","):
        model = load_model(name, progress=False)
        dec = model.decoder
        ids = torch.randint(100, 1000, (PROMPT + max(ROWS),), generator=torch.Generator().manual_seed(0))
        cache = dec.new_cache(PROMPT + max(ROWS))
        dec.forward(ids[:PROMPT], 0, cache)
        masks = routes(model)
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(15):
            for label, mask in masks.items():
                for rows in ROWS:
                    cache.rollback(PROMPT)
                    t0 = time.perf_counter()
                    dec.forward(ids[PROMPT : PROMPT + rows], PROMPT, cache, route=mask)
                    times.setdefault((label, rows), []).append((time.perf_counter() - t0) * 1e3)
        for label, mask in masks.items():
            ms = {rows: median(times[(label, rows)]) for rows in ROWS}
            full = {rows: median(times[("full", rows)]) for rows in ROWS}
            records.write(run_id=run_id, model=name, kernels=model.kernels, route=label,
                          layer_fraction=1.0 if mask is None else round(mask.fraction, 4),
                          bytes_fraction=round(dec.weight_bytes(mask) / dec.weight_bytes(), 4),
                          **{f"ms_{rows}": round(ms[rows], 3) for rows in ROWS},
                          **{f"of_full_{rows}": round(ms[rows] / full[rows], 3) for rows in ROWS})
            print(f"{name} {label}: " + ", ".join(f"{rows} rows {ms[rows]:.2f} ms ({ms[rows] / full[rows]:.2f} of full)" for rows in ROWS)
                  + f"; bytes {dec.weight_bytes(mask) / dec.weight_bytes():.2f} of full", flush=True)
        del model, dec, cache
    print(f"run {run_id}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
