"""Task quality metrics on known pairs, and the HumanEval sandbox."""

from __future__ import annotations


import pytest

from viasd.datasets import human_eval
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
    ok, reason = run_untrusted(program, timeout_s=3)
    assert not ok
    if why:
        assert why in reason
