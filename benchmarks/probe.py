"""Quick VIA-SD probe: `ar`, SD with the same drafter, and `viasd` on the first Spec-Bench prompt of
each category (six prompts), aggregate tok/s and verifier layer-passes per token. Used to measure a
change to the VIA-SD loops or a route before changing a default (minutes, not hours).

    python benchmarks/probe.py --model smollm2-135m --draft self,pld
    python benchmarks/probe.py --model qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --draft model \\
        --slim-route benchmarks/out/routes/qwen2.5-coder-1.5b-b0.75.json --skip ar,sd
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Records, environment  # noqa: E402

from viasd.api import generate  # noqa: E402
from viasd.datasets import SPEC_BENCH_CATEGORIES, spec_bench  # noqa: E402
from viasd.models.loading import load_model  # noqa: E402

SAME_DRAFTER_SD = {"self": "self-sd", "pld": "pld", "model": "sd"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", help="drafter model, for --draft model")
    ap.add_argument("--draft", default="self,pld", help="drafter kinds to probe: self, pld, model (default: %(default)s)")
    ap.add_argument("--mode", default="lossless", choices=("lossless", "tiered"))
    ap.add_argument("--slim-route", help="slim route JSON (default: the shipped one)")
    ap.add_argument("--skip", default="", help="comma-separated: ar, sd (the same-drafter SD), viasd")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "probe.jsonl"))
    args = ap.parse_args()
    model = load_model(args.model)
    drafter = load_model(args.drafter) if args.drafter else None
    prompts = [spec_bench(c)[0]["turns"][0] for c in SPEC_BENCH_CATEGORIES]
    records = Records(Path(args.out), environment())
    skip = set(args.skip.split(","))
    for kind in args.draft.split(","):
        for method in [m for m in ("ar", "sd", "viasd") if m not in skip]:
            settings = {"strategy": SAME_DRAFTER_SD[kind] if method == "sd" else method, "max_new_tokens": args.max_new_tokens}
            if method == "viasd":
                settings.update(draft=kind, mode=args.mode, slim_route=args.slim_route)
            uses_model = kind == "model" and method != "ar"
            wall = tokens = passes = 0.0
            for prompt in prompts:
                r = generate(prompt, model, drafter=drafter if uses_model else None, progress=False, **settings)
                wall += r.stats.wall_s
                tokens += r.stats.new_tokens
                passes += r.stats.verifier_layer_passes
            rec = records.write(bench="probe", model=args.model, drafter=args.drafter, draft=kind, method=method,
                                config=settings, prompts=len(prompts), tokens_per_s=tokens / wall,
                                layer_passes_per_token=passes / tokens)
            print(f"{kind:6s} {settings['strategy']:8s} {rec['tokens_per_s']:6.2f} tok/s  "
                  f"{rec['layer_passes_per_token']:.2f} layer-passes/token", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
