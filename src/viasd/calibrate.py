"""Automatic thresholds for tiered VIA-SD (the paper leaves them to hand-tuning).

For a model, drafter and slim route: decode held-in calibration prompts (the Spec-Bench dev split,
question_id % 5 == 0) in tiered mode under each candidate `TierThresholds`, measure tokens/s and the
agreement of the committed tokens with the full model's greedy choice at the same prefix (one
teacher-forced full pass per decode), and keep the fastest candidate whose agreement meets the
constraint, unless it is within `MIN_GAIN` of the all-to-full candidate (plain SD, agreement 1.0),
which is always in the grid: a feasible answer always exists, and tiers are chosen only when they
measurably pay.

With a drafter that has a distribution (a drafter model or a drafting route), the grid also tries
tier 1 by the drafter's confidence alone (`draft_confident`: a round whose drafts all reach it
skips the slim pass). With `correct`, every candidate decodes in correction mode, whose output is
the full model's greedy one whatever the thresholds: the fastest candidate wins (its agreement is
still measured, as a check), and the file goes to ROUTE.correct.thresholds.json, which `--correct`
reads before ROUTE.thresholds.json.
"""

from __future__ import annotations

import io
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from viasd import compute
from viasd.api import GenerateConfig, generate
from viasd.decoding.registry import DraftKind, strategy
from viasd.decoding.tiers import TierThresholds, thresholds_beside
from viasd.errors import NotWritableError, UsageError
from viasd.models.loading import LoadedModel
from viasd.validation import (atomic_write_bytes, atomic_write_text, check_float, check_int, check_writable_file, dumps_strict,
                              open_regular, read_json)

OFF = 2.0  # a threshold above 1 switches its tier off
ALL_TO_FULL = TierThresholds(accept=OFF, slim=OFF, accept_draft=0.5, draft_confident=OFF)  # plain SD, in every grid
# a candidate must beat ALL_TO_FULL by this much to be chosen: on qwen 1.5B, 4 prompts x 48 tokens,
# candidates that run alike (no round reaching a slim pass) spread over +-3% in one calibration
MIN_GAIN = 0.05

GRIDS = {
    "small": {"accept": [0.7, 0.9, 0.97, OFF], "slim": [0.5, 0.7, 0.9, OFF], "accept_draft": [0.5],
              "draft_confident": [0.9, OFF]},
    "full": {"accept": [0.5, 0.7, 0.8, 0.9, 0.95, 0.99, OFF], "slim": [0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, OFF],
             "accept_draft": [0.0, 0.5, 0.8], "draft_confident": [0.8, 0.9, 0.95, OFF]},
}


