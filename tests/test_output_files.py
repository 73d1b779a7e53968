"""Issue 26, faults 10-13: bench task files with repeated ids, repeated tasks and methods, two runs
on one output (bench results, a new Optuna database), outputs that are someone else's file, and
input files too large to read."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from viasd.api import GenerateConfig
from viasd.bench import Prompt, load_tasks, parse_methods, run_bench
from viasd.cli import main
from viasd.errors import UsageError


def one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert needle in err, err
    return err


def write_tasks(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------- 10: bench repeats


def test_duplicate_ids_in_a_task_file_are_refused_before_any_work(tmp_path, capsys):
    tasks = write_tasks(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"},
                                                 {"id": "a", "prompt": "three"}])
    with pytest.raises(UsageError, match=r"dup\.jsonl:3: duplicate id 'a' \(line 1 has it too\)"):
        load_tasks(f"file:{tasks}", None)
    # an id equal to another row's default id (its line number) collides too
    implicit = write_tasks(tmp_path / "implicit.jsonl", [{"prompt": "one"}, {"id": 1, "prompt": "two"}])
    with pytest.raises(UsageError, match="duplicate id '1'"):
        load_tasks(f"file:{implicit}", None)
    out = tmp_path / "r.jsonl"
    assert main(["bench", "--tasks", f"file:{tasks}", "--methods", "ar", "--out", str(out), "-q"]) == 2
    one_line_error(capsys, f"{tasks}:3: duplicate id 'a'")
    assert not out.exists()


def test_repeated_tasks_and_methods_run_once_in_order(tmp_path):
    tasks = write_tasks(tmp_path / "t.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    got = load_tasks(f"file:{tasks},file:{tasks}", None)
    assert [(p.task, p.id) for p in got] == [(f"file:{tasks}", "1"), (f"file:{tasks}", "2")]
    assert len(load_tasks("spec_bench,spec_bench", 1)) == len(load_tasks("spec_bench", 1))
    both = load_tasks("spec_bench:translation,spec_bench", 1)  # overlapping: translation's prompt once, first
    assert [(p.task, p.id) for p in both] == list(dict.fromkeys((p.task, p.id) for p in both))
    assert both[0].task == "spec_bench/translation" and len(both) == len(load_tasks("spec_bench", 1))
    assert [n for n, _ in parse_methods("ar,pld,ar,ar")] == ["ar", "pld"]
    assert [n for n, _ in parse_methods("sd+adapt,sd+adapt+adapt,sd+fixed")] == ["sd+adapt", "sd+fixed"]
    assert [n for n, _ in parse_methods("viasd-tiered,viasd-tiered:pld,viasd-tiered")] == ["viasd-tiered", "viasd-tiered:pld"]


def test_repeated_methods_write_each_record_once(tiny, tmp_path):
    out = tmp_path / "r.jsonl"
    prompts = load_tasks(f"file:{write_tasks(tmp_path / 't.jsonl', [{'prompt': 'w1 w2 w3'}])},file:{tmp_path / 't.jsonl'}", None)
    n = run_bench(tiny, None, parse_methods("ar,ar"), prompts, out, GenerateConfig(max_new_tokens=4), progress=False)
    assert n == 1 and len(out.read_text().splitlines()) == 1


def test_a_second_bench_on_the_same_output_is_refused(tiny, tmp_path, capsys):
    from viasd.bench import lock_path
    from viasd.errors import OutputBusyError

    out = tmp_path / "r.jsonl"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"prompt": "w1 w2 w3"}])
    with open(lock_path(out), "w") as held:  # what a running `viasd bench --out r.jsonl` holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["bench", "--tasks", f"file:{tasks}", "--methods", "ar", "--out", str(out), "-q"]) == 2
        one_line_error(capsys, f"results file {out}: another viasd bench run is writing it")
        with pytest.raises(OutputBusyError):
            run_bench(tiny, None, [("ar", {"strategy": "ar"})], [Prompt("file:x", "1", "w1 w2", False)], out,
                      GenerateConfig(max_new_tokens=2), progress=False)
    assert not out.exists() or out.read_text() == ""
    # released: the run goes ahead
    assert run_bench(tiny, None, [("ar", {"strategy": "ar"})], [Prompt("file:x", "1", "w1 w2", False)], out,
                     GenerateConfig(max_new_tokens=2), progress=False) == 1


# ------------------------------------------------------------------ 11: two searches, one database


def test_a_search_waits_while_another_creates_its_database(tmp_path):
    from viasd.routing.search import open_storage

    db = tmp_path / "s.optuna.sqlite"
    opened = []
    with open(db.with_name(db.name + ".lock"), "w") as held:  # another search creating the database
        fcntl.flock(held, fcntl.LOCK_EX)
        t = threading.Thread(target=lambda: opened.append(open_storage(f"sqlite:///{db}")))
        t.start()
        time.sleep(1.5)
        assert t.is_alive() and not opened and not db.exists()  # waits: neither creates nor moves anything aside
    t.join(60)
    assert opened and opened[0].get_all_studies() == []
    assert list(tmp_path.glob("*.corrupt*")) == []


def _open_at_once(url, barrier, results):
    from viasd.routing.search import open_storage

    barrier.wait()
    try:
        import optuna

        optuna.create_study(study_name="s", storage=open_storage(url), load_if_exists=True)
        results.put("ok")
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put(f"{type(e).__name__}: {e}")


def test_concurrent_searches_on_a_new_database_all_open_it(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for attempt in range(3):
        db = tmp_path / f"s{attempt}.optuna.sqlite"
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(f"sqlite:///{db}", barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        got = [results.get(timeout=5) for _ in procs]
        assert got == ["ok"] * 4, got
        assert list(tmp_path.glob("*.corrupt*")) == []
        assert sqlite3.connect(db).execute("select count(*) from studies").fetchone() == (1,)


# ------------------------------------------------------------------- 12: outputs that are not ours


def test_calibrate_refuses_to_overwrite_a_foreign_file(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert main(["calibrate", "--out", str(notes), "-q"]) == 2
    one_line_error(capsys, f"thresholds file {notes} exists and is not a thresholds file written by viasd calibrate")
    assert notes.read_text() == "my notes\n"
    # beside a thresholds file, a foreign notes.png is not the plot either
    from viasd.calibrate import thresholds_path

    ours = tmp_path / "notes.json"
    ours.write_text(json.dumps({"thresholds": {"accept": 0.5}, "measured": {}, "explored": []}))
    assert thresholds_path(str(ours), None, "m") == ours  # a calibrate output: overwritten as before
    (tmp_path / "notes.png").write_text("not a picture")
    with pytest.raises(UsageError, match="notes.png exists and is not a PNG image"):
        thresholds_path(str(ours), None, "m")


def test_bench_refuses_to_append_to_a_foreign_file(tmp_path, capsys):
    tasks = write_tasks(tmp_path / "t.jsonl", [{"prompt": "w1 w2 w3"}])
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nsecond line\n")
    assert main(["bench", "--tasks", f"file:{tasks}", "--methods", "ar", "--out", str(notes), "-q"]) == 2
    one_line_error(capsys, f"results file {notes} exists and holds no viasd bench records")
    assert notes.read_text() == "my notes\nsecond line\n"

    from viasd.bench import check_results_file

    record = json.dumps({"task": "file:x", "prompt_id": "1", "method": "ar"})
    for ok in ("", "\n", record + "\n", record + "\n[1]\n", '{"task": "file:x", "pro'):  # empty, ours, torn
        (tmp_path / "ok.jsonl").write_text(ok)
        assert check_results_file(tmp_path / "ok.jsonl") == tmp_path / "ok.jsonl"
    with pytest.raises(UsageError, match="is not a regular file"):
        check_results_file(Path("/dev/zero"))


# ------------------------------------------------------------------------ 13: unbounded input files


def test_input_files_over_the_cap_are_refused(tmp_path, monkeypatch):
    import viasd.validation as validation
    from viasd.decoding.tiers import load_thresholds
    from viasd.routing.route import Route

    monkeypatch.setattr(validation, "MAX_INPUT_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(UsageError, match=r"big\.json: route file is larger than 1000 bytes"):
        Route.load(big)
    with pytest.raises(UsageError, match=r"big\.json: thresholds file is larger than 1000 bytes"):
        load_thresholds(big)
    tasks = write_tasks(tmp_path / "t.jsonl", [{"prompt": "x" * 2000}])
    with pytest.raises(UsageError, match=r"t\.jsonl: task file is larger than 1000 bytes"):
        load_tasks(f"file:{tasks}", None)


@pytest.mark.parametrize("option", ["--route", "--draft-route"])
def test_dev_zero_as_a_route_is_one_line(option, capsys):
    assert main(["calibrate", option, "/dev/zero", "-q"]) == 2
    one_line_error(capsys, "/dev/zero: route file is larger than 64 MiB")


def test_dev_zero_as_thresholds_or_tasks_is_one_line(capsys):
    from viasd.api import preflight_files

    with pytest.raises(UsageError, match="/dev/zero: thresholds file is larger than 64 MiB"):
        preflight_files(GenerateConfig.from_settings(strategy="viasd", mode="tiered", thresholds="/dev/zero").flat())
    with pytest.raises(UsageError, match="/dev/zero: task file is larger than 64 MiB"):
        load_tasks("file:/dev/zero", None)
