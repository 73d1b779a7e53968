"""Logit processors of the verifier's rows: `logit_bias` and the presence, frequency and repetition
penalties, as pure tensor functions named as the settings, and the per-request state they read.

They change the *target* distribution p itself: `Session._pass` / `prefill` apply them to every
row (full and slim) before the grammar mask, so every acceptance rule sees the processed p and every
lossless strategy stays lossless. Semantics follow vLLM's: the bias is added first; then the
repetition penalty (HF/CTRL: a positive logit divided, a negative one multiplied) over the ids in the
prompt or among the generated tokens before the row's position; then the frequency and presence
penalties over the generated tokens only (logit -= frequency * count; logit -= presence * (count > 0)).
Temperature, top_k, top_p and min_p come later, in `acceptance.logits_to_probs`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitProcessors:
    """A request's processors of the verifier's logits; each at its neutral value is off."""

    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.counting

    @property
    def counting(self) -> bool:
        """Whether a penalty reads the tokens before each row."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def logit_bias(logits: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """logits [n, V] (changed in place, returned); ids [m] token ids; bias [m] added to their logits in every row."""
    logits[:, ids] += bias
    return logits


def penalties(logits: torch.Tensor, ids: torch.Tensor, generated: torch.Tensor, in_prompt: torch.Tensor,
              presence_penalty: float, frequency_penalty: float, repetition_penalty: float) -> torch.Tensor:
    """logits [n, V] (changed in place, returned); ids [m] the ids any penalty touches (every other id
    keeps its logit: a count of 0 and not in the prompt); generated [n, m] float: each id's count among
    the generated tokens of row i's context; in_prompt [m] bool."""
    x = logits[:, ids]  # [n, m]
    if repetition_penalty != 1:
        seen = in_prompt | (generated > 0)  # [n, m]
        x = torch.where(seen, torch.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    if frequency_penalty != 0:
        x = x - frequency_penalty * generated
    if presence_penalty != 0:
        x = x - presence_penalty * (generated > 0).to(x.dtype)
    logits[:, ids] = x
    return logits


class ProcessorState:
    """One request's processors and what the penalties read of its committed tokens: each id's count
    among the generated tokens (kept by `Session.commit` / `retract`) and the prompt's ids."""

    def __init__(self, processors: LogitProcessors, prompt: list[int]):
        self.processors = processors
        bias = processors.logit_bias or {}
        self.bias_ids = torch.tensor(sorted(bias), dtype=torch.long)  # [b]
        self.bias = torch.tensor([float(bias[i]) for i in sorted(bias)], dtype=torch.float32)  # [b]
        # (the prompt's ids only matter to the repetition penalty)
        self.prompt_ids = torch.tensor(sorted(set(prompt)) if processors.repetition_penalty != 1 else [], dtype=torch.long)  # [p]
        self.counts: Counter[int] = Counter()  # generated id -> count among the committed new tokens
        self.n_committed = 0

    def commit(self, new: list[int]) -> None:
        self.counts.update(new)
        self.n_committed += len(new)

    def retract(self, removed: list[int]) -> None:
        self.counts.subtract(removed)
        self.counts = +self.counts  # (drops the ids back at 0)
        self.n_committed -= len(removed)

    def process(self, rows: torch.Tensor, committed: list[int], ahead: list[int]) -> torch.Tensor:
        """rows [n, V]: the logits of the last n positions of the committed tokens + `ahead`, whose
        generated tokens are `committed` (every new token so far) + `ahead`. Row i's context holds the
        first s + i of them, s = len(committed) + len(ahead) - n + 1 (fewer than `committed` for the
        pending rows of tiered mode). Returns the processed rows as a float32 copy."""
        p = self.processors
        n = rows.shape[0]
        out = rows.float().clone() if rows.dtype == torch.float32 else rows.float()  # [n, V]
        if self.bias_ids.numel():
            logit_bias(out, self.bias_ids, self.bias)
        if not p.counting:
            return out
        gen = committed + ahead if ahead else committed
        s = len(gen) - n + 1
        base = Counter(self.counts)  # the counts of row 0's context: the committed ones, moved to its end
        if s < len(committed):
            base.subtract(gen[s : len(committed)])
        elif s > len(committed):
            base.update(gen[len(committed) : s])
        steps = gen[s : s + n - 1]  # the token each next row's context adds
        gen_ids = sorted(set(k for k, c in base.items() if c > 0) | set(steps))
        ids = torch.unique(torch.cat([self.prompt_ids, torch.tensor(gen_ids, dtype=torch.long)]))  # [m], sorted
        if not ids.numel():
            return out
        col = dict(zip(ids.tolist(), range(ids.numel())))  # id -> its column (only the few that occur)
        generated = torch.zeros(n, ids.numel())  # [n, m]
        for i, c in base.items():
            if c > 0:
                generated[0, col[i]] = c
        for r, t in enumerate(steps, start=1):
            generated[r, col[t]] += 1
        generated = generated.cumsum(0)  # row i: row 0's counts + the tokens of steps[:i]
        in_prompt = torch.isin(ids, self.prompt_ids)  # [m]
        return penalties(out, ids, generated, in_prompt, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
