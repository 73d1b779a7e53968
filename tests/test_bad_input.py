"""Issue 14: bad input and faults get a clear one-line error (exit 2 for usage errors), lose nothing
and damage no file. One table for the CLI (run in-process through `viasd.cli.main`), one for the
Python API; every CLI case asserts the exit status, the one-line message, that no traceback was
printed and that no file in its working directory changed."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from viasd import errors, generate
from viasd.api import GenerateConfig
from viasd.decoding.tiers import load_thresholds
from viasd.cli import main
from viasd.models.loading import load_model
from viasd.routing.route import Route, RouteError
from viasd.validation import as_float, dumps_strict

ROUTE = {"format": "viasd-route/1", "model": {"source": "tiny", "architecture": "llama", "n_layers": 4, "sha256": None},
         "attn": [1, 1, 0, 1], "mlp": [1, 1, 0, 1], "budget": 0.75, "metrics": {}, "search": {}}


def files_of(root: Path) -> dict[str, str]:
    """Every file under root with a hash of its bytes (to show nothing was damaged)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory with good and bad input files; the cache is private."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VIASD_CACHE", str(tmp_path / "cache"))
    w = tmp_path
    (w / "route.json").write_text(json.dumps(ROUTE))
    (w / "list.json").write_text("[1, 2, 3]")
    (w / "strings.json").write_text(json.dumps({"accept": "high", "slim": "0.5"}))
    (w / "nan.json").write_text('{"accept": NaN}')
    (w / "neg.json").write_text('{"thresholds": {"slim": -1}}')
    (w / "thr-list.json").write_text('{"thresholds": [0.5]}')
    (w / "zeros.json").write_text(json.dumps({**ROUTE, "attn": ["0"] * 4, "mlp": ["0"] * 4}))
    (w / "floats.json").write_text(json.dumps({**ROUTE, "attn": [0.5] * 4}))
    (w / "nlayers.json").write_text(json.dumps({**ROUTE, "model": {**ROUTE["model"], "n_layers": "4"}}))
    (w / "nomodel.json").write_text(json.dumps({k: v for k, v in ROUTE.items() if k != "model"}))
    (w / "budget.json").write_text(json.dumps({**ROUTE, "budget": "all"}))
    (w / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (w / "empty.json").write_text("")
    (w / "latin1.json").write_bytes(b'{"accept": "\xe9"}')
    (w / "adir").mkdir()
    (w / "afile").write_text("not a directory")
    (w / "results.jsonl").write_text('[1, 2]\n"text"\n{"task": 3}\n')
    (w / "fields.jsonl").write_text(json.dumps({"task": "t", "prompt_id": "1", "method": "ar", "stats": {"new_tokens": "many"}}) + "\n")
    (w / "prompts-latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (w / "prompts-surrogate.jsonl").write_text('{"prompt": "bad \\ud800 text"}\n')
    (w / "prompts-empty.jsonl").write_text('{"prompt": "   "}\n')
    (w / "cachefile").write_text("I am a file")
    return w


def run_cli(argv, stdin: bytes | None = None, monkeypatch=None, capsys=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


S = "\udcff"  # what Python makes of the byte 0xff in a command-line argument
BIG = str(2**64)

# (id, argv, exit status, message in stderr); {w} is the working directory
CLI_CASES = [
    # 1. text that is not UTF-8
    ("prompt-surrogate", ["generate", f"caf{S}"], 2, "the prompt is not valid UTF-8 text"),
    ("prompt-lone-high-surrogate", ["generate", "x\ud800y"], 2, "the prompt is not valid UTF-8 text"),
    ("route-path-surrogate", ["generate", "hi", "--slim-route", f"r{S}.json"], 2, "slim_route is not valid UTF-8 text"),
    ("thresholds-path-surrogate", ["generate", "hi", "--thresholds", f"t{S}.json"], 2, "thresholds is not valid UTF-8 text"),
    ("bench-out-surrogate", ["bench", "--out", f"r{S}.jsonl"], 2, "--out is not valid UTF-8 text"),
    ("report-surrogate", ["report", f"r{S}.jsonl"], 2, "results is not valid UTF-8 text"),
    ("search-out-surrogate", ["search", "--budget", "0.5", "--out", f"r{S}.json"], 2, "--out is not valid UTF-8 text"),
    ("bench-file-latin1", ["bench", "--tasks", "file:{w}/prompts-latin1.jsonl"], 2, "is not valid UTF-8 (bad byte 0xe9"),
    ("bench-file-surrogate", ["bench", "--tasks", "file:{w}/prompts-surrogate.jsonl"], 2, "prompt is not valid UTF-8 text"),
    ("bench-file-empty-prompt", ["bench", "--tasks", "file:{w}/prompts-empty.jsonl"], 2, "prompts-empty.jsonl:1: the prompt is empty"),
    ("thresholds-latin1", ["generate", "hi", "--thresholds", "latin1.json"], 2, "is not valid UTF-8 (bad byte 0xe9"),
    # 2. values that pass a range check but not a sanity check
    ("temperature-nan", ["generate", "hi", "--temperature", "nan"], 2, "temperature must be a number, got NaN"),
    ("temperature-inf", ["generate", "hi", "--temperature", "inf"], 2, "temperature must be finite, got inf"),
    ("temperature-huge", ["generate", "hi", "--temperature", "1e300"], 2, "temperature must be <= 2.0"),
    ("top-p-nan", ["generate", "hi", "--top-p", "nan"], 2, "top_p must be a number, got NaN"),
    ("seed-65-bits", ["generate", "hi", "--seed", BIG], 2, f"seed must be <= {2**64 - 1}, got {BIG}"),
    ("seed-negative", ["generate", "hi", "--seed", "-1"], 2, "seed must be >= 0, got -1"),
    ("alpha-nan", ["generate", "hi", "--alpha", "nan"], 2, "alpha must be a number, got NaN"),
    ("alpha-negative", ["generate", "hi", "--alpha", "-0.5"], 2, "alpha must be >= 0.0, got -0.5"),
    ("alpha-inf", ["generate", "hi", "--alpha", "inf"], 2, "alpha must be finite"),
    ("accept-nan", ["generate", "hi", "--accept", "nan"], 2, "accept must be a number, got NaN"),
    ("accept-negative", ["generate", "hi", "--accept", "-1"], 2, "accept must be >= 0.0, got -1.0"),
    ("accept-draft-nan", ["generate", "hi", "--accept-draft", "nan"], 2, "accept_draft must be a number, got NaN"),
    ("accept-tv-inf", ["generate", "hi", "--accept-tv", "inf"], 2, "accept_tv must be finite"),
    ("slim-inf", ["generate", "hi", "--slim", "inf"], 2, "slim must be finite"),
    ("slim-entropy-nan", ["generate", "hi", "--slim-entropy", "nan"], 2, "slim_entropy must be a number, got NaN"),
    ("slim-entropy-negative", ["generate", "hi", "--slim-entropy", "-1"], 2, "slim_entropy must be >= 0.0"),
    ("draft-threshold-nan", ["generate", "hi", "--draft-threshold", "nan"], 2, "draft_threshold must be a number, got NaN"),
    ("device-nonsense", ["generate", "hi", "--device", "nonsense"], 2, "unknown device 'nonsense'"),
    ("device-tpu", ["generate", "hi", "--device", "tpu:0"], 2, "device 'tpu:0'"),
    ("max-new-tokens-huge", ["generate", "hi", "-n", str(2**40)], 2, "max_new_tokens must be <= 1048576"),
    ("full-block-huge", ["generate", "hi", "--full-block", "5000"], 2, "full_block must be <= 1024"),
    ("draft-layers-negative", ["generate", "hi", "--draft-layers", "-1"], 2, "draft_layers entry must be >= 0"),
    ("k-too-big", ["generate", "hi", "--k", "65"], 2, "k must be <= 64, got "),
    ("search-random-trials-negative", ["search", "--budget", "0.5", "--random-trials", "-1", "-o", "r.json"], 2,
      "--random-trials must be >= 0"),
    ("search-budget-nan", ["search", "--budget", "nan", "-o", "r.json"], 2, "--budget must be a number, got NaN"),
    ("search-budget-zero", ["search", "--budget", "0", "-o", "r.json"], 2, "--budget must be > 0.0"),
    ("cascade-pld", ["generate", "x", "-s", "cascade", "--draft", "pld"], 2, "reads the drafter's probabilities"),
    ("bench-cascade-pld", ["bench", "--methods", "ar,cascade:pld", "--out", "b.jsonl"], 2, "reads the drafter's probabilities"),
    ("routes-vocab-size", ["routes", "vocab", "r.json", "--size", "0"], 2, "--size must be >= 1"),
    ("search-prefix-negative", ["search", "--budget", "0.5", "--prefix", "-1", "-o", "r.json"], 2, "--prefix must be >= 0"),
    ("search-head-vocab-zero", ["search", "--budget", "0.5", "--head-vocab", "0", "-o", "r.json"], 2, "--head-vocab must be >= 1"),
    ("search-budget-over-one", ["search", "--budget", "1.5", "-o", "r.json"], 2, "--budget must be <= 1.0"),
    ("search-seed-33-bits", ["search", "--budget", "0.5", "--seed", str(2**32), "-o", "r.json"], 2, "seed must be <= 4294967295"),
    ("calibrate-min-agreement-nan", ["calibrate", "--min-agreement", "nan"], 2, "--min-agreement must be in (0, 1], got nan"),
    ("bench-seed-negative", ["bench", "--seed", "-3"], 2, "seed must be >= 0, got -3"),
    # 4. JSON of the wrong shape (read before any model loads)
    ("thresholds-list", ["generate", "hi", "--thresholds", "list.json"], 2, "a thresholds file must hold a JSON object, not a list"),
    ("thresholds-inner-list", ["generate", "hi", "--thresholds", "thr-list.json"], 2, "must hold a JSON object, not a list"),
    ("thresholds-strings", ["generate", "hi", "--thresholds", "strings.json"], 2, "threshold accept must be a number, got 'high'"),
    ("thresholds-nan", ["generate", "hi", "--thresholds", "nan.json"], 2, "accept must be a number, got NaN"),
    ("thresholds-negative", ["generate", "hi", "--thresholds", "neg.json"], 2, "slim must be >= 0.0"),
    ("thresholds-missing", ["generate", "hi", "--thresholds", "nope.json"], 2, "nope.json: no such thresholds file"),
    ("thresholds-directory", ["generate", "hi", "--thresholds", "adir"], 2, "adir: is a directory, not a thresholds file"),
    ("thresholds-empty", ["generate", "hi", "--thresholds", "empty.json"], 2, "not a readable thresholds JSON file"),
    ("thresholds-deep", ["generate", "hi", "--thresholds", "deep.json"], 2, "deep.json"),
    ("route-list", ["generate", "hi", "--slim-route", "list.json"], 2, "a JSON object was expected, got list"),
    ("route-string-mask", ["generate", "hi", "--slim-route", "zeros.json"], 2, "'attn' entries must be true/false or 1/0, got '0'"),
    ("route-float-mask", ["generate", "hi", "--draft-route", "floats.json"], 2, "entries must be true/false or 1/0, got 0.5"),
    ("route-nlayers-string", ["generate", "hi", "--slim-route", "nlayers.json"], 2, "model.n_layers must be a positive integer, got '4'"),
    ("route-no-model", ["generate", "hi", "--slim-route", "nomodel.json"], 2, "'model' must be an object"),
    ("route-budget-string", ["generate", "hi", "--slim-route", "budget.json"], 2, "budget must be a number in (0, 1] or null"),
    ("route-deep", ["generate", "hi", "--slim-route", "deep.json"], 2, "deep.json"),
    ("route-directory", ["generate", "hi", "--slim-route", "adir"], 2, "is a directory, not a route file"),
    ("routes-show-zeros", ["routes", "show", "zeros.json"], 2, "entries must be true/false or 1/0, got '0'"),
    ("routes-show-list", ["routes", "show", "list.json"], 2, "a JSON object was expected, got list"),
    ("routes-show-empty", ["routes", "show", "empty.json"], 2, "not a readable route JSON"),
    ("calibrate-route-list", ["calibrate", "--route", "list.json"], 2, "a JSON object was expected, got list"),
    ("report-not-records", ["report", "results.jsonl", "-o", "rep"], 2, "not `viasd bench` results"),
    ("report-missing-fields", ["report", "fields.jsonl", "-o", "rep"], 2, "not `viasd bench` results"),
    ("report-missing-file", ["report", "nope.jsonl", "-o", "rep"], 2, "nope.jsonl: no such results file"),
    ("report-directory", ["report", "adir", "-o", "rep"], 2, "adir: no such results file"),
    # 5. output paths that cannot be written, checked before the work
    ("search-out-proc", ["search", "--budget", "0.5", "-o", "/proc/viasd/r.json"], 2, "cannot create directory /proc/viasd"),
    ("search-out-under-file", ["search", "--budget", "0.5", "-o", "afile/r.json"], 2, "afile is a file, not a directory"),
    ("search-out-directory", ["search", "--budget", "0.5", "-o", "adir"], 2, "route file adir is a directory, not a file"),
    ("search-storage-proc", ["search", "--budget", "0.5", "-o", "r.json", "--storage", "sqlite:////proc/x.sqlite"], 2,
      "Optuna database /proc/x.sqlite: cannot write in /proc"),
    ("calibrate-out-proc", ["calibrate", "-o", "/proc/t.json"], 2, "thresholds file /proc/t.json: cannot write in /proc"),
    ("calibrate-out-under-file", ["calibrate", "-o", "afile/t.json"], 2, "afile is a file, not a directory"),
    ("calibrate-out-directory", ["calibrate", "-o", "adir"], 2, "thresholds file adir is a directory, not a file"),
    ("bench-out-proc", ["bench", "-o", "/proc/results.jsonl"], 2, "results file /proc/results.jsonl: cannot write in /proc"),
    ("bench-out-directory", ["bench", "-o", "adir"], 2, "results file adir is a directory, not a file"),
    ("bench-out-under-file", ["bench", "-o", "afile/r.jsonl"], 2, "afile is a file, not a directory"),
    ("report-out-file", ["report", "results.jsonl", "-o", "afile"], 2, "report directory afile exists and is not a directory"),
    ("report-out-proc", ["report", "results.jsonl", "-o", "/proc/viasd-report"], 2, "cannot create directory /proc/viasd-report"),
    # 6. validation before the slow part
    ("search-trials-zero", ["search", "--budget", "0.5", "--trials", "0", "-o", "r.json"], 2, "--trials must be >= 1, got 0"),
    ("search-calib-seqs-zero", ["search", "--budget", "0.5", "--calib-seqs", "0", "-o", "r.json"], 2, "--calib-seqs must be >= 1, got 0"),
    ("search-calib-len-zero", ["search", "--budget", "0.5", "--calib-len", "0", "-o", "r.json"], 2, "--calib-len must be >= 4, got 0"),
    ("calibrate-prompts-zero", ["calibrate", "--prompts", "0"], 2, "--prompts must be >= 1, got 0"),
    ("calibrate-prompts-negative", ["calibrate", "--prompts", "-1"], 2, "--prompts must be >= 1, got -1"),
    ("calibrate-k", ["calibrate", "--k", "100"], 2, "k must be <= 64, got "),
    ("bench-limit-zero", ["bench", "--limit", "0"], 2, "--limit must be >= 1, got 0"),
    ("bench-limit-negative", ["bench", "--limit", "-1"], 2, "--limit must be >= 1, got -1"),
    # the cache directory is a file
    ("cache-is-file-generate", ["generate", "hi", "-q"], 2, "cache directory {w}/cachefile (VIASD_CACHE) is a file, not a directory"),
    ("cache-is-file-search", ["search", "--budget", "0.5", "-o", "r.json", "-q"], 2, "(VIASD_CACHE) is a file, not a directory"),
    # argparse's own errors stay usage errors
    ("k-not-int", ["generate", "hi", "--k", "four"], 2, "invalid int value: 'four'"),
]


@pytest.mark.parametrize("name, argv, code, message", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(name, argv, code, message, work, monkeypatch, capsys):
    if name.startswith("cache-is-file"):
        monkeypatch.setenv("VIASD_CACHE", str(work / "cachefile"))
    if name == "device-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = [a.replace("{w}", str(work)) for a in argv]
    before = files_of(work)
    got, out, err = run_cli(argv, monkeypatch=monkeypatch, capsys=capsys)
    assert got == code, err
    assert message.replace("{w}", str(work)) in err
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    if name == "k-not-int":  # argparse: its usage line, then the error
        assert lines[-1].startswith("viasd generate: error:")
    else:
        assert len(lines) == 1 and lines[0].startswith("viasd: error: "), err
    assert files_of(work) == before, "a file was created, changed or removed"


def test_stdin_not_utf8(work, monkeypatch, capsys):
    code, out, err = run_cli(["generate", "-"], stdin=b"caf\xe9 \xff", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and err == "viasd: error: the prompt on stdin is not valid UTF-8 (bad byte 0xe9 at offset 3)\n"


def test_device_cuda_without_cuda(work, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out, err = run_cli(["generate", "hi", "--device", "cuda"], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "no CUDA device is available here" in err and len(err.splitlines()) == 1


def test_model_route_shapes_after_loading(work, tiny_dir, monkeypatch, capsys):
    """A well-formed route for another model still fails cleanly (after the model loads)."""
    other = {**ROUTE, "model": {**ROUTE["model"], "n_layers": 30}, "attn": [1] * 30, "mlp": [1] * 30}
    (work / "other.json").write_text(json.dumps(other))
    code, out, err = run_cli(["generate", "w1 w2", "--model", str(tiny_dir), "--no-chat", "-s", "viasd", "--slim-route", "other.json",
                              "-q"], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "cannot be used with" in err and "Traceback" not in err


def test_routes_show_counts_only_kept_layers(work, monkeypatch, capsys):
    half = {**ROUTE, "attn": [True, 0, 0, 1], "mlp": [1, False, 0, 1]}
    (work / "half.json").write_text(json.dumps(half))
    code, out, err = run_cli(["routes", "show", "half.json"], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and "kept    2/4 layers" in out


# --------------------------------------------------------------------------------------------- API

API_CASES = [
    ("prompt-none", lambda m: generate(None, m), errors.InvalidPromptError, "got NoneType"),
    ("prompt-bytes", lambda m: generate(b"w1 w2", m), errors.InvalidPromptError, "the prompt is bytes"),
    ("prompt-bytearray", lambda m: generate(bytearray(b"\x01\x02"), m), errors.InvalidPromptError, "the prompt is bytes"),
    ("prompt-dict", lambda m: generate({"role": "user", "content": "w1"}, m), errors.InvalidPromptError, "got dict"),
    ("prompt-int", lambda m: generate(5, m), errors.InvalidPromptError, "got int"),
    ("ids-float", lambda m: generate([1.0, 2.5], m), errors.InvalidPromptError, "token id 0 is not an integer: 1.0"),
    ("ids-bool", lambda m: generate([True, 2], m), errors.InvalidPromptError, "token id 0 is not an integer: True"),
    ("ids-str", lambda m: generate(["1", "2"], m), errors.InvalidPromptError, "token id 0 is not an integer: '1'"),
    ("ids-negative", lambda m: generate([3, -1], m), errors.InvalidPromptError,
      "token id 1 (-1) is outside the vocabulary: ids must be >= 0"),
    ("ids-past-vocab", lambda m: generate([1, 2, 64], m), errors.InvalidPromptError, "token id 2 (64) is outside the vocabulary"),
    ("ids-huge", lambda m: generate([2**70], m), errors.InvalidPromptError, "outside the vocabulary"),
    ("ids-empty", lambda m: generate([], m), errors.InvalidPromptError, "the prompt is empty"),
    ("text-surrogate", lambda m: generate("w1 \ud800", m), errors.InvalidPromptError, "the prompt is not valid UTF-8 text"),
    ("message-surrogate", lambda m: generate([{"role": "user", "content": "\udcff"}], m), errors.InvalidPromptError,
      "message 0 content is not valid UTF-8"),
    ("message-not-dict", lambda m: generate([{"role": "user", "content": "w1"}, "w2"], m), errors.UsageError, "message 1: expected"),
    ("max-new-tokens-str", lambda m: generate("w1", m, max_new_tokens="4"), errors.InvalidArgumentError,
      "max_new_tokens must be an integer, got '4'"),
    ("max-new-tokens-float", lambda m: generate("w1", m, max_new_tokens=4.0), errors.InvalidArgumentError,
      "max_new_tokens must be an integer, got 4.0"),
    ("k-bool", lambda m: generate("w1", m, k=True), errors.InvalidArgumentError, "k must be an integer, got True"),
    ("k-none", lambda m: generate("w1", m, k=None), errors.InvalidArgumentError, "k must be an integer, got None"),
    ("temperature-str", lambda m: generate("w1", m, temperature="0.7"), errors.InvalidArgumentError,
      "temperature must be a number, got '0.7'"),
    ("temperature-nan", lambda m: generate("w1", m, temperature=math.nan), errors.InvalidArgumentError,
      "temperature must be a number, got NaN"),
    ("temperature-inf", lambda m: generate("w1", m, temperature=math.inf), errors.InvalidArgumentError, "temperature must be finite"),
    ("top-p-inf", lambda m: generate("w1", m, top_p=math.inf), errors.InvalidArgumentError, "top_p must be finite"),
    ("seed-65-bits", lambda m: generate("w1", m, seed=2**64), errors.InvalidArgumentError, "seed must be <="),
    ("seed-negative", lambda m: generate("w1", m, seed=-5), errors.InvalidArgumentError, "seed must be >= 0"),
    ("seed-float", lambda m: generate("w1", m, seed=1.5), errors.InvalidArgumentError, "seed must be an integer"),
    ("alpha-nan", lambda m: generate("w1", m, strategy="cascade", alpha=math.nan), errors.InvalidArgumentError,
      "alpha must be a number, got NaN"),
    ("slim-entropy-nan", lambda m: generate("w1", m, slim_entropy=math.nan), errors.InvalidArgumentError,
      "slim_entropy must be a number, got NaN"),
    ("strategy-int", lambda m: generate("w1", m, strategy=3), errors.InvalidArgumentError, "unknown strategy 3"),
    ("chat-str", lambda m: generate("w1", m, chat="yes"), errors.InvalidArgumentError, "chat must be True, False or None"),
    ("layers-str", lambda m: generate("w1", m, strategy="self-sd", draft_layers="0,1"), errors.InvalidArgumentError,
      "draft_layers must be a list"),
    ("layers-float", lambda m: generate("w1", m, strategy="self-sd", draft_layers=(0.5,)), errors.InvalidArgumentError,
      "draft_layers entry must be an integer"),
    ("route-int", lambda m: generate("w1", m, slim_route=5), errors.InvalidArgumentError, "slim_route must be a file path"),
    ("on-text-not-callable", lambda m: generate("w1", m, on_text=5), errors.UsageError, "on_text must be callable"),
    ("config-wrong-type", lambda m: generate("w1", m, config={"k": 3}), errors.UsageError, "config must be a GenerateConfig"),
    ("config-and-keywords", lambda m: generate("w1", m, config=GenerateConfig(), k=3), errors.UsageError, "not both"),
    ("unknown-setting", lambda m: generate("w1", m, temprature=0.5), errors.UsageError, "unknown setting(s): temprature"),
    ("model-int", lambda m: generate("w1", 5), errors.UsageError, "model must be a model name or path"),
    ("model-none", lambda m: generate("w1", None), errors.UsageError, "model must be a model name or path"),
    ("load-model-int", lambda m: load_model(5), errors.UnknownModelError, "got 5"),
    ("load-model-empty", lambda m: load_model(""), errors.UnknownModelError, "a non-empty str"),
    ("load-model-surrogate", lambda m: load_model("m\udcff"), errors.InvalidPromptError, "model is not valid UTF-8"),
    ("load-model-device", lambda m: load_model(str(m.path), device="nonsense"), errors.InvalidArgumentError, "unknown device 'nonsense'"),
    ("load-model-dtype", lambda m: load_model(str(m.path), dtype="float32"), errors.UsageError, "dtype must be torch.float32"),
    ("validate-alpha-inf", lambda m: GenerateConfig.from_settings(alpha=math.inf).validate(), errors.InvalidArgumentError,
      "alpha must be finite"),
    ("validate-full-block-str", lambda m: GenerateConfig.from_settings(full_block="8").validate(), errors.InvalidArgumentError,
      "full_block must be an integer"),
]


@pytest.mark.parametrize("name, call, error, message", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_bad_input(name, call, error, message, tiny):
    with pytest.raises(error) as info:
        call(tiny)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, errors.UsageError) and info.value.exit_code == 2


def test_api_accepts_what_it_should(tiny):
    """Token ids as a tensor or numpy ints, and numpy-typed settings, still work."""
    import numpy as np

    a = generate(torch.tensor([1, 2, 3]), tiny, max_new_tokens=3, strategy="ar")
    b = generate([np.int64(1), 2, 3], tiny, max_new_tokens=np.int64(3), strategy="ar", temperature=np.float32(0.0))
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 3


# ---------------------------------------------------------------------------- strict JSON (class 9)


def test_strict_json_round_trip(tmp_path):
    text = dumps_strict({"a": math.inf, "b": -math.inf, "c": math.nan, "d": [1.5, math.inf]})
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict token {c}"))
    assert data == {"a": "inf", "b": "-inf", "c": None, "d": [1.5, "inf"]}
    assert as_float(data["a"]) == math.inf and as_float(data["b"]) == -math.inf and as_float(True) is None


def test_shipped_thresholds_are_strict_json_and_read_back():
    from viasd.routing import route

    shipped = Path(route.__file__).parent / "shipped"
    for f in shipped.glob("*.json"):
        json.loads(f.read_text(), parse_constant=lambda c: pytest.fail(f"{f.name}: non-strict token {c}"))
    thresholds = load_thresholds(shipped / "smollm2-135m.slim.thresholds.json")
    assert thresholds["slim_entropy"] == math.inf
    # files written before strict JSON (with Infinity) still read
    legacy = json.loads((shipped / "smollm2-135m.slim.thresholds.json").read_text())
    assert legacy["thresholds"]["slim_entropy"] == "inf"


def test_generate_json_is_strict(tiny_dir, work, monkeypatch, capsys):
    code, out, err = run_cli(["generate", "w1 w2", "--model", str(tiny_dir), "--no-chat", "-s", "viasd", "--mode", "tiered",
                              "--slim-layers", "0", "1", "3", "-n", "3", "--json", "-q"], monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    data = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict token {c}"))
    assert data["config"]["tier_thresholds"]["slim_entropy"] == "inf"


# ---------------------------------------------------------------------- JSON files read by viasd


def test_route_from_dict_refuses_strings_and_keeps_ints():
    with pytest.raises(RouteError, match="got '0'"):
        Route.from_dict({**ROUTE, "attn": ["0", "1", "1", "1"]})
    r = Route.from_dict({**ROUTE, "attn": [True, 1, 0, False], "mlp": [1, 1, 1, 1]})
    assert r.attn == (True, True, False, False)


@pytest.mark.filterwarnings("error::UserWarning")  # no library warning on the user's terminal (an empty legend's)
def test_bench_resume_leaves_a_file_report_reads(tiny, tmp_path, capsys):
    """A killed run's torn fragment is cut off on resume; report reads the result, and skips
    (with a warning) lines that are not records, with no library's warning printed (records without
    quality scores: an empty quality-speed figure)."""
    from viasd.bench import Prompt, done_keys, run_bench
    from viasd.report import report

    out = tmp_path / "r.jsonl"
    prompts = [Prompt("file:x", "1", "w1 w2 w3", False)]
    run_bench(tiny, None, [("ar", {"strategy": "ar"})], prompts, out, GenerateConfig(max_new_tokens=4), progress=False)
    good = out.read_bytes()
    out.write_bytes(good + b'[1, 2]\n"a string"\n{"task": "file:x", "prompt_id": "1", "meth')  # foreign lines + torn tail
    assert len(done_keys(out)) == 1
    n = run_bench(tiny, None, [("ar", {"strategy": "ar"}), ("pld", {"strategy": "pld"})], prompts, out,
                  GenerateConfig(max_new_tokens=4), progress=False)
    assert n == 1
    lines = out.read_bytes().split(b"\n")
    assert lines[-1] == b"" and not any(line.startswith(b'{"task": "file:x", "prompt_id": "1", "meth') and not line.endswith(b"}")
                                        for line in lines)
    from viasd.report import load_records

    with pytest.raises(errors.UsageError, match="holds 2 bench runs"):  # the resumed part is a run of its own
        report(out, tmp_path / "rep")
    runs = list(dict.fromkeys(r["run_id"] for r in load_records(out)))
    md, _ = report(out, tmp_path / "rep", run=runs[1])
    assert "| file:x | pld |" in md.read_text()
    assert "skipped 2 line(s)" in capsys.readouterr().err


def test_a_prompt_from_a_closed_stdin_is_one_line_exit_2():
    import subprocess

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "viasd", "generate", "-"], env=env, capture_output=True, text=True,
                       preexec_fn=lambda: os.close(0), timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "viasd: error: '-' reads the prompt from standard input, which is closed"


def test_a_fifo_as_an_input_file_is_one_line_not_a_wait(tmp_path):
    """A named pipe given as a route or thresholds file is refused at once (opened without
    blocking, then found not a regular file), never waited on. In a child process (one for the three
    options), so that a regression fails instead of hanging the suite."""
    import subprocess

    cases = [("--slim-route", "route"), ("--draft-route", "route"), ("--thresholds", "thresholds")]
    argv = []
    for option, _ in cases:
        os.mkfifo(tmp_path / option.strip("-"))
        argv += [option, str(tmp_path / option.strip("-"))]
    child = ("import sys\nfrom viasd.cli import main\nfor o, p in zip(sys.argv[1::2], sys.argv[2::2]):\n"
             "    print(main(['generate', 'hi', o, p]), flush=True)")
    env = {**os.environ, "VIASD_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", child, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout == "2\n2\n2\n", r.stderr[-2000:]
    assert r.stderr.splitlines() == [f"viasd: error: {tmp_path / option.strip('-')}: is a named pipe (FIFO), not a regular {what} file"
                                     for option, what in cases]
