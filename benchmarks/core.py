"""Core-engine benchmark (issue 2), one run on this machine, JSONL records + a table.

(a) `ar` tokens/s: viasd's lean runtime vs transformers `generate`, smollm2-135m, greedy;
(b) T(forward of 8 tokens) / T(forward of 1 token) after a 256-token cache, smollm2-135m;
(c) `sd` (qwen2.5-coder-0.5b drafter) vs `ar` on qwen2.5-coder-1.5b, greedy, HumanEval prompts,
    and transformers' `generate` with and without `assistant_model` on the same pair.

    python benchmarks/core.py --parts a,b          # minutes
    python benchmarks/core.py --parts c            # the 1.5B is slow here: run it in the background

Quote medians and ratios measured in the same run; nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Records, environment, median  # noqa: E402

from viasd import generate, load_model  # noqa: E402
from viasd.datasets import SPEC_BENCH_CATEGORIES, human_eval, spec_bench  # noqa: E402


def spec_bench_prompts(n: int) -> list[tuple[str, str]]:
    """n prompts, cycling over the six categories (first question of each, then the second, ...)."""
    by_cat = {c: spec_bench(c) for c in SPEC_BENCH_CATEGORIES}
    out = []
    for i in range(n):
        row = by_cat[SPEC_BENCH_CATEGORIES[i % 6]][i // 6]
        out.append((f"spec_bench/{row['category']}/{row['question_id']}", row["turns"][0]))
    return out


def hf_generate(hf_model, ids: list[int], max_new: int, eos: list[int], assistant=None) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
            pad_token_id=eos[0], assistant_model=assistant,
        )
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def part_a(rec: Records, n_prompts: int, max_new: int) -> list[str]:
    model = load_model("smollm2-135m", progress=False)
    hf = load_hf(model.path)
    eos = sorted(model.eos_token_ids)
    generate("Hello", model, strategy="ar", max_new_tokens=8)  # warm-up both
    hf_generate(hf, model.encode("Hello"), 8, eos)
    ours, theirs, same = [], [], 0
    for pid, prompt in spec_bench_prompts(n_prompts):
        ids = model.encode(prompt)
        r = generate(ids, model, strategy="ar", max_new_tokens=max_new)
        hf_ids, hf_s = hf_generate(hf, ids, max_new, eos)
        s = r.stats.to_dict()
        ours.append(s["tokens_per_s"])
        theirs.append(len(hf_ids) / hf_s)
        same += hf_ids == r.token_ids
        config = {"model": "smollm2-135m", "max_new_tokens": max_new, "greedy": True, "prompt_id": pid}
        rec.write(bench="core", part="a", method="viasd-ar", config=config, stats=s)
        rec.write(bench="core", part="a", method="transformers-generate", config=config,
                  stats={"new_tokens": len(hf_ids), "wall_s": hf_s, "tokens_per_s": len(hf_ids) / hf_s},
                  same_tokens_as_viasd=hf_ids == r.token_ids)
        print(f"  {pid}: viasd {s['tokens_per_s']:.1f} tok/s, transformers {len(hf_ids) / hf_s:.1f} tok/s", flush=True)
    ratio = median([a / b for a, b in zip(ours, theirs)])
    rec.write(bench="core", part="a", summary=True, median_viasd_tok_s=median(ours), median_transformers_tok_s=median(theirs),
              median_ratio=ratio, identical_outputs=f"{same}/{len(ours)}", config={"prompts": len(ours), "max_new_tokens": max_new})
    return [f"(a) ar, smollm2-135m, {len(ours)} Spec-Bench prompts, {max_new} new tokens: viasd {median(ours):.1f} tok/s, "
            f"transformers generate {median(theirs):.1f} tok/s, median ratio {ratio:.2f}x (target >= 3x); "
            f"identical greedy outputs {same}/{len(ours)}"]


def part_b(rec: Records, reps: int) -> list[str]:
    model = load_model("smollm2-135m", progress=False)
    dec = model.decoder
    cache = dec.new_cache(300)
    dec.forward(torch.randint(0, 1000, (256,)), 0, cache)
    times = {}
    for t in (1, 2, 4, 8):
        toks = torch.randint(0, 1000, (t,))
        samples = []
        for i in range(reps + 3):
            s = time.perf_counter()
            dec.forward(toks, 256, cache)
            if i >= 3:
                samples.append(time.perf_counter() - s)
            cache.rollback(256)
        times[t] = median(samples)
    rec.write(bench="core", part="b", config={"model": "smollm2-135m", "cache_tokens": 256, "reps": reps},
              median_ms={t: v * 1e3 for t, v in times.items()}, ratio_8_1=times[8] / times[1])
    return ["(b) forward after a 256-token cache, smollm2-135m: " + ", ".join(f"T{t} {v * 1e3:.1f} ms" for t, v in times.items())
            + f"; T8/T1 = {times[8] / times[1]:.2f} (target <= 1.3)"]


def part_c(rec: Records, n_prompts: int, max_new: int, k: int) -> list[str]:
    verifier = load_model("qwen2.5-coder-1.5b")
    drafter = load_model("qwen2.5-coder-0.5b")
    eos = sorted(verifier.eos_token_ids)
    problems = human_eval()[:n_prompts]
    generate("def f():", verifier, strategy="ar", max_new_tokens=4, chat=False)  # warm-up
    generate("def f():", verifier, drafter=drafter, strategy="sd", max_new_tokens=4, chat=False)
    rows: dict[str, list[dict]] = {"viasd-ar": [], "viasd-sd": []}
    for p in problems:
        ids = verifier.encode(p["prompt"], chat=False)
        ar = generate(ids, verifier, strategy="ar", max_new_tokens=max_new)
        sd = generate(ids, verifier, drafter=drafter, strategy="sd", k=k, max_new_tokens=max_new)
        assert sd.token_ids == ar.token_ids, p["task_id"]
        for name, r in (("viasd-ar", ar), ("viasd-sd", sd)):
            s = r.stats.to_dict()
            rows[name].append(s)
            rec.write(bench="core", part="c", method=name, config={"verifier": "qwen2.5-coder-1.5b", "drafter": "qwen2.5-coder-0.5b",
                      "k": k, "max_new_tokens": max_new, "prompt_id": p["task_id"]}, stats=s)
        print(f"  {p['task_id']}: ar {rows['viasd-ar'][-1]['tokens_per_s']:.2f} tok/s, "
              f"sd {rows['viasd-sd'][-1]['tokens_per_s']:.2f} tok/s, "
              f"mean accepted length {rows['viasd-sd'][-1]['mean_accepted_length']:.2f}", flush=True)
    # transformers on the same pair (loaded after ours are freed of work; same prompts)
    verifier.decoder = drafter.decoder = None  # free ~8 GB before transformers loads its copies
    hf_v, hf_d = load_hf(verifier.path), load_hf(drafter.path)
    hf_generate(hf_v, [1, 2, 3], 2, eos)
    rows["transformers-generate"], rows["transformers-assisted"] = [], []
    for p in problems:
        ids = verifier.encode(p["prompt"], chat=False)
        for name, assistant in (("transformers-generate", None), ("transformers-assisted", hf_d)):
            out, secs = hf_generate(hf_v, ids, max_new, eos, assistant)
            s = {"new_tokens": len(out), "wall_s": secs, "tokens_per_s": len(out) / secs}
            rows[name].append(s)
            rec.write(bench="core", part="c", method=name, config={"verifier": "qwen2.5-coder-1.5b", "max_new_tokens": max_new,
                      "prompt_id": p["task_id"]}, stats=s)
        print(f"  {p['task_id']}: transformers {rows['transformers-generate'][-1]['tokens_per_s']:.2f} tok/s, "
              f"assisted {rows['transformers-assisted'][-1]['tokens_per_s']:.2f} tok/s", flush=True)
    tps = {name: median([s["tokens_per_s"] for s in rs]) for name, rs in rows.items()}
    mal = median([s["mean_accepted_length"] for s in rows["viasd-sd"]])
    rec.write(bench="core", part="c", summary=True, median_tokens_per_s=tps, sd_mean_accepted_length=mal,
              ratios={"sd/ar": tps["viasd-sd"] / tps["viasd-ar"], "viasd-ar/transformers": tps["viasd-ar"] / tps["transformers-generate"],
                      "viasd-sd/transformers-assisted": tps["viasd-sd"] / tps["transformers-assisted"]})
    return [f"(c) qwen2.5-coder-1.5b, {len(problems)} HumanEval prompts, {max_new} new tokens, k={k}: "
            + ", ".join(f"{n} {v:.2f} tok/s" for n, v in tps.items())
            + f"; sd/ar {tps['viasd-sd'] / tps['viasd-ar']:.2f}x, sd mean accepted length {mal:.2f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,b", help="comma-separated subset of a,b,c (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "core.jsonl")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--c-prompts", type=int, default=5)
    ap.add_argument("--c-max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rec = Records(args.out, environment())
    lines = []
    for part in args.parts.split(","):
        print(f"part {part}", flush=True)
        if part == "a":
            lines += part_a(rec, args.prompts, args.max_new_tokens)
        elif part == "b":
            lines += part_b(rec, args.reps)
        elif part == "c":
            lines += part_c(rec, args.c_prompts, args.c_max_new_tokens, args.k)
        else:
            sys.exit(f"unknown part {part!r} (a, b, c)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
