"""Issue 14's fuzz pass: a seeded random table of command lines (run in-process through
`viasd.cli.main`, model loading stubbed: reaching it means the input was accepted) and of JSON files
(routes, thresholds, bench results, including mutations of valid ones and damaged bytes). No case
may raise past the CLI's error handling or print a traceback; every JSON reader either returns a
well-typed value or raises a UsageError. Bounded: about 30 s on two cores."""

from __future__ import annotations

import json
import math
import random
import traceback
from pathlib import Path

import pytest

from viasd.errors import UsageError

SEED = 1414
N_CLI = 600
N_JSON = 400

ROUTE = {"format": "viasd-route/1", "model": {"source": "tiny", "architecture": "llama", "n_layers": 4, "sha256": None},
         "attn": [1, 1, 0, 1], "mlp": [1, 1, 0, 1], "budget": 0.75, "metrics": {"kl": 0.1}, "search": {"seed": 0}}
THRESHOLDS = {"thresholds": {"accept": 0.9, "accept_draft": 0.5, "accept_tv": 1.0, "slim": 0.6, "slim_entropy": "inf"}}
RECORD = {"task": "spec_bench/qa", "prompt_id": "1", "method": "pld", "text": "x", "token_ids": [1, 2],
          "stats": {"new_tokens": 2, "tokens_per_s": 10.0, "mean_accepted_length": 1.5, "drafted": 4, "accepted": 1,
                    "verifier_layer_passes_per_token": 1.0, "calls": {"full": 2}, "tiers": {"accept": 0, "slim": 0, "full": 0},
                    "full_checked": 4, "full_kept": 1}, "config": {"strategy": "pld"}, "quality": {"rougeL": 0.5}}

NUMBERS = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "0", "1", "2", "0.5", "0.99", "1e309", "-0", "1e-320", str(2**64),
           str(2**64 - 1), str(2**32), str(-(2**63)), "abc", "", " ", "0x10", "1_000", "\u0663", "\udcff", "4" * 40, "1e3", "64", "65"]
TEXTS = ["hi", "", " ", "\udcff", "x\ud800y", "w " * 300, "-", "\x00", "caf\u00e9", "\U0001f600"]


