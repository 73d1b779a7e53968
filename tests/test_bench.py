"""`viasd bench`: methods and tasks, resume after a kill, records, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from viasd.bench import done_keys, load_tasks, parse_methods, run_bench
from viasd.cli import main
from viasd.errors import UsageError

from support import BENCH_BASE, BENCH_METHODS, bench_tasks, load_records_tolerant


def test_bad_methods_tasks_and_files(tmp_path):
    with pytest.raises(UsageError, match="unknown method 'fast'"):
        parse_methods("ar,fast")
    with pytest.raises(UsageError, match="applies to cascade and viasd-\\* only"):
        parse_methods("ar:pld")
    assert parse_methods("viasd-tiered:self")[0][1] == {"strategy": "viasd", "mode": "tiered", "draft": "self"}
    assert parse_methods("pld+fixed,cascade:model+adapt") == [
        ("pld+fixed", {"strategy": "pld", "adapt_k": False}),
        ("cascade:model+adapt", {"strategy": "cascade", "draft": "model", "adapt_k": True})]
    assert parse_methods("viasd-tiered:pld+fixed")[0][1] == {"strategy": "viasd", "mode": "tiered", "draft": "pld", "adapt_k": False}
    assert parse_methods("viasd-tiered:pld+correct+fixed")[0][1] == {
        "strategy": "viasd", "mode": "tiered", "draft": "pld", "correct": True, "adapt_k": False}
    for bad in ("viasd-lossless+correct", "pld+correct"):
        with pytest.raises(UsageError, match=r"\+correct applies to viasd-tiered only"):
            parse_methods(bad)
    assert parse_methods("viasd-lossless:model+fixed")[0][1] == {"strategy": "viasd", "mode": "lossless", "draft": "model",
                                                                 "adapt_k": False}
    for bad in ("ar+adapt", "pld+fast"):
        with pytest.raises(UsageError, match=r"the modifiers are \+adapt and \+fixed"):
            parse_methods(bad)
    with pytest.raises(UsageError, match="unknown task 'spec-bench'"):
        load_tasks("spec-bench", 1)
    with pytest.raises(UsageError, match="unknown Spec-Bench category 'poetry'"):
        load_tasks("spec_bench:poetry", 1)
    with pytest.raises(UsageError, match="file:.*nope.jsonl: no such file"):
        load_tasks(f"file:{tmp_path / 'nope.jsonl'}", 1)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(UsageError, match="bad.jsonl:2: each line needs a string field 'prompt'"):
        load_tasks(f"file:{tmp_path / 'bad.jsonl'}", None)
    assert len(load_tasks("spec_bench:translation,human_eval", 2)) == 4


def test_file_tasks_name_their_metric(tiny, tmp_path):
    """A `file:` task's rows may name their quality metric (a "metric" field), or the task may name
    one for every row (`file:PATH:METRIC`); by default such rows get ROUGE-L."""
    rows = [{"prompt": "The answer is", "reference": "42", "metric": "exact_match"},
            {"prompt": "Say hello", "reference": "hello there"},
            {"prompt": "Name a colour", "reference": ["red", "blue"], "metric": "answer_match"}]
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_tasks(f"file:{data}", None) + load_tasks(f"file:{data}:bleu", None)
    assert [p.metric for p in prompts] == ["exact_match", None, "answer_match", "exact_match", "bleu", "answer_match"]
    out = tmp_path / "results.jsonl"
    assert run_bench(tiny, None, parse_methods("ar"), prompts, out, BENCH_BASE, progress=False) == 6
    quality = [sorted(r["quality"]) for r in load_records_tolerant(out)]
    assert quality == [["exact_match"], ["rougeL"], ["answer_match"], ["exact_match"], ["bleu", "chrf"], ["answer_match"]]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "p", "reference": "r", "metric": "accuracy"}\n')
    with pytest.raises(UsageError,
                       match="bad.jsonl:1: unknown metric 'accuracy': choose from rougeL, bleu, chrf, exact_match, answer_match"):
        load_tasks(f"file:{tmp_path / 'bad.jsonl'}", None)
    with pytest.raises(UsageError, match="no such file"):  # an unknown suffix is part of the path
        load_tasks(f"file:{data}:accuracy", None)


def test_bench_resumes_and_reports_unavailable_methods(tiny, tmp_path):
    prompts, methods, base = bench_tasks(tmp_path), parse_methods(BENCH_METHODS), BENCH_BASE
    out = tmp_path / "results.jsonl"
    assert run_bench(tiny, None, methods, prompts, out, base, progress=False) == 15
    assert run_bench(tiny, None, methods, prompts, out, base, progress=False) == 0  # all done: skipped
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:-2]) + "\n" + lines[-2][:20])  # lose one record, tear another
    assert run_bench(tiny, None, methods, prompts, out, base, progress=False) == 2
    assert len(done_keys(out)) == 15
    records = load_records_tolerant(out)
    sd = [r for r in records if r["method"] == "sd"]
    assert all(r["unavailable"] == "needs --drafter" for r in sd)  # reported, not faked
    ar = {r["prompt_id"]: r["token_ids"] for r in records if r["method"] == "ar"}
    for r in records:
        if r["method"] in ("pld", "viasd-lossless:pld"):
            assert r["token_ids"] == ar[r["prompt_id"]]  # lossless methods in the bench too
        assert r["env"]["torch"] and "config" in r or "unavailable" in r


def test_bench_cli_errors(capsys, tmp_path):
    assert main(["bench", "--methods", "ar,turbo"]) == 2
    assert "unknown method 'turbo'" in capsys.readouterr().err
    assert main(["bench", "--slim-route", str(tmp_path / "none.json"), "--out", str(tmp_path / "r.jsonl")]) == 2
    assert "none.json" in capsys.readouterr().err and not (tmp_path / "r.jsonl").exists()
    assert main(["bench", "--tasks", "spec_bench:poetry"]) == 2
    assert "unknown Spec-Bench category" in capsys.readouterr().err


def test_methods_name_their_drafter_and_run_with_it(tiny, tiny_drafter, tmp_path, capsys):
    """METHOD@MODEL drafts with that --drafter; others with the first; one not given is reported."""
    methods = parse_methods("ar,sd@a,sd+fixed@b,sd,sd@c")
    assert [m for _, m in methods][1:] == [{"strategy": "sd", "drafter": "a"}, {"strategy": "sd", "adapt_k": False, "drafter": "b"},
                                           {"strategy": "sd"}, {"strategy": "sd", "drafter": "c"}]
    with pytest.raises(UsageError, match="@DRAFTER names the drafter model of sd"):
        parse_methods("pld@a")
    out = tmp_path / "r.jsonl"
    run_bench(tiny, {"a": tiny_drafter, "b": tiny}, methods, bench_tasks(tmp_path), out, BENCH_BASE, progress=False)
    records = load_records_tolerant(out)
    by = lambda m: [r for r in records if r["method"] == m]  # noqa: E731
    assert all(r["config"]["drafter"] == tiny_drafter.name for r in by("sd@a") + by("sd"))
    assert all(r["config"]["drafter"] == tiny.name for r in by("sd+fixed@b"))
    self_drafted = [r["stats"] for r in by("sd+fixed@b")]  # the verifier drafting for itself: all accepted
    assert sum(s["drafted"] for s in self_drafted) > 0 and all(s["accepted"] == s["drafted"] for s in self_drafted)
    assert all(r["unavailable"] == "needs --drafter c" for r in by("sd@c"))
    for m in ("sd@a", "sd+fixed@b"):
        assert [r["token_ids"] for r in by(m)] == [r["token_ids"] for r in by("ar")]
    assert main(["bench", "--methods", "ar,sd@smollm2-135m", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "names drafter(s) smollm2-135m that no --drafter gives" in capsys.readouterr().err


def test_records_name_the_commit_of_the_checkout_viasd_runs_from(tmp_path, monkeypatch):
    """Every bench record's `env` says which code produced it: the checkout's commit ("-dirty" when
    its tracked files differ), None where viasd is not a git checkout (an installed wheel)."""
    import subprocess

    import viasd.bench as bench

    head = subprocess.run(["git", "-C", str(Path(bench.__file__).parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("viasd is not running from a git checkout here")
    assert bench.environment()["git_commit"].removesuffix("-dirty") == head.stdout.strip()
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "bench.py"))
    assert bench.source_commit() is None


def test_recorded_pass_costs_are_measured_not_the_policys_learnt_times(tiny):
    """The cost model's pass times are measured for the record (9 rounds), never the draft-length
    policy's table of the same row count, which requests learn into (`--k 9`: the same key)."""
    from viasd.api import GenerateConfig
    from viasd.bench import pass_costs

    base = GenerateConfig(k=9)
    rows = max(base.k, base.viasd.full_block) + 2
    learnt = [9.0 + j for j in range(rows)]  # seconds no pass of the tiny model takes
    tiny.decoder.pass_times = {(rows, False): list(learnt)}
    try:
        costs = pass_costs(tiny, base)
        assert len(costs["rows_s"]) == rows and all(t > 0 and t not in learnt for t in costs["rows_s"])
        assert tiny.decoder.pass_times == {(rows, False): learnt}  # the policy's table as it was
    finally:
        tiny.decoder.pass_times.clear()


def test_a_drafter_given_as_model_and_format_runs_in_that_format(fake_gguf, tmp_path, capsys):
    """`-d MODEL:FORMAT`: the same drafter in two weight formats within one run, each record saying
    which; both leave sd's output ar's."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "w1 w2 w3 w1 w2"}) + "\n")
    out = tmp_path / "r.jsonl"
    d = str(fake_gguf)
    assert main(["bench", "-m", d, "-d", f"{d}:native", "-d", f"{d}:q4_0", "--methods", f"ar,sd@{d}:native,sd@{d}:q4_0",
                 "--tasks", f"file:{tasks}", "-n", "8", "--out", str(out), "-q"]) == 0, capsys.readouterr().err
    records = {r["method"].rpartition(":")[2]: r for r in load_records_tolerant(out)}
    assert {m: r["weights"]["drafter"] for m, r in records.items()} == {"ar": None, "native": "native", "q4_0": "q4_0"}
    assert records["native"]["token_ids"] == records["q4_0"]["token_ids"] == records["ar"]["token_ids"]
