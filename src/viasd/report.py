"""`viasd report`: a Markdown table and PNG plots from `viasd bench` JSONL records.

Speed-ups are ratios within the same run: per prompt, the method's tokens/s over `ar`'s on the same
prompt, then the median over prompts.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from viasd.decoding.registry import BASELINE, STRATEGIES
from viasd.errors import UsageError
from viasd.validation import atomic_write_bytes, atomic_write_text, check_writable_dir


_STATS = ("new_tokens", "tokens_per_s", "mean_accepted_length", "drafted", "accepted", "verifier_layer_passes_per_token")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _why_unusable(r: dict) -> str | None:
    """Why a bench record cannot be summarised (missing or mistyped fields), or None."""
    if "stats" not in r:
        return None if isinstance(r.get("unavailable", ""), str) else "'unavailable' is not a string"
    s = r["stats"]
    if not isinstance(s, dict):
        return "'stats' is not an object"
    bad = [k for k in _STATS if not _num(s.get(k))]
    if bad:
        return f"stats.{bad[0]} missing or not a number"
    if not isinstance(s.get("calls"), dict) or not all(_num(v) for v in s["calls"].values()):
        return "stats.calls is not an object of numbers"
    if not isinstance(s.get("tiers", {}), dict) or not all(_num(v) for v in s.get("tiers", {}).values()):
        return "stats.tiers is not an object of numbers"
    if ("full_checked" in s) != ("full_kept" in s) or ("full_checked" in s and not (_num(s["full_checked"]) and _num(s["full_kept"]))):
        return "stats.full_checked / full_kept malformed"
    if not isinstance(r.get("quality", {}), dict) or not all(_num(v) for v in r.get("quality", {}).values()):
        return "'quality' is not an object of numbers"
    if not isinstance(r.get("config", {}), dict):
        return "'config' is not an object"
    return None


def load_records(path: Path) -> list[dict]:
    """The usable records of a results file. Lines that are not records (a torn fragment of a killed
    run, a foreign or malformed line) are skipped with a one-line warning, not fatal."""
    from viasd.bench import read_records

    if not path.is_file():
        raise UsageError(f"{path}: no such results file")
    records, skipped = read_records(path)
    usable = []
    for r in records:
        why = _why_unusable(r)
        if why is None:
            usable.append(r)
        else:
            skipped += 1
    if not usable:
        raise UsageError(f"{path}: not `viasd bench` results (no complete JSON record with 'task', 'prompt_id' and 'method')")
    if skipped:
        print(f"viasd: {path}: skipped {skipped} line(s) that are not complete bench records", file=sys.stderr)
    return usable


def _full_check(record: dict) -> tuple[int, int] | None:
    """(proposed tokens the full verifier judged, kept) for a record. Records written before these
    counters existed: in the SD loop every draft is judged by the full verifier, so they equal
    (drafted, accepted); for VIA-SD they are unknown (None)."""
    s = record["stats"]
    if "full_checked" in s:
        return s["full_checked"], s["full_kept"]
    spec = STRATEGIES.get(record.get("config", {}).get("strategy"))
    if spec is not None and spec.full_checks_every_draft:
        return s["drafted"], s["accepted"]
    return None


def summarize(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(task or "overall", method) -> aggregated figures."""
    ar = {(r["task"], r["prompt_id"]): r["stats"]["tokens_per_s"] for r in records if r["method"] == BASELINE and "stats" in r}
    ar = {k: v for k, v in ar.items() if v > 0}
    # decode-only (the tokens after the first over the time after it; records since native weights)
    ar_decode = {(r["task"], r["prompt_id"]): r["stats"].get("decode_tokens_per_s")
                 for r in records if r["method"] == BASELINE and "stats" in r}
    ar_decode = {k: v for k, v in ar_decode.items() if v}
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["task"], r["method"])].append(r)
        groups[("overall", r["method"])].append(r)
    out = {}
    for key, rs in groups.items():
        ok = [r for r in rs if "stats" in r]
        if not ok:
            out[key] = {"unavailable": rs[0].get("unavailable", "no records")}
            continue
        tokens = sum(r["stats"]["new_tokens"] for r in ok)
        drafted = sum(r["stats"]["drafted"] for r in ok)
        accepted = sum(r["stats"]["accepted"] for r in ok)
        ratios = [r["stats"]["tokens_per_s"] / ar[(r["task"], r["prompt_id"])] for r in ok if ar.get((r["task"], r["prompt_id"]))]
        decode = [r["stats"]["decode_tokens_per_s"] / ar_decode[(r["task"], r["prompt_id"])] for r in ok
                  if ar_decode.get((r["task"], r["prompt_id"])) and r["stats"].get("decode_tokens_per_s")]
        tiers: defaultdict[str, int] = defaultdict(int)
        for r in ok:
            for t, n in r["stats"].get("tiers", {}).items():
                tiers[t] += n
        checks = [_full_check(r) for r in ok]
        judged = [c for c in checks if c is not None] if None not in checks else []  # (all known, or none used)
        checked = sum(c[0] for c in judged)
        quality = defaultdict(list)
        for r in ok:
            for m, v in r.get("quality", {}).items():
                quality[m].append(v)
        out[key] = {
            "prompts": len(ok),
            "speedup": statistics.median(ratios) if ratios else None,
            "decode_speedup": statistics.median(decode) if decode else None,
            "tokens_per_s": statistics.median(r["stats"]["tokens_per_s"] for r in ok),
            "mean_accepted_length": sum(r["stats"]["mean_accepted_length"] for r in ok) / len(ok),
            "rejection_rate": (drafted - accepted) / drafted if drafted else 0.0,
            # share of the proposed tokens the full verifier judged that it rejected (None: nothing judged)
            "full_rejection_rate": (checked - sum(c[1] for c in judged)) / checked if checked else None,
            "full_calls_per_token": sum(r["stats"]["calls"].get("full", 0) for r in ok) / max(tokens, 1),
            "layer_passes_per_token":
                sum(r["stats"]["verifier_layer_passes_per_token"] * r["stats"]["new_tokens"] for r in ok) / max(tokens, 1),
            # weights read per token in full verifier passes (records before this field: None)
            "full_pass_bytes_per_token": (sum(r["stats"]["bytes_read"] / r["stats"]["full_pass_bytes"] for r in ok) / max(tokens, 1)
                                          if all(r["stats"].get("full_pass_bytes") for r in ok) else None),
            "tier_shares": {t: n / max(tokens, 1) for t, n in tiers.items()} if sum(tiers.values()) else {},
            "quality": {m: sum(v) / len(v) for m, v in quality.items()},
        }
    return out


