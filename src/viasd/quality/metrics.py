"""Task quality metrics, from well-kept libraries (sacrebleu, rouge-score): text against a
reference, a GSM8K-style final number, acceptable answers; HumanEval's pass@1 through the sandbox."""

from __future__ import annotations

import re

from viasd.quality.sandbox import humaneval_pass

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


# what a `file:` task row (its "metric" field) or `file:PATH:METRIC` may ask for: name -> metrics of
# (prediction, reference); answer_match takes a list of acceptable answers (a string is one answer)
METRICS = {
    "rougeL": lambda text, ref: {"rougeL": rouge_l(text, _first(ref))},
    "bleu": lambda text, ref: {"bleu": bleu(text, _first(ref)), "chrf": chrf(text, _first(ref))},
    "chrf": lambda text, ref: {"chrf": chrf(text, _first(ref))},
    "exact_match": lambda text, ref: {"exact_match": math_exact_match(text, _first(ref))},
    "answer_match": lambda text, ref: {"answer_match": answer_match(text, ref if isinstance(ref, list) else [ref])},
}


# Spec-Bench categories with a metric of their own (other tasks with a text reference: ROUGE-L)
_CATEGORY_METRICS = {"translation": "bleu", "summarization": "rougeL", "math_reasoning": "exact_match", "rag": "answer_match"}


def _first(reference):
    return reference[0] if isinstance(reference, list) and reference else reference


def score(task: str, text: str, reference=None, problem: dict | None = None, metric: str | None = None) -> dict[str, float]:
    """Quality metrics for one output of a task ("spec_bench/<category>", "human_eval", "file:...").
    `metric` (one of METRICS) overrides the task's own choice; without a reference there is none."""
    category = task.split("/")[-1]
    if task == "human_eval" and problem is not None:
        ok, _ = humaneval_pass(problem, humaneval_completion(text))
        return {"pass@1": float(ok)}
    if reference is None:
        return {}
    if metric is not None:
        return METRICS[metric](text, reference)
    ref = _first(reference)  # Spec-Bench keeps its reference as a one-item list
    metric = _CATEGORY_METRICS.get(category) or ("rougeL" if isinstance(ref, str) else None)
    return METRICS[metric](text, ref) if metric else {}
