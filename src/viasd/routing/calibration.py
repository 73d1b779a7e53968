"""The DIMR calibration set: Spec-Bench dev prompts (question_id % 5 == 0; the rest stay for
evaluation) continued greedily by the full model to `seq_len` tokens, with the full model's top-k
next-token log-probs on the continuation; cached on disk by model fingerprint and settings. The
route search (search.py) scores routes on it; the reduced head's vocabulary (vocab.py) counts its tokens.
"""

from __future__ import annotations

import hashlib
import io
import sys
from dataclasses import dataclass, field

import torch

from viasd.models.cache import cache_dir
from viasd.models.loading import LoadedModel
from viasd.routing.route import ModelFingerprint
from viasd.validation import atomic_write_bytes, check_int, open_regular


@dataclass
class Calibration:
    sequences: list[torch.Tensor]  # each [L] prompt + full-model continuation
    prompt_lens: list[int]
    topk_logp: list[torch.Tensor]  # each [L - P, k] full model's log-probs of its top-k tokens, predicting tokens P..L-1
    topk_idx: list[torch.Tensor]  # each [L - P, k]
    description: str
    # per sequence, a KV cache holding the full model's prompt (filled on first use, not saved)
    _prompt_caches: dict = field(default_factory=dict, repr=False)
    # per sequence, [L - P] bool: positions where a drafter's greedy token is not the full model's
    # (`drafter_misses`; None: no drafter given); the costs are then also taken over those
    misses: list[torch.Tensor] | None = None


def dev_prompts(model: LoadedModel, n: int) -> list[list[int]]:
    """The first n Spec-Bench dev-split prompts (question_id % 5 == 0), chat-formatted when possible."""
    from viasd.datasets import spec_bench

    rows = [r for r in spec_bench() if r["question_id"] % 5 == 0][:n]
    return [model.encode(r["turns"][0]) for r in rows]


def build_calibration(model: LoadedModel, n_seqs: int = 16, seq_len: int = 128, top_k: int = 64,
                      progress: bool = True, prompts: list[list[int]] | None = None) -> Calibration:
    """Calibration set for `model`, cached on disk by model fingerprint and settings."""
    from tqdm import tqdm

    check_int("--calib-len", seq_len, 4, model.config.max_positions)
    fp = ModelFingerprint.of(model)
    prompts = prompts if prompts is not None else dev_prompts(model, n_seqs)
    key = hashlib.sha256(repr((fp, prompts, seq_len, top_k)).encode()).hexdigest()[:16]
    path = cache_dir() / "calibration" / f"{key}.pt"
    if path.exists():
        cached = _load_calibration(path)
        if cached is not None:
            return cached
    seqs, plens, logps, idxs = [], [], [], []
    for ids in tqdm(prompts, desc="calibration (full model)", disable=not progress, file=sys.stderr):
        ids = ids[: seq_len // 2]  # keep room for a continuation
        cont = greedy_continuation(model.decoder, ids, seq_len - len(ids))
        seq = torch.tensor(ids + cont)
        cache = model.decoder.new_cache(len(seq))
        logits = model.decoder.forward(seq[:-1], 0, cache)[len(ids) - 1 :]  # predicting tokens P..L-1
        logp, idx = torch.log_softmax(logits, -1).topk(top_k, dim=-1)
        seqs.append(seq)
        plens.append(len(ids))
        logps.append(logp)
        idxs.append(idx)
    calib = Calibration(seqs, plens, logps, idxs, f"{len(seqs)} Spec-Bench dev sequences of {seq_len} tokens, top-{top_k}")
    buf = io.BytesIO()
    torch.save({k: v for k, v in calib.__dict__.items() if not k.startswith("_")}, buf)
    atomic_write_bytes(path, buf.getvalue())
    return calib


def greedy_continuation(decoder, ids: list[int], n: int) -> list[int]:
    """The full model's n greedy tokens after `ids`, by the passes `ar` makes (the prompt, then one
    token a pass), with no end token: the calibration text. (Here rather than through the decoding
    loops, which lie above routing.)"""
    cache = decoder.new_cache(len(ids) + n + 1)
    logits = decoder.forward(torch.tensor(ids), 0, cache, last_only=True)[0]  # [V]
    out: list[int] = []
    while len(out) < n:
        out.append(int(logits.argmax()))
        if len(out) < n:
            logits = decoder.forward(torch.tensor(out[-1:]), len(ids) + len(out) - 1, cache)[0]
    return out


def _load_calibration(path) -> Calibration | None:
    """A cached calibration set, or None (and the file removed) when it is unreadable or malformed."""
    try:
        with open_regular(path) as f:  # (a FIFO in its place: refused, never waited on)
            data = torch.load(f, weights_only=True)
        calib = Calibration(**data)
        n = len(calib.sequences)
        if not (n and all(len(x) == n for x in (calib.prompt_lens, calib.topk_logp, calib.topk_idx))
                and all(isinstance(t, torch.Tensor) for t in calib.sequences + calib.topk_logp + calib.topk_idx)
                and isinstance(calib.description, str)):
            raise ValueError("fields of the wrong shape")
        return calib
    except Exception as e:  # torch.load raises many types on a damaged file
        print(f"viasd: calibration cache {path} is unreadable ({type(e).__name__}); rebuilding it", file=sys.stderr)
        try:
            path.unlink()
        except OSError:
            pass
        return None