def pass_seconds(costs: dict, rows: int, bytes_read: int) -> float:
    """The time cost model's price of one pass: the model's measured time for `rows` rows (a pass of
    more rows than measured: extended by the last measured row's increment), times the share of its
    full pass' weight bytes the pass reads (a slim or resumed pass, a reduced head)."""
    times = costs["rows_s"]  # [R] seconds of a full pass of 1..R rows
    t = times[rows - 1] if rows <= len(times) else times[-1] + (rows - len(times)) * (times[-1] - (times[-2] if len(times) > 1 else 0.0))
    return t * (bytes_read / costs["full_pass_bytes"] if costs.get("full_pass_bytes") and bytes_read else 1.0)


def predicted_decode_s(record: dict) -> float | None:
    """Seconds the record's decoding costs by the time cost model (None: the record has no pass
    counts or pass costs): every pass after the first token, priced by `pass_seconds` with the
    measured pass times of the model that ran it, plus the decode's host time (`decode_host_s`: the
    time outside model passes, measured; records from before it was kept count none)."""
    costs, stats = record.get("pass_costs"), record.get("stats", {})
    passes = stats.get("passes")
    if not costs or passes is None:
        return None
    total = stats.get("decode_host_s") or 0.0
    for model, _kind, rows, bytes_read, n in passes:
        if not costs.get(model):
            return None
        total += n * pass_seconds(costs[model], rows, bytes_read)
    return total