@dataclass
class Candidate:
    thresholds: TierThresholds
    tokens: int = 0
    agreeing: int = 0
    wall_s: float = 0.0
    full_calls: int = 0

    @property
    def agreement(self) -> float:
        return self.agreeing / self.tokens if self.tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        return {"thresholds": self.thresholds.to_dict(), "tokens": self.tokens, "agreement": round(self.agreement, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "full_calls_per_token": round(self.full_calls / max(self.tokens, 1), 4)}


def check_settings(prompts: int, min_agreement: float) -> None:
    """`viasd calibrate`'s own settings, checked before any model loads."""
    check_int("--prompts", prompts, 1, 1000)
    try:
        check_float("--min-agreement", min_agreement, 0.0, 1.0, lo_open=True)
    except UsageError:
        raise UsageError(f"--min-agreement must be in (0, 1], got {min_agreement}") from None


def thresholds_path(out: str | None, route: str | None, model: str, correct: bool = False) -> Path:
    """Where the thresholds go (default: beside --route, else beside MODEL.slim.json; see
    `tiers.thresholds_beside`), checked writable up front, with the plot beside it: a calibration
    takes minutes and must not be lost."""
    path = Path(out) if out else thresholds_beside(Path(route) if route else Path(f"{Path(model).name}.slim.json"), correct)
    check_writable_file(path, "thresholds file")
    check_writable_file(path.with_suffix(".png"), "plot")
    _check_replaceable(path, path.with_suffix(".png"))
    return path


def _check_replaceable(path: Path, png: Path) -> None:
    """An existing output is overwritten only when it is one calibrate wrote (a thresholds JSON, its
    PNG plot): `--out notes.txt` must not destroy notes.txt (nor notes.png)."""
    if path.exists():
        try:
            data = read_json(path, "thresholds")
        except UsageError:
            data = None
        if not (isinstance(data, dict) and isinstance(data.get("thresholds"), dict) and isinstance(data.get("explored"), list)):
            raise NotWritableError(f"thresholds file {path} exists and is not a thresholds file written by viasd calibrate: "
                                   "refusing to overwrite it (choose another --out, or remove it)")
    if png.exists():
        try:
            with open_regular(png) as f:
                is_png = f.read(8) == b"\x89PNG\r\n\x1a\n"
        except OSError:
            is_png = False
        if not is_png:
            raise NotWritableError(f"plot {png} exists and is not a PNG image: refusing to overwrite it (choose another --out)")


def greedy_agreement(model: LoadedModel, prompt: list[int], out: list[int]) -> int:
    """How many of `out` equal the full model's greedy choice given the committed prefix.

    The prompt goes through one pass, as every strategy prefills it; the output through passes of at
    most ROW_ATTENTION_MAX rows, whose rows come out as decoding computes them (batch-invariant: see
    models/decoder.py). One long pass would not: with native weights its tiled attention rounds
    differently, and near-ties flip (plain SD scored 0.979 against itself that way)."""
    from viasd.models.kvcache import ROW_ATTENTION_MAX

    if not out:
        return 0
    dec = model.decoder
    cache = dec.new_cache(len(prompt) + len(out))
    rows = [dec.forward(torch.tensor(prompt), 0, cache, last_only=True)]  # [1, V] predicting out[0]
    for start in range(0, len(out) - 1, ROW_ATTENTION_MAX):
        chunk = out[start : min(start + ROW_ATTENTION_MAX, len(out) - 1)]
        rows.append(dec.forward(torch.tensor(chunk), len(prompt) + start, cache))  # predicting the next ones
    return int((torch.cat(rows).argmax(-1) == torch.tensor(out)).sum())


def candidates(grid: str, draft_probs: bool = True) -> list[TierThresholds]:
    """The grid's thresholds; `draft_probs`: the drafter has a distribution (else `draft_confident`,
    which reads it, stays off)."""
    g = GRIDS[grid]
    confident = g["draft_confident"] if draft_probs else [OFF]
    out = [TierThresholds(accept=a, slim=s, accept_draft=d, draft_confident=c)
           for c, a, s, d in itertools.product(confident, g["accept"], g["slim"], g["accept_draft"])]
    return [t for i, t in enumerate(out) if t not in out[:i]]


@compute.owned
def calibrate(model: LoadedModel, base: GenerateConfig, prompts: list[list[int]], drafter=None, grid: str = "small",
              min_agreement: float = 0.98, progress: bool = True) -> tuple[Candidate, list[Candidate]]:
    """Evaluate every candidate on every prompt (interleaved, so machine drift hits all alike).
    `base.viasd.correct`: correction mode, where the fastest candidate wins (see the module docstring)."""
    from tqdm import tqdm

    draft_probs = strategy("viasd").draft_kind(base.drafting.draft, drafter is not None) is not DraftKind.PLD
    cands = [Candidate(t) for t in candidates(grid, draft_probs)]
    generate(prompts[0], model, drafter=drafter, config=base, progress=False)  # warm-up
    bar = tqdm(total=len(cands) * len(prompts), desc="calibrating thresholds", disable=not progress, file=sys.stderr)
    for ids in prompts:
        for c in cands:
            config = base.replace(**c.thresholds.to_dict(), thresholds=None)
            r = generate(ids, model, drafter=drafter, config=config, progress=False)
            s = r.stats.to_dict()
            c.tokens += s["new_tokens"]
            c.wall_s += s["wall_s"]
            c.full_calls += s["calls"].get("full", 0)
            c.agreeing += greedy_agreement(model, ids, r.token_ids)
            bar.update(1)
    bar.close()
    if base.viasd.correct:  # the output is the full model's whatever the thresholds: speed decides
        min_agreement = 0.0
    feasible = [c for c in cands if c.agreement >= min_agreement]
    best = max(feasible, key=lambda c: c.tokens_per_s) if feasible else max(cands, key=lambda c: c.agreement)
    reference = next((c for c in cands if c.thresholds == ALL_TO_FULL), None)
    if reference is not None and best.tokens_per_s < (1 + MIN_GAIN) * reference.tokens_per_s:
        best = reference  # within measurement noise of plain SD: the tiers have not shown that they pay
    return best, cands


def write_thresholds(path: Path, best: Candidate, cands: list[Candidate], meta: dict) -> Path:
    data = {"thresholds": best.thresholds.to_dict(), "measured": best.to_dict(), **meta,
            "explored": [c.to_dict() for c in cands]}
    return atomic_write_text(path, dumps_strict(data, indent=1) + "\n")  # slim_entropy inf -> "inf"


def plot_curve(path: Path, best: Candidate, cands: list[Candidate], min_agreement: float | None, title: str) -> Path:
    """Speed against agreement of every candidate, the chosen one marked (and the constraint, if any)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.scatter([c.agreement for c in cands], [c.tokens_per_s for c in cands], s=18, label="candidate thresholds")
    ax.scatter([best.agreement], [best.tokens_per_s], s=80, marker="*", color="red", label="chosen")
    if min_agreement is not None:
        ax.axvline(min_agreement, color="gray", linestyle="--", label=f"constraint {min_agreement:.0%}")
    ax.set(xlabel="agreement with the full model's greedy tokens", ylabel="tokens/s", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    return atomic_write_bytes(path, buf.getvalue())
