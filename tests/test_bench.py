"""`viasd bench` and `viasd report`: metrics on known pairs, the sandbox, resume, rendering, bad input."""

from __future__ import annotations

import json
import time

import pytest

from viasd.api import GenerateConfig, generate
from viasd.bench import done_keys, load_tasks, parse_methods, run_bench
from viasd.cli import main
from viasd.datasets import human_eval
from viasd.decoding.stats import DecodeStats
from viasd.errors import UsageError
from viasd.quality import (
    answer_match,
    bleu,
    chrf,
    final_number,
    humaneval_completion,
    humaneval_pass,
    math_exact_match,
    rouge_l,
    run_untrusted,
)
from viasd.report import load_records, report, summarize


def test_metrics_on_known_pairs():
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(100.0)
    assert bleu("a b c d", "w x y z") == pytest.approx(0.0)
    assert chrf("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(100.0)
    assert rouge_l("the cat sat", "the cat sat") == pytest.approx(1.0)
    assert rouge_l("the cat", "the cat sat on the mat") == pytest.approx(2 * (1.0 * 1 / 3) / (1 + 1 / 3))  # P 1, R 1/3
    assert final_number("Natalia sold 48/2 = 24 clips in May.\n#### 72") == "72"
    assert math_exact_match("So she sold 1,234 clips.", "#### 1234") == 1.0
    assert math_exact_match("So she sold 12 clips.", "#### 1234") == 0.0
    assert answer_match("The capital is  Paris.", ["paris", "Lyon"]) == 1.0 and answer_match("Rome", ["Paris"]) == 0.0
    assert humaneval_completion("    return x\n\ndef other():\n    pass") == "    return x\n"


def test_humaneval_sandbox():
    problem = human_eval()[0]
    assert humaneval_pass(problem, problem["canonical_solution"]) == (True, "passed")
    ok, why = humaneval_pass(problem, "    return not True\n")
    assert not ok and "AssertionError" in why


@pytest.mark.parametrize("program, why", [
    ("while True:\n    pass\n", "timeout"),
    ("import os\nwhile True:\n    os.fork()\n", None),  # fork bomb: contained, whatever the error
    ("x = bytearray(8 << 30)\n", "MemoryError"),
])
def test_sandbox_contains_hostile_programs(program, why):
    start = time.monotonic()
    ok, reason = run_untrusted(program, timeout_s=3)
    assert not ok and time.monotonic() - start < 15
    if why:
        assert why in reason


def test_bad_methods_tasks_and_files(tmp_path):
    with pytest.raises(UsageError, match="unknown method 'fast'"):
        parse_methods("ar,fast")
    with pytest.raises(UsageError, match="applies to cascade and viasd-\\* only"):
        parse_methods("ar:pld")
    assert parse_methods("viasd-tiered:self")[0][1] == {"strategy": "viasd", "mode": "tiered", "draft": "self"}
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
    with pytest.raises(UsageError, match="no such results file"):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(UsageError, match="not `viasd bench` results"):
        load_records(tmp_path / "x.jsonl")


def test_bench_resumes_and_report_renders(tiny, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"prompt": p, "reference": r}) for p, r in [
        ("w1 w2 w3 w1 w2", "w3 w1"), ("w5 w6 w5 w6", "w5"), ("w9 w8 w7", "w7 w8")]) + "\n")
    prompts = load_tasks(f"file:{tasks}", None)
    methods = parse_methods("ar,pld,viasd-lossless:pld,viasd-tiered:self,sd")
    base = GenerateConfig(max_new_tokens=8, chat=False, slim_layers=(0, 1, 3))
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


def load_records_tolerant(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_bench_cli_errors(capsys):
    assert main(["bench", "--methods", "ar,turbo"]) == 2
    assert "unknown method 'turbo'" in capsys.readouterr().err
    assert main(["bench", "--tasks", "spec_bench:poetry"]) == 2
    assert "unknown Spec-Bench category" in capsys.readouterr().err


def test_two_turn_mt_bench_is_a_conversation(smollm2, tmp_path):
    """--turns 2: the second question is asked after the model's own first answer (chat template),
    each method answers both turns, and the record's statistics cover both."""
    prompts = load_tasks("spec_bench:mt_bench", 1, turns=2)
    assert prompts[0].follow_up and prompts[0].follow_up != prompts[0].text
    out = tmp_path / "two.jsonl"
    run_bench(smollm2, None, parse_methods("ar,pld"), prompts, out, GenerateConfig(max_new_tokens=6), progress=False)
    ar, pld = [json.loads(line) for line in out.read_text().splitlines()]
    first, second = ar["turns"]
    conversation = [{"role": "user", "content": prompts[0].text}, {"role": "assistant", "content": first["text"]},
                    {"role": "user", "content": prompts[0].follow_up}]
    again = generate(conversation, smollm2, strategy="ar", max_new_tokens=6, progress=False)
    assert second["token_ids"] == again.token_ids == ar["token_ids"]
    assert second["stats"]["prompt_tokens"] == len(smollm2.encode(conversation)) > first["stats"]["prompt_tokens"] + 6
    assert ar["stats"]["new_tokens"] == first["stats"]["new_tokens"] + second["stats"]["new_tokens"] == 12
    assert ar["stats"]["wall_s"] == pytest.approx(first["stats"]["wall_s"] + second["stats"]["wall_s"], abs=2e-4)
    assert [t["token_ids"] for t in pld["turns"]] == [t["token_ids"] for t in ar["turns"]]  # lossless in both turns


def test_conversation_prompts(tiny):
    """Chat messages are checked; without a chat template their contents are joined by blank lines."""
    conversation = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w4"}]
    assert tiny.encode(conversation, chat=False) == tiny.encode("w1 w2\n\nw3\n\nw4", chat=False)
    r = generate(conversation, tiny, strategy="ar", max_new_tokens=3, chat=False, progress=False)
    assert r.stats.prompt_tokens == 4
    with pytest.raises(UsageError, match="must end with a user message"):
        generate(conversation[:2], tiny, chat=False, progress=False)
    with pytest.raises(UsageError, match="message 0"):
        generate([{"role": "robot", "content": "w1"}], tiny, chat=False, progress=False)
    with pytest.raises(UsageError, match="message 1"):
        generate([{"role": "user", "content": "w1"}, 5], tiny, chat=False, progress=False)


def test_stats_merge_adds_up():
    a, b = DecodeStats(prompt_tokens=5), DecodeStats(prompt_tokens=9)
    a.observe_call("full", 3, verifier_share=1.0), b.observe_call("slim", 2, verifier_share=0.5)
    a.observe_round(4, 2), b.observe_round(2, 2), b.observe_round(5, 0)
    a.observe_tokens(3), b.observe_tokens(6)
    a.observe_tiers([1, 3, 3]), b.observe_tiers([2] * 6)
    m = a.merge(b).to_dict()
    assert m["calls"] == {"full": 3, "slim": 2} and m["new_tokens"] == 9 and m["prompt_tokens"] == 14
    assert m["verifier_layer_passes_per_token"] == pytest.approx(4.0 / 9, abs=1e-4)
    assert (m["drafted"], m["accepted"], m["rounds"]) == (11, 4, 3)
    assert m["acceptance_per_position"] == pytest.approx([2 / 3, 2 / 3, 0.0, 0.0, 0.0], abs=1e-4)
    assert m["tiers"] == {"accept": 1, "slim": 6, "full": 2}
