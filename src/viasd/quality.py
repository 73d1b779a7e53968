"""Task quality metrics, from well-kept libraries (sacrebleu, rouge-score), and a sandbox for
HumanEval's pass@1: untrusted completions run in a separate process, as an unprivileged user
where possible, with CPU-time, memory, process and file-size limits, no network, a temporary
directory, and a wall-clock timeout that kills the whole process group."""

from __future__ import annotations

import ctypes
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def rouge_l(prediction: str, reference: str) -> float:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True).score(reference, prediction)["rougeL"].fmeasure


def bleu(prediction: str, reference: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_bleu(prediction, [reference]).score


def chrf(prediction: str, reference: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_chrf(prediction, [reference]).score


def final_number(text: str) -> str | None:
    """The last number in `text` (GSM8K answers: the part after '####' when present)."""
    if "####" in text:
        text = text.split("####")[-1]
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def math_exact_match(prediction: str, reference: str) -> float:
    want, got = final_number(reference), final_number(prediction)
    if want is None or got is None:
        return 0.0
    try:
        return float(abs(float(want) - float(got)) < 1e-6)
    except ValueError:
        return float(want == got)


def answer_match(prediction: str, answers: list[str]) -> float:
    norm = " ".join(prediction.lower().split())
    return float(any(" ".join(a.lower().split()) in norm for a in answers if a.strip()))


def humaneval_completion(text: str) -> str:
    """Cut a raw completion where the function body ends (the usual HumanEval stop sequences)."""
    cut = len(text)
    for stop in ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```"):
        i = text.find(stop)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


# Root ignores RLIMIT_NPROC, so as root the program runs as nobody, with the system Python (a
# pyenv or venv Python under /root is not readable by nobody).
_SYSTEM_PYTHON = "/usr/bin/python3"


def _sandbox_limits(memory_mb: int, cpu_s: int, drop_to_nobody: bool) -> None:  # runs in the child before exec
    os.setsid()
    try:  # no network: a fresh, empty network namespace (needs root; skipped otherwise)
        ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
    except Exception:
        pass
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    if drop_to_nobody:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (32, 32))


def run_untrusted(program: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> tuple[bool, str]:
    """Run a Python program in the sandbox. Returns (exited 0 within the limits, reason)."""
    with tempfile.TemporaryDirectory(prefix="viasd-sandbox-") as tmp:
        os.chmod(tmp, 0o777)
        path = os.path.join(tmp, "program.py")
        with open(path, "w") as f:
            f.write(program)
        os.chmod(path, 0o644)
        drop = os.geteuid() == 0 and os.path.exists(_SYSTEM_PYTHON)
        python = _SYSTEM_PYTHON if drop else sys.executable
        proc = subprocess.Popen([python, "-I", "-S", path], cwd=tmp, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"},
                                preexec_fn=lambda: _sandbox_limits(memory_mb, int(timeout_s) + 1, drop))
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False, "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
            except ProcessLookupError:
                pass
        if proc.returncode == 0:
            return True, "passed"
        last = (err.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return False, last[:200]


def humaneval_pass(problem: dict, completion: str, timeout_s: float = 10.0) -> tuple[bool, str]:
    program = problem["prompt"] + completion + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
    return run_untrusted(program, timeout_s)


def score(task: str, text: str, reference=None, problem: dict | None = None) -> dict[str, float]:
    """Quality metrics for one output of a task ("spec_bench/<category>", "human_eval", "file:...")."""
    category = task.split("/")[-1]
    if task == "human_eval" and problem is not None:
        ok, _ = humaneval_pass(problem, humaneval_completion(text))
        return {"pass@1": float(ok)}
    if reference is None:
        return {}
    ref = reference[0] if isinstance(reference, list) and reference else reference
    if category == "translation":
        return {"bleu": bleu(text, ref), "chrf": chrf(text, ref)}
    if category == "summarization":
        return {"rougeL": rouge_l(text, ref)}
    if category == "math_reasoning":
        return {"exact_match": math_exact_match(text, ref)}
    if category == "rag":
        return {"answer_match": answer_match(text, ref if isinstance(ref, list) else [ref])}
    if isinstance(ref, str):
        return {"rougeL": rouge_l(text, ref)}
    return {}