def cost_model(records: list[dict]) -> dict[str, dict]:
    """method -> median over prompts of the predicted and the measured decode-only speed-up vs `ar`
    (the same prompt, the same run), and the median of predicted / measured decode time."""
    def decode_s(r):
        s = r["stats"]
        return s["wall_s"] - s["first_token_s"] if s.get("first_token_s") is not None and s["new_tokens"] > 1 else None

    ok = [r for r in records if "stats" in r]
    ar = {(r["task"], r["prompt_id"]): r for r in ok if r["method"] == BASELINE}
    out: dict[str, dict] = {}
    for method in dict.fromkeys(r["method"] for r in ok):
        pred, meas, fit, host = [], [], [], []
        for r in (r for r in ok if r["method"] == method):
            base = ar.get((r["task"], r["prompt_id"]))
            p, m = predicted_decode_s(r), decode_s(r)
            if base is None or p is None or not m:
                continue
            pb, mb = predicted_decode_s(base), decode_s(base)
            n, nb = r["stats"]["new_tokens"] - 1, base["stats"]["new_tokens"] - 1
            if pb and mb and n > 0 and nb > 0:
                pred.append((pb / nb) / (p / n))
                meas.append((mb / nb) / (m / n))
                fit.append(p / m)
                host.append((r["stats"].get("decode_host_s") or 0.0) / m)
        if pred:
            out[method] = {"predicted": statistics.median(pred), "measured": statistics.median(meas),
                           "time_ratio": statistics.median(fit), "host_share": statistics.median(host), "prompts": len(pred)}
    return out


def cost_model_markdown(model: dict[str, dict]) -> str:
    if not model:
        return ""
    lines = ["", "## Time cost model", "",
             "Each decoding pass priced by the measured time of a pass of as many rows of the model that ran it "
             "(`pass_costs` in the records), scaled by the share of that model's weight bytes it reads, plus the decode's "
             "host time (outside model passes: sampling, acceptance, draft conversion; measured); medians over prompts.", "",
             "| method | predicted decode speed-up vs ar | measured | predicted / measured | model time / measured time "
             "| host share of decode time |",
             "|---|---|---|---|---|---|"]
    for method, m in model.items():
        lines.append(f"| {method} | {m['predicted']:.2f}x | {m['measured']:.2f}x | {m['predicted'] / m['measured']:.2f} | "
                     f"{m['time_ratio']:.2f} | {m['host_share']:.2f} |")
    return "\n".join(lines) + "\n"


