"""`viasd report`: summaries, the Markdown table and plots from bench records; bad results files."""

from __future__ import annotations

import json

import pytest

from viasd.bench import parse_methods, run_bench
from viasd.cli import main
from viasd.errors import UsageError
from viasd.report import load_records, report, summarize

from support import BENCH_BASE, BENCH_METHODS, bench_tasks, load_records_tolerant


def test_report_renders_bench_records(tiny, tmp_path):
    out = tmp_path / "results.jsonl"
    run_bench(tiny, None, parse_methods(BENCH_METHODS), bench_tasks(tmp_path), out, BENCH_BASE, progress=False)
    records = load_records_tolerant(out)
    summary = summarize(records)
    assert summary[("overall", "ar")]["speedup"] == pytest.approx(1.0)
    assert summary[("overall", "sd")] == {"unavailable": "needs --drafter"}
    shares = summary[("overall", "viasd-tiered:self")]["tier_shares"]
    assert sum(shares.values()) == pytest.approx(1.0)
    fixture = tmp_path / "clean.jsonl"
    fixture.write_text("".join(json.dumps(r) + "\n" for r in records))
    md, pngs = report(fixture, tmp_path / "report")
    text = md.read_text()
    assert "| overall | ar | 1.00x |" in text and "unavailable: needs --drafter" in text and "full-model rejection =" in text
    assert {p.name for p in pngs} == {"speedup.png", "tiers.png", "quality_speed.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    assert main(["report", str(fixture), "--out", str(tmp_path / "r2")]) == 0


def test_report_refuses_what_is_not_bench_results(tmp_path):
    with pytest.raises(UsageError, match="no such results file"):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(UsageError, match="not `viasd bench` results"):
        load_records(tmp_path / "x.jsonl")


def test_report_compares_within_one_run(tiny, tmp_path):
    """A resumed bench holds several runs: the report refuses to mix their speeds, --run picks one,
    and records from before run ids count as one run."""
    out = tmp_path / "results.jsonl"
    methods = parse_methods("ar,pld")
    tasks = bench_tasks(tmp_path)
    run_bench(tiny, None, methods, tasks[:2], out, BENCH_BASE, progress=False)
    run_bench(tiny, None, methods, tasks, out, BENCH_BASE, progress=False)  # resumed: the third prompt
    records = load_records(out)
    runs = list(dict.fromkeys(r["run_id"] for r in records))
    assert len(runs) == 2 and all(r["weights"] == {"model": "float32", "drafter": None} for r in records)
    with pytest.raises(UsageError, match=r"holds 2 bench runs: .*\(4 records\), .*\(2 records\); .*--run ID"):
        report(out, tmp_path / "r")
    md, _ = report(out, tmp_path / "r", run=runs[1])
    assert "| overall | ar | 1.00x | 1.00x |" in md.read_text()  # decode-only speed-up column
    with pytest.raises(UsageError, match="no records of run 'nope'"):
        report(out, tmp_path / "r", run="nope")
    assert main(["report", str(out), "--out", str(tmp_path / "r3")]) == 2
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "run_id"}) + "\n" for r in records))
    report(legacy, tmp_path / "r4")  # one (unnamed) run


def test_time_cost_model_prices_each_pass_by_its_models_measured_times():
    from viasd.report import cost_model, pass_seconds, predicted_decode_s

    costs = {"rows_s": [0.010, 0.016, 0.020], "full_pass_bytes": 100}
    assert pass_seconds(costs, 2, 100) == 0.016 and pass_seconds(costs, 2, 50) == 0.008
    assert pass_seconds(costs, 5, 100) == pytest.approx(0.028)  # past the measured rows: the last increment
    drafter = {"rows_s": [0.002, 0.003], "full_pass_bytes": 10}

    def record(method, passes, decode_s, tokens):
        return {"task": "t", "prompt_id": "1", "method": method, "pass_costs": {"verifier": costs, "drafter": drafter},
                "stats": {"passes": passes, "new_tokens": tokens, "wall_s": 1.0 + decode_s, "first_token_s": 1.0}}

    ar = record("ar", [["verifier", "full", 1, 100, 20]], 0.22, 21)  # 20 one-row passes: 0.2 s predicted
    sd = record("sd", [["verifier", "full", 3, 100, 5], ["drafter", "draft", 1, 10, 10]], 0.13, 21)  # 0.1 + 0.02
    assert predicted_decode_s(ar) == pytest.approx(0.2) and predicted_decode_s(sd) == pytest.approx(0.12)
    m = cost_model([ar, sd])["sd"]
    assert m["predicted"] == pytest.approx(0.2 / 0.12) and m["measured"] == pytest.approx(0.22 / 0.13)
    assert m["time_ratio"] == pytest.approx(0.12 / 0.13)
    assert predicted_decode_s({"stats": {"passes": []}}) is None  # no pass costs recorded
    # the decode's host time (outside model passes, measured) is a term of its own
    sd["stats"]["decode_host_s"] = 0.01
    assert predicted_decode_s(sd) == pytest.approx(0.13)
    m = cost_model([ar, sd])["sd"]
    assert m["time_ratio"] == pytest.approx(1.0) and m["host_share"] == pytest.approx(0.01 / 0.13)


def test_decode_time_splits_into_model_passes_and_host_time(tiny):
    from viasd.api import generate

    s = generate([1, 5, 6, 7, 5, 6], tiny, strategy="pld", max_new_tokens=20, progress=False).stats.to_dict()
    assert s["decode_pass_s"] > 0 and s["decode_host_s"] > 0
    assert s["decode_pass_s"] + s["decode_host_s"] == pytest.approx(s["wall_s"] - s["first_token_s"], abs=2e-4)


def test_passes_are_counted_by_rows_and_model(tiny, tiny_drafter):
    from viasd.api import generate

    r = generate([1, 2, 3], tiny, drafter=tiny_drafter, strategy="sd", k=3, adapt_k=False, max_new_tokens=12, progress=False)
    passes = r.stats.to_dict()["passes"]
    full = {rows: n for model, kind, rows, _, n in passes if kind == "full"}
    assert all(model in ("verifier", "drafter") for model, *_ in passes)
    assert sum(full.values()) == r.stats.calls["full"] - 1  # every decoding pass; the prefill is not one
    assert {kind for model, kind, *_ in passes if model == "drafter"} == {"draft"}
    assert max(full) == 4  # a round verifies the last token and k = 3 drafts
