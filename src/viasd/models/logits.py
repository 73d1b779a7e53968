"""What a pass returns to the decoding loops: its logits, with each row's argmax where the pass' LM
head found it as it wrote them (scanning a cold 152k-float row right after a pass cost ~0.17 ms on
the AMX Xeon). A plain value: the rows' maxima travel with the logits they describe, so nothing
needs the logits never to change in place (logit processors and grammars make new ones, without)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PassOutput:
    logits: torch.Tensor  # [n, V] (a row taken by an int index: [V])
    argmax: list[int] | None = None  # [n] each row's first maximum's index, as `torch.argmax(logits, -1)`; None: unknown

    def __getitem__(self, i: int | slice) -> PassOutput:
        """Rows i of it (a slice: [m, V]; an int: the row [V], its argmax a list of one)."""
        known = self.argmax
        if isinstance(i, int):
            return PassOutput(self.logits[i], None if known is None else [known[i]])
        return PassOutput(self.logits[i], None if known is None else known[i])
