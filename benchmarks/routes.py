"""Route benchmark (issue 3): DIMR routes against baseline routes of the same budget.

Baselines: first-k layers (early exit), every other layer, evenly spaced, random masks (mean of
5 seeds). Reports KL(full || routed) and top-1 agreement on the calibration set, JSONL + table + PNG.

    python benchmarks/routes.py --model smollm2-135m --budgets 0.25,0.5,0.75 --trials 100
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Records, environment  # noqa: E402

from viasd.models.loading import load_model  # noqa: E402
from viasd.models.kvcache import LayerMask  # noqa: E402
from viasd.routing.search import build_calibration, evaluate_model, evaluate_route, search_route  # noqa: E402


def every_other(n: int, m: int) -> list[int]:
    """Skip odd layers (1, 3, ...) first, then even ones (2, 4, ...), until m layers remain:
    exactly every other layer at budget 0.5."""
    order = list(range(1, n, 2)) + list(range(2, n, 2))
    return sorted(set(range(n)) - set(order[: n - m]))


def baselines(n: int, m: int, seeds: int = 5) -> dict[str, list[list[int]]]:
    evenly = sorted({round(i * (n - 1) / max(m - 1, 1)) for i in range(m)})
    return {
        "first-k": [list(range(m))],
        "every-other": [every_other(n, m)],
        "evenly-spaced": [evenly],
        "random": [sorted(random.Random(s).sample(range(n), m)) for s in range(seeds)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="0.25,0.5,0.75")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "routes.jsonl")
    ap.add_argument("--routes-dir", type=Path, default=Path(__file__).parent / "out" / "routes")
    ap.add_argument("--ablation", metavar="MODEL", help="also score this independent smaller model (same tokenizer) against the full model")
    ap.add_argument("--calib-seqs", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=128)
    args = ap.parse_args()
    rec = Records(args.out, environment())
    model = load_model(args.model)
    calib = build_calibration(model, n_seqs=args.calib_seqs, seq_len=args.calib_len)
    n = model.config.n_layers
    rows = []
    for budget in [float(b) for b in args.budgets.split(",")]:
        m = max(1, round(budget * n))
        storage = f"sqlite:///{(args.routes_dir / f'{args.model}-b{budget}.optuna.sqlite').resolve()}"
        args.routes_dir.mkdir(parents=True, exist_ok=True)
        route = search_route(model, budget, args.trials, seed=args.seed, storage=storage, calib=calib)
        route.save(args.routes_dir / f"{args.model}-b{budget}.json")
        results = {"DIMR": route.metrics}
        for name, masks in baselines(n, m).items():
            ms = [evaluate_route(model, calib, LayerMask.from_layers(n, kept)) for kept in masks]
            results[name] = {k: sum(x[k] for x in ms) / len(ms) for k in ("kl", "top1_agreement")}
        for name, metrics in results.items():
            rec.write(bench="routes", model=args.model, budget=budget, layers_kept=m, method=name,
                      kl=metrics["kl"], top1_agreement=metrics["top1_agreement"],
                      config={"trials": args.trials, "seed": args.seed, "calibration": calib.description})
            rows.append((budget, name, metrics["kl"], metrics["top1_agreement"]))
        best_baseline = min(v["kl"] for k, v in results.items() if k != "DIMR")
        print(f"budget {budget}: DIMR KL {route.metrics['kl']:.3f} vs best baseline {best_baseline:.3f} "
              f"(margin {best_baseline - route.metrics['kl']:.3f})", flush=True)
    if args.ablation:
        other = load_model(args.ablation)
        metrics = evaluate_model(other, calib)
        rec.write(bench="routes", model=args.model, method=f"independent:{args.ablation}", kl=metrics["kl"],
                  top1_agreement=metrics["top1_agreement"], config={"calibration": calib.description})
        rows.append(("-", f"independent {args.ablation}", metrics["kl"], metrics["top1_agreement"]))
        print(f"ablation: {args.ablation} KL {metrics['kl']:.3f}, top-1 agreement {metrics['top1_agreement']:.3f}", flush=True)
    print("\n| budget | route | KL(full||routed) | top-1 agreement |\n|---|---|---|---|")
    for b, name, kl, agree in rows:
        print(f"| {b} | {name} | {kl:.3f} | {agree:.3f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r[1] for r in rows if r[0] != "-"):
        pts = [(b, kl) for b, nm, kl, _ in rows if nm == name]
        ax.plot(*zip(*pts), marker="o", label=name)
    for b, name, kl, _ in rows:
        if b == "-":
            ax.axhline(kl, color="gray", linestyle="--", label=name)
    ax.set(xlabel="budget (fraction of layers kept)", ylabel="KL(full || routed)", yscale="log", title=args.model)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