def markdown(summary: dict[tuple[str, str], dict]) -> str:
    tasks = sorted({t for t, _ in summary if t != "overall"}) + ["overall"]
    methods = list(dict.fromkeys(m for _, m in summary))
    lines = ["| task | method | speed-up vs ar | decode-only speed-up | tok/s | mean acc. len | rejection | full-model rejection "
             "| full calls/tok | layer-passes/tok | cost/tok (full passes by bytes) | tiers (accept/slim/full) | quality |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for task in tasks:
        for method in methods:
            s = summary.get((task, method))
            if s is None:
                continue
            if "unavailable" in s:
                lines.append(f"| {task} | {method} | unavailable: {s['unavailable']} | | | | | | | | | | |")
                continue
            tiers = "/".join(f"{s['tier_shares'].get(t, 0):.2f}" for t in ("accept", "slim", "full")) if s["tier_shares"] else "-"
            quality = ", ".join(f"{m} {v:.3g}" for m, v in sorted(s["quality"].items())) or "-"
            speedup = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
            full_rej = f"{s['full_rejection_rate']:.2f}" if s["full_rejection_rate"] is not None else "-"
            decode = f"{s['decode_speedup']:.2f}x" if s.get("decode_speedup") is not None else "-"
            cost = f"{s['full_pass_bytes_per_token']:.3f}" if s.get("full_pass_bytes_per_token") is not None else "-"
            lines.append(f"| {task} | {method} | {speedup} | {decode} | {s['tokens_per_s']:.1f} | {s['mean_accepted_length']:.2f} | "
                         f"{s['rejection_rate']:.2f} | {full_rej} | {s['full_calls_per_token']:.3f} | {s['layer_passes_per_token']:.3f} | "
                         f"{cost} | {tiers} | {quality} |")
    return "\n".join(lines) + "\n"


def plots(summary: dict[tuple[str, str], dict], out: Path) -> list[Path]:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    tasks = sorted({t for t, _ in summary}, key=lambda t: (t == "overall", t))
    methods = [m for m in dict.fromkeys(m for _, m in summary) if m != BASELINE]
    paths = []
    fig = Figure(figsize=(max(6, 1.2 * len(tasks)), 4))
    ax = fig.subplots()
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        ys = [summary.get((t, m), {}).get("speedup") or 0 for t in tasks]
        ax.bar([i + j * width for i in range(len(tasks))], ys, width, label=m)
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], [t.split("/")[-1] for t in tasks], rotation=30)
    ax.set(ylabel="speed-up vs ar (median)", title="speed-up per task")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, out / "speedup.png"))

    tiered = [m for m in methods if any(summary.get((t, m), {}).get("tier_shares") for t in tasks)]
    if tiered:
        fig = Figure(figsize=(5 * len(tiered), 4))
        axes = fig.subplots(1, len(tiered), squeeze=False)
        for ax, m in zip(axes[0], tiered):
            bottom = [0.0] * len(tasks)
            for tier in ("accept", "slim", "full"):
                ys = [summary.get((t, m), {}).get("tier_shares", {}).get(tier, 0) for t in tasks]
                ax.bar(range(len(tasks)), ys, bottom=bottom, label=tier)
                bottom = [b + y for b, y in zip(bottom, ys)]
            ax.set_xticks(range(len(tasks)), [t.split("/")[-1] for t in tasks], rotation=30)
            ax.set(title=f"tier shares: {m}", ylabel="share of committed tokens")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out / "tiers.png"))

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    plotted = 0
    for m in [BASELINE] + methods:
        s = summary.get(("overall", m), {})
        q = s.get("quality", {})
        if s.get("speedup") is not None and q:
            ax.scatter(s["speedup"], sum(q.values()) / len(q), label=m)
            plotted += 1
    ax.set(xlabel="speed-up vs ar (median, overall)", ylabel="mean task quality (mean of metrics)", title="quality against speed")
    if plotted:
        ax.legend(fontsize=7)
    else:  # (a legend of nothing: matplotlib warns on the user's terminal)
        ax.text(0.5, 0.5, "no method has both a speed-up and quality scores", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    paths.append(_save(fig, out / "quality_speed.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    return atomic_write_bytes(path, buf.getvalue())


COLUMNS = """
Columns: speed-up = median over prompts of tok/s / `ar`'s tok/s on the same prompt (same run);
decode-only speed-up = the same for the tokens after the first over the time after it; tok/s =
median; mean acc. len = committed tokens per verification round (bonus token included); rejection =
drafter tokens not committed / drafter tokens; full-model rejection = of the proposed tokens the full
verifier judged (drafts in SD, the slim-verified block in lossless VIA-SD, tier-3 drafts in tiered
VIA-SD), the share it rejected; full calls/tok = full-model forward passes per committed token (prefill
included); layer-passes/tok = verifier work per token, a routed pass counted by its share of layers;
tiers = shares of committed tokens accepted as drafted / settled by the slim verifier / decided by the
full model; quality = task metrics averaged over prompts.
"""


def one_run(records: list[dict], run: str | None, path: Path) -> list[dict]:
    """The records of one bench run: speeds of different runs (another load, another day) must not
    meet in one comparison. A file with several runs (a resumed bench) needs `run` to choose one;
    records written before run ids existed count as one run."""
    runs = list(dict.fromkeys(r.get("run_id") for r in records))
    if run is not None:
        chosen = [r for r in records if r.get("run_id") == run]
        if not chosen:
            raise UsageError(f"{path}: no records of run {run!r} (runs: {', '.join(str(x) for x in runs)})")
        return chosen
    if len(runs) > 1:
        counts = ", ".join(f"{x} ({sum(r.get('run_id') == x for r in records)} records)" for x in runs)
        raise UsageError(f"{path} holds {len(runs)} bench runs: {counts}; a comparison uses one run: choose it with --run ID")
    return records


def report(results: Path, out: Path, run: str | None = None) -> tuple[Path, list[Path]]:
    check_writable_dir(out, "report directory")  # before the work
    records = one_run(load_records(results), run, results)
    summary = summarize(records)
    md = atomic_write_text(out / "report.md", f"# viasd bench report: {results.name}\n\n" + markdown(summary) + COLUMNS
                           + cost_model_markdown(cost_model(records)))
    return md, plots(summary, out)
