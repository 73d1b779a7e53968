"""The console script: exit codes, one-line errors, JSON record, streaming."""

from __future__ import annotations

import json
import re

import pytest

from viasd.cli import main


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--model", "no-such-model"], "viasd: error: unknown model 'no-such-model'"),
        (["generate", "hi", "--k", "-1"], "viasd: error: k must be >= 0, got -1"),
        (["generate", "hi", "--temperature", "-2"], "viasd: error: temperature must be >= 0"),
        (["generate", "hi", "--top-p", "0"], "viasd: error: top_p must be > 0.0, got 0.0"),
        (["generate", "hi", "--max-new-tokens", "0"], "viasd: error: max_new_tokens must be >= 1"),
        (["generate", "hi", "--strategy", "nope"], "invalid choice: 'nope'"),
        (["generate", "hi", "--strategy", "viasd", "--correct"],
         "viasd: error: correct applies to strategy viasd in tiered mode with greedy decoding"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["generate", "hi", "--drafter-weights", "int4"], "invalid choice: 'int4'"),
        (["generate", "hi", "--top-k", "-1"], "viasd: error: top_k must be >= 0, got -1"),
        (["generate", "hi", "--min-p", "2"], "viasd: error: min_p must be <= 1.0, got 2.0"),
        (["generate", "hi", "--repetition-penalty", "0"], "viasd: error: repetition_penalty must be > 0.0, got 0.0"),
        (["generate", "hi", "--presence-penalty", "-2.5"], "viasd: error: presence_penalty must be >= -2.0, got -2.5"),
        (["generate", "hi", "--logit-bias", "5=101"], "viasd: error: logit_bias[5] must be <= 100.0, got 101.0"),
        (["generate", "hi", "--logit-bias", "5"], "viasd: error: logit_bias must be ID=BIAS pairs (a token id, a number), got '5'"),
        (["generate", "hi", "--logit-bias", "1=2,x=3"], "viasd: error: logit_bias must be ID=BIAS pairs"),
        # a negative id is the flag's value, not an unknown option: the range error, not "expected one argument"
        (["generate", "hi", "--logit-bias", "-1=5"], "viasd: error: logit_bias keys must be token ids (integers >= 0), got -1"),
        (["generate", "hi", "--logit-bias", "2=1,-7=5"], "viasd: error: logit_bias keys must be token ids (integers >= 0), got -7"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    if err.startswith("viasd: error:"):
        assert len(err.strip().splitlines()) == 1


def test_generate_takes_the_samplers(capsys, tiny_dir):
    """--logit-bias repeated or comma-separated (one dict), the other samplers as flags, all in the record;
    an id beyond the vocabulary refused once the model is loaded."""
    code, out, _ = run(capsys, "generate", "w5 w6", "--model", str(tiny_dir), "--no-chat", "-n", "3", "--json", "--quiet",
                       "--logit-bias", "17=100", "--logit-bias", "3=-5,4=1.5", "--top-k", "4", "--min-p", "0.1",
                       "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--repetition-penalty", "1.2")
    assert code == 0, out
    record = json.loads(out)
    assert record["token_ids"] == [17, 17, 17]
    config = record["config"]
    assert config["logit_bias"] == {"17": 100.0, "3": -5.0, "4": 1.5}
    assert (config["top_k"], config["min_p"], config["presence_penalty"], config["frequency_penalty"],
            config["repetition_penalty"]) == (4, 0.1, 0.5, -0.5, 1.2)
    code, _, err = run(capsys, "generate", "w5", "--model", str(tiny_dir), "--no-chat", "-n", "2", "--quiet", "--logit-bias", "64=1")
    assert code == 2 and err.strip() == "viasd: error: logit_bias names token id 64, outside the vocabulary: ids must be in [0, 64)"


def test_unsupported_architecture_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    code, _, err = run(capsys, "generate", "hi", "--model", str(tmp_path))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "viasd: error: unsupported architecture 'gpt2': the runtime supports llama, qwen2, mistral, gemma2" in err


def test_sd_without_drafter_and_drafter_without_sd(capsys, tiny_dir):
    code, _, err = run(capsys, "generate", "w1 w2", "--model", str(tiny_dir), "--strategy", "sd", "--no-chat")
    assert code == 2 and "strategy 'sd' needs a drafter model" in err
    code, _, err = run(capsys, "generate", "w1 w2", "--model", str(tiny_dir), "--drafter", str(tiny_dir), "--no-chat")
    assert code == 2 and "only used with model drafting" in err


def test_generate_json_on_a_local_directory(capsys, tiny_dir):
    code, out, err = run(capsys, "generate", "w1 w2 w3", "--model", str(tiny_dir), "--no-chat", "-n", "6", "-s", "ar", "--json", "-q")
    assert code == 0
    record = json.loads(out)
    assert len(record["token_ids"]) == record["stats"]["new_tokens"] <= 6
    assert set(record["stats"]) >= {"new_tokens", "wall_s", "tokens_per_s", "mean_accepted_length", "rejection_rate", "calls"}
    assert record["config"]["strategy"] == "ar"


def test_models_lists_the_zoo(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    for alias in ("smollm2-135m (default)", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma3-270m"):
        assert alias in out


@pytest.mark.model
def test_generate_streams_text_then_stats(capsys, smollm2):
    code, out, err = run(capsys, "generate", "Name three colours.", "-n", "12", "-q")
    assert code == 0
    assert out.strip()  # the streamed text
    assert "[pld] " in err and "tok/s" in err and "mean accepted length" in err
    assert re.search(r"tokens in [\d.]+ s \([\d.]+ tok/s; first token after [\d.]+ s, then [\d.]+ tok/s\)", err), err


def test_a_command_whose_extra_is_missing_says_what_to_install(tmp_path, monkeypatch, capsys):
    """optuna, sacrebleu, rouge-score and matplotlib come with viasd[bench] only: a command that needs
    one that is missing says so in one line, not with a traceback."""
    import sys

    from viasd.cli import main

    monkeypatch.setitem(sys.modules, "optuna", None)  # (an import of it then fails as if not installed)
    code = main(["search", "--budget", "0.5", "--out", str(tmp_path / "route.json"), "-q"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert "viasd search needs optuna" in err and "pip install 'viasd[bench]'" in err