def rand_json(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null", "special"] + (["list", "dict"] * 2 if depth < 3 else [])
    k = rng.choice(kinds)
    if k == "int":
        return rng.choice([0, 1, -1, 2, 4, 30, 2**64, -(2**70), rng.randint(-1000, 1000)])
    if k == "float":
        return rng.choice([0.5, -0.5, 1e308, 1e-308, 2.0, 0.0, rng.random()])
    if k == "str":
        return rng.choice(["", "0", "1", "inf", "nan", "true", "\ud800", "llama", "x" * 100, "viasd-route/1"])
    if k == "bool":
        return rng.random() < 0.5
    if k == "null":
        return None
    if k == "special":
        return rng.choice([math.nan, math.inf, -math.inf])
    if k == "list":
        return [rand_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {rng.choice(["format", "model", "attn", "mlp", "budget", "metrics", "search", "thresholds", "accept", "slim",
                        "slim_entropy", "task", "prompt_id", "method", "stats", "quality", "x"]): rand_json(rng, depth + 1)
            for _ in range(rng.randint(0, 5))}


def mutate(rng: random.Random, doc):
    """A valid document with one part replaced, removed or retyped (recursively)."""
    doc = json.loads(json.dumps(doc))
    node = doc
    for _ in range(rng.randint(0, 3)):
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            if isinstance(node[key], (dict, list)) and rng.random() < 0.6:
                node = node[key]
                continue
            action = rng.random()
            if action < 0.3:
                del node[key]
            else:
                node[key] = rand_json(rng, 2)
            return doc
        if isinstance(node, list) and node:
            i = rng.randrange(len(node))
            node[i] = rand_json(rng, 2)
            return doc
    return rand_json(rng) if rng.random() < 0.2 else doc


def json_bytes(rng: random.Random, doc) -> bytes:
    data = json.dumps(doc).encode()  # NaN / Infinity appear as the non-strict tokens, as older files hold
    r = rng.random()
    if r < 0.1:
        return data[: rng.randrange(len(data) + 1)]  # truncated
    if r < 0.2 and data:
        i = rng.randrange(len(data))
        return data[:i] + bytes([rng.randrange(256)]) + data[i + 1:]  # one damaged byte
    if r < 0.23:
        return b"\xff\xfe" + data
    return data


def documents(rng: random.Random, valid):
    return mutate(rng, valid) if rng.random() < 0.7 else rand_json(rng)


# ------------------------------------------------------------------------------------- JSON files


def test_json_file_fuzz(tmp_path):
    from viasd.decoding.tiers import load_thresholds
    from viasd.bench import done_keys
    from viasd.report import load_records, markdown, summarize
    from viasd.routing.route import Route

    rng = random.Random(SEED)
    cases, failures = 0, []
    for i in range(N_JSON):
        route_file, thr_file, results = tmp_path / f"r{i}.json", tmp_path / f"t{i}.json", tmp_path / f"b{i}.jsonl"
        route_file.write_bytes(json_bytes(rng, documents(rng, ROUTE)))
        thr_file.write_bytes(json_bytes(rng, documents(rng, THRESHOLDS)))
        lines = [json_bytes(rng, documents(rng, RECORD)) for _ in range(rng.randint(1, 4))]
        results.write_bytes(b"\n".join(lines) + (b"\n" if rng.random() < 0.7 else b""))
        for what, check in (
            ("route", lambda: _route_ok(Route.load(route_file))),
            ("thresholds", lambda: _thresholds_ok(load_thresholds(thr_file))),
            ("done_keys", lambda: done_keys(results)),
            ("report", lambda: markdown(summarize(load_records(results)))),
        ):
            cases += 1
            try:
                check()
            except UsageError as e:
                assert "\n" not in str(e)
            except Exception:
                failures.append(f"{what} #{i}: {traceback.format_exc(limit=-3)}")
    assert cases >= 4 * N_JSON
    assert not failures, failures[:3]


def _route_ok(route) -> None:
    assert all(isinstance(x, bool) for x in route.attn + route.mlp)
    route.picture()
    assert 0 <= route.fraction <= 1


def _thresholds_ok(values: dict) -> None:
    assert all(isinstance(v, float) and not math.isnan(v) for v in values.values())


# ----------------------------------------------------------------------------------- command lines


class Reached(Exception):
    """Model loading was reached: the command line passed every check."""


@pytest.fixture
def fuzz_dir(tmp_path, monkeypatch):
    from viasd.models import loading
    from viasd import report

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VIASD_CACHE", str(tmp_path / "cache"))

    def stub(*a, **k):
        raise Reached

    monkeypatch.setattr(loading, "load_model", stub)
    monkeypatch.setattr(report, "plots", lambda summary, out: [])  # matplotlib's seconds, not under test here
    rng = random.Random(SEED + 1)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "route.json").write_text(json.dumps(ROUTE))
    (tmp_path / "thr.json").write_text(json.dumps(THRESHOLDS))
    (tmp_path / "results.jsonl").write_text(json.dumps(RECORD) + "\n" + json.dumps({**RECORD, "method": "ar"}) + "\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "w1 w2"}\n')
    for i in range(20):
        (tmp_path / f"fz{i}.json").write_bytes(json_bytes(rng, documents(rng, rng.choice([ROUTE, THRESHOLDS, RECORD]))))
    return tmp_path


def paths(w: Path) -> list[str]:
    return ["route.json", "thr.json", "results.jsonl", "nope.json", "adir", "afile", "afile/x.json", "/proc/viasd/x.json",
            "\udcff.json", "new/dir/out.json", "out.json", ""] + [f"fz{i}.json" for i in range(20)]


def random_argv(rng: random.Random, w: Path) -> list[str]:
    num = lambda: rng.choice(NUMBERS)  # noqa: E731
    path = lambda: rng.choice(paths(w))  # noqa: E731
    cmd = rng.choice(["generate"] * 5 + ["search"] * 2 + ["calibrate"] * 2 + ["bench"] * 2 + ["report", "routes", "models"])
    if cmd == "generate":
        argv = ["generate", rng.choice(TEXTS)]
        options = {"--k": num, "--temperature": num, "--top-p": num, "--seed": num, "--alpha": num, "--accept": num,
                   "--accept-draft": num, "--accept-tv": num, "--slim": num, "--slim-entropy": num, "--draft-threshold": num,
                   "--full-block": num, "-n": num,
                   "--device": lambda: rng.choice(["cpu", "nonsense", "cuda", "", "cpu:0", "meta", "cuda:7"]),
                   "--strategy": lambda: rng.choice(["ar", "sd", "pld", "self-sd", "cascade", "viasd", "nope"]),
                   "--mode": lambda: rng.choice(["lossless", "tiered", "x"]), "--slim-route": path, "--draft-route": path,
                   "--thresholds": path, "--model": lambda: rng.choice(["smollm2-135m", "/nonexistent", "", "\udcff", "afile", "adir"]),
                   "--rule": lambda: rng.choice(["chow", "diff", "opt", "z"]),
                   "--draft": lambda: rng.choice(["auto", "pld", "self", "model"])}
        flags = ["--json", "-q", "--chat", "--no-chat"]
    elif cmd == "search":
        argv = ["search"]
        options = {"--budget": num, "--trials": num, "--random-trials": num, "--seed": num, "--calib-seqs": num, "--calib-len": num,
                   "--cost": lambda: rng.choice(["kl", "tv", "x"]), "--out": path,
                   "--storage": lambda: rng.choice(["sqlite:///s.sqlite", "sqlite:////proc/x.db", "nonsense://", "sqlite:///afile/x.db"])}
        flags = ["-q", "--no-pin-ends"]
        if rng.random() < 0.8:
            argv += ["--budget", rng.choice(["0.5", num()]), "--out", rng.choice(["r.json", path()])]
    elif cmd == "calibrate":
        argv = ["calibrate"]
        options = {"--prompts": num, "--min-agreement": num, "--k": num, "-n": num, "--route": path, "--out": path,
                   "--draft": lambda: rng.choice(["auto", "pld", "self"]), "--grid": lambda: rng.choice(["small", "huge"])}
        flags = ["-q"]
    elif cmd == "bench":
        argv = ["bench"]
        options = {"--limit": num, "--k": num, "-n": num, "--seed": num, "--out": path,
                   "--tasks": lambda: rng.choice(["spec_bench", "human_eval", "file:prompts.jsonl", "file:afile", "nope", "",
                                                  "spec_bench:poetry", f"file:{path()}"]),
                   "--methods": lambda: rng.choice(["ar,pld", "viasd-tiered:self", "x", "", "ar:pld", "cascade:model"]),
                   "--turns": lambda: rng.choice(["1", "2", "3"])}
        flags = ["-q"]
    elif cmd == "report":
        argv = ["report", rng.choice(["results.jsonl"] * 3 + paths(w))]
        options = {"--out": lambda: rng.choice(["rep", "afile", "/proc/rep", "adir", "new/rep"])}
        flags = []
    elif cmd == "routes":
        return ["routes", "show", path()]
    else:
        return ["models"] + rng.sample(["--json"], rng.randint(0, 1))
    for name in rng.sample(list(options), rng.randint(0, min(4, len(options)))):
        argv += [name, options[name]()]
    for flag in flags:
        if rng.random() < 0.2:
            argv.append(flag)
    return argv


def test_cli_fuzz(fuzz_dir, capsys):
    from viasd.cli import main

    rng = random.Random(SEED)
    failures, outcomes = [], {"error": 0, "usage": 0, "reached": 0, "ok": 0}
    for _ in range(N_CLI):
        argv = random_argv(rng, fuzz_dir)
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: its usage message, exit 2
            code = e.code
        except Reached:
            code = "reached"
        except Exception:
            failures.append(f"{argv!r}: {traceback.format_exc(limit=-3)}")
            continue
        out, err = capsys.readouterr()
        if "Traceback" in err or "Traceback" in out or code not in (0, 1, 2, "reached"):
            failures.append(f"{argv!r}: exit {code}: {err[-500:]}")
        outcomes[{0: "ok", 1: "error", 2: "usage", "reached": "reached"}.get(code, "error")] += 1
    assert not failures, failures[:3]
    assert sum(outcomes.values()) == N_CLI
    assert outcomes["usage"] > N_CLI // 3 and outcomes["reached"] > 10, outcomes  # the table exercises both sides
