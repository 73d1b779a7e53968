"""Which kernel a native model's weights should take on this CPU: the default choice (`load_model`)
against ggml's layouts only (`pack="ggml"`) and the row-exact kernel for every weight
(`pack="row-exact"`), interleaved in one process: `ar` decode-only tokens/s on a few prompts, and the
time of one decoding pass of 1 and of 8 rows after a short prompt (what a batch of 8 requests costs).

    python benchmarks/pack_choice.py --models smollm2-135m,qwen2.5-coder-1.5b

One JSONL record per measurement (run id, CPU flags, which weights went to which kernel) in --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Records, environment  # noqa: E402
from load import cpu_flags  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPTS = ["Write a short story about a robot learning to paint.", "Explain photosynthesis.", "List five fruits."]
PACKS = {"default": True, "ggml": "ggml", "row-exact": "row-exact"}


def pass_ms(model, rows: int, repeats: int = 10) -> float:
    cache = model.decoder.new_cache(512)
    model.decoder.forward(torch.arange(1, 30), 0, cache)
    x = torch.arange(10, 10 + rows)
    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        model.decoder.forward(x, 29, cache)
        cache.rollback(29)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def main(argv=None) -> int:
    from viasd.api import generate
    from viasd import compute
    from viasd.models.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default=str(HERE / "out" / "pack-choice.jsonl"))
    args = p.parse_args(argv)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-pack"
    records = Records(Path(args.out), {**environment(), "cpu_flags": cpu_flags()})

    def run() -> None:
        for name in args.models.split(","):
            models = {label: load_model(name, progress=False, pack=pack) for label, pack in PACKS.items()}
            for prompt in PROMPTS:  # interleaved: each prompt on every choice in turn
                for label, m in models.items():
                    rate = generate(prompt, m, strategy="ar", max_new_tokens=args.max_tokens, progress=False).stats.decode_tokens_per_s
                    records.write(run_id=run_id, model=name, pack=label, kernels=m.kernels, prompt=prompt, decode_tokens_per_s=rate)
                    print(f"{name} {label:9} ar {rate} tok/s", flush=True)
            for label, m in models.items():
                one, eight = pass_ms(m, 1), pass_ms(m, 8)
                records.write(run_id=run_id, model=name, pack=label, kernels=m.kernels, pass_ms_1=one, pass_ms_8=eight)
                print(f"{name} {label:9} pass of 1 row {one} ms, of 8 rows {eight} ms ({m.kernels})", flush=True)

    compute.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
