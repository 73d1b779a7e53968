"""Probe: quality against decode speed, so that lossy methods are compared at matched quality.

One run, every point interleaved per prompt, held-out prompts only (Spec-Bench's first prompts of
each category, question_id % 5 != 0; thresholds and routes come from the dev split):
- `ar`, the reference; the lossless two-tier baselines (`pld` and `self-sd`, or `sd` with --drafter);
- `cascade` over its deferral parameter (OPT rule, alpha in ALPHAS), with the same drafter model (or,
  without one, the shipped drafting route: its rule needs a drafter's distribution);
- tiered VIA-SD over a curve of thresholds (accept / slim in TIERED, from "everything to the full
  model" to "the slim verifier settles everything"), with the same drafter.
Each point's quality: the share of its tokens equal to the full model's greedy choice given its own
prefix (`calibrate.greedy_agreement`), the share of positions equal to `ar`'s output, and the task
metrics (`quality.score`); its speed: the median over prompts of its decode-only and wall speed over
`ar`'s on the same prompt. Records go to benchmarks/out/frontier-MODEL.jsonl (run id, settings,
environment with CPU flags), the plot beside them.

    python benchmarks/frontier.py -m smollm2-135m [--limit 2] [-n 128]
    python benchmarks/frontier.py -m qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --limit 1 -n 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Records, environment  # noqa: E402

from viasd import generate  # noqa: E402
from viasd.bench import load_tasks  # noqa: E402
from viasd.calibrate import greedy_agreement  # noqa: E402
from viasd.models.loading import load_model  # noqa: E402
from viasd.quality import score  # noqa: E402

RESULTS = Path(__file__).parent / "out"
ALPHAS = (0.0, 0.05, 0.1, 0.2, 0.4)
# (accept, slim): tier 1 when the slim verifier's probability of the draft reaches `accept`, tier 2
# when its top probability reaches `slim`; 2 switches a tier off
TIERED = ((2.0, 2.0), (0.97, 0.9), (0.9, 0.7), (0.7, 0.5), (0.5, 0.3), (0.0, 0.0))


def points(draft: str, lossless: str) -> dict[str, dict]:
    """Without a drafter model, VIA-SD drafts by n-gram lookup (setting A) and cascades, whose rule
    reads the drafter's distribution, with the verifier's shipped drafting route (`self-sd` its
    lossless counterpart)."""
    out = {"ar": {"strategy": "ar"}, lossless: {"strategy": lossless}}
    if draft == "pld":
        out["self-sd"] = {"strategy": "self-sd"}
    for a in ALPHAS:
        out[f"cascade alpha={a}"] = {"strategy": "cascade", "draft": "self" if draft == "pld" else draft, "rule": "opt", "alpha": a}
    for acc, slim in TIERED:
        out[f"viasd-tiered accept={acc} slim={slim}"] = {"strategy": "viasd", "mode": "tiered", "draft": draft,
                                                         "accept": acc, "accept_draft": 0.0 if acc < 1 else 0.5, "slim": slim}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--drafter", "-d", help="drafter model (sd, cascade and VIA-SD draft with it); default: pld drafts")
    ap.add_argument("--tasks", default="spec_bench")
    ap.add_argument("--limit", type=int, default=2, help="prompts per task (default: %(default)s)")
    ap.add_argument("--max-new-tokens", "-n", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or RESULTS / f"frontier-{args.model}.jsonl"
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(out, environment())
    model = load_model(args.model, progress=False)
    drafter = load_model(args.drafter, progress=False) if args.drafter else None
    table = points("model" if drafter else "pld", "sd" if drafter else "pld")
    prompts = [p for p in load_tasks(args.tasks, args.limit) if not (p.task.startswith("spec_bench") and int(p.id) % 5 == 0)]
    common = {"max_new_tokens": args.max_new_tokens, "k": args.k}
    uses = lambda settings: drafter if settings["strategy"] == "sd" or settings.get("draft") == "model" else None  # noqa: E731
    for settings in table.values():  # warm-up: graphs built, pass costs measured
        generate("Hello", model, drafter=uses(settings), progress=False, **{**common, **settings, "max_new_tokens": 4})
    rows: dict[str, list[dict]] = {name: [] for name in table}
    for prompt in prompts:
        reference = None
        ids = model.encode(prompt.text, prompt.chat)
        for name, settings in table.items():
            r = generate(ids, model, drafter=uses(settings), progress=False, **common, **settings)
            if name == "ar":
                reference = r.token_ids
            same = sum(a == b for a, b in zip(r.token_ids, reference)) / max(len(reference), 1)
            s = r.stats.to_dict()
            row = records.write(run_id=run_id, task=prompt.task, prompt_id=prompt.id, point=name, settings=settings,
                                model=args.model, drafter=args.drafter, new_tokens=s["new_tokens"],
                                decode_tokens_per_s=s["decode_tokens_per_s"], tokens_per_s=s["tokens_per_s"],
                                agreement=greedy_agreement(model, ids, r.token_ids) / max(len(r.token_ids), 1),
                                same_as_ar=round(same, 4), settled_without_full=s["settled_without_full"],
                                recheck_disagreement=s["recheck_disagreement"],
                                full_pass_equivalents_per_token=s["full_pass_equivalents_per_token"],
                                quality=score(prompt.task, r.text, prompt.reference, prompt.problem, prompt.metric))
            rows[name].append(row)
        print(f"{prompt.task}/{prompt.id} done", flush=True)
    summary = []
    for name, rs in rows.items():
        ar = {(r["task"], r["prompt_id"]): r for r in rows["ar"]}
        decode = statistics.median(r["decode_tokens_per_s"] / ar[(r["task"], r["prompt_id"])]["decode_tokens_per_s"] for r in rs)
        wall = statistics.median(r["tokens_per_s"] / ar[(r["task"], r["prompt_id"])]["tokens_per_s"] for r in rs)
        agreement = sum(r["agreement"] * r["new_tokens"] for r in rs) / sum(r["new_tokens"] for r in rs)
        same = statistics.mean(r["same_as_ar"] for r in rs)
        summary.append((name, decode, wall, agreement, same))
        print(f"{name:38s} decode {decode:.2f}x wall {wall:.2f}x  agreement {agreement:.3f}  same as ar {same:.3f}")
    title = f"{args.model}" + (f" <- {args.drafter}" if args.drafter else " (pld drafts)") + f", run {run_id}"
    plot(summary, out.with_suffix(".png"), title)
    print(f"run {run_id}: {out}")
    return 0


def plot(summary, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for family, marker in (("cascade", "s"), ("viasd-tiered", "o")):
        pts = [(d, a) for name, d, _, a, _ in summary if name.startswith(family)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=family)
    for name, d, _, a, _ in summary:
        if not name.startswith(("cascade", "viasd")):
            ax.scatter([d], [a], marker="*", s=120, zorder=3)
            ax.annotate(name, (d, a), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("decode speed over ar (median of per-prompt ratios)")
    ax.set_ylabel("share of tokens equal to the full model's greedy choice")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
