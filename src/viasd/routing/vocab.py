"""The vocabulary of a reduced LM head: the N tokens a slim or drafting pass scores.

A slim pass along a route reads the route's layers and the whole LM head; on smollm2-135m the head
(49152 x 576, tied to the embedding) is 31% of a full pass' weight bytes, so a route keeping 60% of
the layers still reads 82% of a full pass. A head over the N most frequent tokens reads N/V of it.

Which N tokens: every token of the DIMR calibration corpus (Spec-Bench's dev split: its prompts and
the full model's continuations of them), most frequent first, then the rest by id: byte-pair and
SentencePiece vocabularies number their tokens in the order training merged or scored them, most
frequent first, so low ids stand in for the counts a small corpus cannot give. The end-of-sequence
tokens are always in. N is rounded up to a multiple of 16 (the row-exact kernel's row block).
The evaluation split never takes part (`coverage` measures on it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from viasd.errors import UsageError


def frequent_vocab(counts: Counter, vocab_size: int, n: int, always: Iterable[int] = ()) -> tuple[int, ...]:
    """The ids of a reduced head of about `n` tokens (ascending): `always`, then by count in `counts`,
    then by id; rounded up to a multiple of 16, at most `vocab_size`."""
    if n < 1:
        raise UsageError(f"a reduced vocabulary needs at least 1 token, got {n}")
    n = min(vocab_size, -(-n // 16) * 16)
    chosen = dict.fromkeys(i for i in always if 0 <= i < vocab_size)
    chosen.update(dict.fromkeys(i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if 0 <= i < vocab_size))
    ranked = list(chosen)[:n]
    if len(ranked) < n:
        taken = set(ranked)
        ranked += [i for i in range(vocab_size) if i not in taken][: n - len(ranked)]
    return tuple(sorted(ranked))


def corpus_counts(sequences: Iterable[torch.Tensor | list[int]]) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        counts.update(seq.tolist() if isinstance(seq, torch.Tensor) else list(seq))
    return counts


def calibration_vocab(model, n: int, calib=None) -> tuple[int, ...]:
    """The reduced vocabulary for `model` from its DIMR calibration corpus (built if not given)."""
    from viasd.routing.calibration import build_calibration, dev_prompts

    calib = calib or build_calibration(model, progress=False)
    counts = corpus_counts(list(calib.sequences) + dev_prompts(model, 10_000))
    return frequent_vocab(counts, model.decoder.lm_head.out_features, n, model.eos_token_ids)


def coverage(vocab: Iterable[int], tokens: Iterable[int]) -> float:
    """Share of `tokens` inside `vocab`."""
    keep, tokens = set(vocab), list(tokens)
    return sum(t in keep for t in tokens) / len(tokens) if tokens else 0.0
