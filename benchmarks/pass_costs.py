"""Probe: what a routed pass costs against a full pass, per model, at 1, 5 and 8 rows.

Routes: the shipped slim route (the slim verifier VIA-SD runs), the shipped drafting route where
there is one, and two reference routes: every attention sub-layer only, every MLP only (what the
rest of a layer costs beside its products). Then issue 11's two savings: a resumable route (layers
0..m-1 whole with m = half the layers, plus the last three) with the full head and with reduced
heads of 4k-32k tokens (routing/vocab.py: the calibration corpus' most frequent tokens), and the
full pass resumed at layer m after a slim pass along that route over the same rows (the slim pass
untimed). Each pass runs after a 64-token prompt on the default (native) weights, rolled back after
each call; medians of 15 calls, with the cases interleaved so that a drift of the machine's speed
touches them alike. Also the bytes each pass reads over a full pass' (`Decoder.weight_bytes`: what
`full_pass_equivalents_per_token` counts).

    python benchmarks/pass_costs.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--out FILE]

Appends JSONL records (run id, environment with CPU flags, commit) to
benchmarks/out/pass-costs.jsonl (untracked); compare rows of one run only.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import median, per_model_run  # noqa: E402

from viasd.models.loading import load_model  # noqa: E402
from viasd.models.kvcache import LayerMask  # noqa: E402
from viasd.routing.route import ModelFingerprint, Route, shipped_route_path  # noqa: E402

OUT = Path(__file__).parent / "out" / "pass-costs.jsonl"
ROWS = (1, 5, 8)
PROMPT = 64
HEADS = (4096, 8192, 16384, 32768)


def resumable_route(n: int) -> LayerMask:
    """Layers 0 .. n/2-1 whole, and the last three."""
    return LayerMask.from_layers(n, list(range(n // 2)) + [n - 3, n - 2, n - 1])


def cases(model) -> dict[str, tuple[LayerMask | None, object, bool]]:
    """label -> (route, reduced head or None, resumed full pass)."""
    from viasd.routing.vocab import calibration_vocab

    n, dec = model.config.n_layers, model.decoder
    out: dict[str, tuple] = {"full": (None, None, False)}
    for role in ("slim", "draft"):
        path = shipped_route_path(ModelFingerprint.of(model), role)
        if path is not None:
            route = Route.load(path)
            out[f"shipped {role} ({path.name})"] = (route.mask, None, False)
            if route.vocab is not None:
                out[f"shipped {role} + its head ({len(route.vocab)} tokens)"] = (route.mask, dec.reduced_head(route.vocab), False)
    out["attention only"] = (LayerMask((True,) * n, (False,) * n), None, False)
    out["MLP only"] = (LayerMask((False,) * n, (True,) * n), None, False)
    half = resumable_route(n)
    out[f"resumable: layers 0-{n // 2 - 1} + last 3"] = (half, None, False)
    for size in HEADS:
        if size < dec.lm_head.out_features:
            out[f"resumable + head of {size} tokens"] = (half, dec.reduced_head(calibration_vocab(model, size)), False)
    out[f"full pass resumed at layer {n // 2}"] = (half, None, True)
    return out


def main() -> int:
    models, run_id, records = per_model_run(__doc__, OUT)
    for name in models:
        model = load_model(name, progress=False)
        dec = model.decoder
        ids = torch.randint(100, 1000, (PROMPT + max(ROWS),), generator=torch.Generator().manual_seed(0))
        table = cases(model)
        cache = dec.new_cache(PROMPT + max(ROWS))
        cache.enable_resume(resumable_route(model.config.n_layers).prefix)  # as VIA-SD runs: passes store the stream
        dec.forward(ids[:PROMPT], 0, cache)
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(15):
            for label, (mask, head, resumed) in table.items():
                for rows in ROWS:
                    cache.rollback(PROMPT)
                    block = ids[PROMPT : PROMPT + rows]
                    if resumed:  # the slim pass that stores the stream, untimed
                        dec.forward(block, PROMPT, cache, route=mask)
                    t0 = time.perf_counter()
                    if resumed:
                        dec.forward(block, PROMPT, cache, resume=True)
                    else:
                        dec.forward(block, PROMPT, cache, route=mask, head=head)
                    times.setdefault((label, rows), []).append((time.perf_counter() - t0) * 1e3)
        for label, (mask, head, resumed) in table.items():
            ms = {rows: median(times[(label, rows)]) for rows in ROWS}
            full = {rows: median(times[("full", rows)]) for rows in ROWS}
            if resumed:  # every layer from the prefix on, and the head
                read, fraction = dec.weight_bytes(None, from_layer=mask.prefix), 1 - mask.prefix / model.config.n_layers
            else:
                read, fraction = dec.weight_bytes(mask, head=head or True), 1.0 if mask is None else mask.fraction
            records.write(run_id=run_id, model=name, kernels=model.kernels, route=label, layer_fraction=round(fraction, 4),
                          head_vocab=len(head) if head is not None else dec.lm_head.out_features,
                          bytes_fraction=round(read / dec.weight_bytes(), 4),
                          **{f"ms_{rows}": round(ms[rows], 3) for rows in ROWS},
                          **{f"of_full_{rows}": round(ms[rows] / full[rows], 3) for rows in ROWS})
            print(f"{name} {label}: " + ", ".join(f"{rows} rows {ms[rows]:.2f} ms ({ms[rows] / full[rows]:.2f} of full)" for rows in ROWS)
                  + f"; bytes {read / dec.weight_bytes():.2f} of full", flush=True)
        del model, dec, cache
    print(f"run {run_id}: {records.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
