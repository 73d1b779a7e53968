"""Task quality metrics, from well-kept libraries (sacrebleu, rouge-score), and a sandbox for
HumanEval's pass@1: untrusted completions run in a separate process, as an unprivileged user
where possible, with CPU-time, memory, process and file-size limits (memory in total across the
program's processes where a cgroup v2 can be made: `memory_cap_mode()`), no network, a temporary
directory, and a wall-clock timeout that kills the whole process group. The test itself runs in a
trusted harness process and sees only plain values the program's function returned.

metrics.py: the metrics and `score`; sandbox.py: `run_untrusted`, `humaneval_pass`; programs.py:
the harness, worker and launcher it runs; cgroup.py: the total memory cap."""

from viasd.quality.cgroup import memory_cap_mode
from viasd.quality.metrics import (
    METRICS,
    answer_match,
    bleu,
    chrf,
    final_number,
    humaneval_completion,
    math_exact_match,
    rouge_l,
    score,
)
from viasd.quality.sandbox import humaneval_pass, run_untrusted, sandbox_mode

__all__ = ["METRICS", "answer_match", "bleu", "chrf", "final_number", "humaneval_completion", "humaneval_pass",
           "math_exact_match", "memory_cap_mode", "rouge_l", "run_untrusted", "sandbox_mode", "score"]
