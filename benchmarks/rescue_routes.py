"""Slim routes judged at their job in the large-gap setting: agreement with the full model where the
drafter is wrong (issue 25 item 2).

For qwen2.5-coder-1.5b and a drafter of any vocabulary (default smollm2-135m), on the DIMR calibration
set (Spec-Bench dev split, the full model's own greedy continuations): each route's KL, top-1
agreement, and both over the positions where the drafter's teacher-forced greedy token is not the
full model's (`routing.search.drafter_misses`). Routes: the shipped slim route and any route files
given (e.g. one searched with `viasd search --cost kl_where_drafter_wrong --rescue-drafter ...`).
One JSONL record per route, with the run id and the environment.

    python benchmarks/rescue_routes.py benchmarks/results/routes-D/qwen2.5-coder-1.5b.rescue-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from viasd.bench import environment
from viasd import compute
from viasd.models.loading import load_model
from viasd.routing.resolve import resolve_route
from viasd.routing.search import build_calibration, drafter_misses, evaluate_route, route_costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("routes", nargs="*", help="route files besides the shipped slim route")
    p.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", "-d", default="smollm2-135m")
    p.add_argument("--calib-seqs", type=int, default=8)
    p.add_argument("--out", "-o", default=str(Path(__file__).parent / "out" / "rescue-routes.jsonl"))
    args = p.parse_args()
    model, drafter = load_model(args.model, progress=False), load_model(args.drafter, progress=False)
    calib = build_calibration(model, n_seqs=args.calib_seqs, progress=False)
    calib.misses = drafter_misses(model, drafter, calib)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + os.urandom(3).hex()
    env = environment()
    missed, total = sum(int(m.sum()) for m in calib.misses), sum(m.numel() for m in calib.misses)
    print(f"{args.drafter} is wrong at {missed} of {total} calibration positions")
    with open(args.out, "a") as f:
        for name in [None, *args.routes]:
            resolved = resolve_route(model, "slim", None, name)
            metrics = evaluate_route(model, calib, resolved.mask)
            metrics.update(route_costs(model, resolved.mask, resolved.vocab))
            record = {"run_id": run_id, "model": args.model, "drafter": args.drafter, "route": str(resolved.path),
                      "kept_layers": resolved.mask.fraction, "drafter_wrong": missed, "positions": total,
                      "calibration": calib.description, "metrics": metrics, "env": env}
            f.write(json.dumps(record) + "\n")
            print(f"{resolved.path}: KL {metrics['kl']:.3f}, top-1 {metrics['top1_agreement']:.3f}; where the drafter "
                  f"is wrong: KL {metrics['kl_where_drafter_wrong']:.3f}, top-1 {metrics['top1_agreement_where_drafter_wrong']:.3f}; "
                  f"reads {metrics['weight_bytes_fraction']:.2f} of a full pass")


if __name__ == "__main__":
    compute.run(main)
