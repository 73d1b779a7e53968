"""Resumable slim routes under a byte budget (issue 11 item 2): DIMR with its budget in weight bytes
(the slim pass' layers and its reduced LM head, `viasd search --budget-unit bytes`), one study per
prefix m (layers 0..m-1 kept whole, so a full pass resumes at layer m after a slim pass), against
the shipped slim route, on the same calibration set (the dev split).

Per route: KL(full || slim) and top-1 agreement over the calibration positions (the slim pass with
its reduced head: a full-model token outside the head is a disagreement), top-1 agreement where the
drafter is wrong (the positions a slim verifier must rescue: the drafter's greedy token differs from
the full model's), the share of a full pass' weight bytes the slim pass reads, and the share a full
pass resumed after it reads (layers from m on, and the full head). Equal cost means equal
`slim_bytes`; a round that reaches the full model reads slim_bytes + resumed_full_bytes.

    python benchmarks/resumable_routes.py -m smollm2-135m --budget 0.55 --head-vocab 16384 --prefixes 0,8,15 --trials 60
    python benchmarks/resumable_routes.py -m qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --budget 0.55 \\
        --head-vocab 32768 --prefixes 0,7,14 --trials 40

The drafter: a model (`--drafter`) or, without one, the model's shipped drafting route. Appends JSONL
records (run id, configuration, environment with CPU flags) to benchmarks/out/resumable-routes.jsonl
(untracked).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Records, environment  # noqa: E402

from viasd.models.loading import load_model  # noqa: E402
from viasd.models.kvcache import LayerMask  # noqa: E402
from viasd.routing.resolve import resolve_route  # noqa: E402
from viasd.routing.search import build_calibration, route_costs, search_route  # noqa: E402

OUT = Path(__file__).parent / "out" / "resumable-routes.jsonl"


def full_top1(calib) -> torch.Tensor:
    return torch.cat([idx[:, 0] for idx in calib.topk_idx])  # [N] the full model's greedy tokens


def greedy(model, calib, route: LayerMask | None = None, vocab=None) -> torch.Tensor:
    """[N] the greedy token at every calibration position, of `model` along `route` with the head over
    `vocab` (None: the full head)."""
    dec = model.decoder
    head = dec.reduced_head(vocab) if vocab else None
    out = []
    for seq, plen in zip(calib.sequences, calib.prompt_lens):
        cache = dec.new_cache(len(seq))
        if plen > 1:
            dec.forward(seq[: plen - 1], 0, cache)
        logits = dec.forward(seq[plen - 1 : -1], plen - 1, cache, route=route, head=head)
        ids = logits.argmax(-1)
        if head is not None and logits.shape[-1] == len(head):  # the head's N columns: back to token ids
            ids = head.ids[ids]
        out.append(ids)
    return torch.cat(out)


def measure(model, calib, mask: LayerMask, vocab, drafter_wrong: torch.Tensor, truth: torch.Tensor) -> dict:
    from viasd.routing.search import evaluate_route

    pred = greedy(model, calib, mask, vocab)
    agree = pred == truth
    return {"kl": round(evaluate_route(model, calib, mask)["kl"], 4),
            "top1_agreement": round(float(agree.float().mean()), 4),
            "top1_where_drafter_wrong": round(float(agree[drafter_wrong].float().mean()), 4),
            "prefix": mask.prefix, "kept_layers": [i for i in range(mask.n_layers) if mask.attn[i]],
            "vocab_size": len(vocab) if vocab else None,
            **{k: round(v, 4) for k, v in route_costs(model, mask, vocab).items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--drafter", "-d", help="drafter model (default: the model's shipped drafting route)")
    ap.add_argument("--budget", type=float, default=0.55, help="the slim pass' share of a full pass' weight bytes")
    ap.add_argument("--head-vocab", type=int, default=16384)
    ap.add_argument("--prefixes", default="0,8,15")
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(args.out, environment())
    model = load_model(args.model, progress=False)
    calib = build_calibration(model, progress=False)
    truth = full_top1(calib)
    if args.drafter:
        drafter = load_model(args.drafter, progress=False)
        drafted, drafter_name = greedy(drafter, calib), args.drafter
    else:
        draft = resolve_route(model, "draft", None, None)
        drafted, drafter_name = greedy(model, calib, draft.mask, draft.vocab), f"route {draft.path or 'default'}"
    wrong = drafted != truth
    config = {"model": args.model, "drafter": drafter_name, "budget_bytes": args.budget, "head_vocab": args.head_vocab,
              "trials": args.trials, "calibration": calib.description, "positions": int(truth.numel()),
              "drafter_wrong": int(wrong.sum())}
    print(f"run {run_id}: {config}", flush=True)
    shipped = resolve_route(model, "slim", None, None)
    rows = [("shipped slim route", measure(model, calib, shipped.mask, shipped.vocab, wrong, truth))]
    print(rows[-1], flush=True)
    for m in (int(x) for x in args.prefixes.split(",")):
        route = search_route(model, args.budget, args.trials, seed=0, calib=calib, progress=False, prefix=m,
                             head_vocab=args.head_vocab, budget_unit="bytes")
        rows.append((f"DIMR bytes {args.budget}, prefix {m}", measure(model, calib, route.mask, route.vocab, wrong, truth)))
        print(rows[-1], flush=True)
    for name, rec in rows:
        records.write(run_id=run_id, route=name, config=config, **rec)
    print(f"\n| route | slim bytes | resumed full bytes | KL | top-1 "
          f"| top-1 where the drafter is wrong ({int(wrong.sum())} of {truth.numel()}) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} (prefix {r['prefix']}, {len(r['kept_layers'])} layers, head {r['vocab_size'] or 'full'}) | "
              f"{r['weight_bytes_fraction']:.2f} | {r['resumed_full_fraction']:.2f} | {r['kl']:.3f} | {r['top1_agreement']:.3f} | "
              f"{r['top1_where_drafter_wrong']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
