"""The pieces a decoder is built of: float products (`PackedLinear`), embeddings, the reduced LM head
of routes and drafters (`ReducedHead`), a layer's weights, and the float path's small ops."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from viasd.models.ggml_kernels import QuantLinear
from viasd.models.logits import PassOutput


class PackedLinear:
    """y = x @ W.T (+ b), with W prepacked for oneDNN on CPU.

    On this project's CPUs, MKL's sgemm takes a slow generic path for the small-M products of
    decoding (M = 1..16 rows); oneDNN on a prepacked weight is 2-5x faster there and never slower.
    Elsewhere (GPU, or a torch without the op) it is plain `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed = None
        if (pack and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
                self.weight = None  # the packed copy replaces it
            except (RuntimeError, AttributeError):
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # (packed)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Embedding:
    """Rows of a float table: ids [T] -> [T, hidden]."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # [vocab, hidden]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


Linear = PackedLinear | QuantLinear


class ReducedHead:
    """The LM head over a subset of the vocabulary: the full head's rows for `ids`,
    multiplied alone, so a slim or drafting pass reads N of the V head rows. Its logits at those ids
    are the full head's (bit for bit on native weights: rows are independent); every other id gets
    -inf (probability 0), so a draft outside the subset is one the pass cannot judge.

    ids: [N] ascending token ids; linear: hidden -> N."""

    def __init__(self, ids: torch.Tensor, linear: Linear, vocab_size: int):
        self.ids, self.linear, self.vocab_size = ids, linear, vocab_size
        self.member = torch.zeros(vocab_size, dtype=torch.bool)  # [V] True inside the subset
        self.member[ids] = True
        self.size = ids.numel()  # (a Python int: every drafting pass' cost asks for it)

    def __len__(self) -> int:
        return self.size

    @functools.cached_property
    def id_list(self) -> list[int]:
        """`ids` as Python ints: a greedy drafter maps its argmax through them every drafted token."""
        return self.ids.tolist()

    @functools.cached_property
    def digest(self) -> str:
        """The ids' sha256 (hex, 16 digits): which subset, for what is kept of its passes' times."""
        return hashlib.sha256(self.ids.numpy().astype("<i8").tobytes()).hexdigest()[:16]

    def expand(self, out: PassOutput) -> PassOutput:
        """[T, N] -> [T, V]: the subset's logits in place, -inf elsewhere. Where the pass' head found
        its rows' maxima, the expanded rows' are known too (ids ascending: the first maximum maps to the
        first; a row of -inf alone would have its first at id 0, so those rows are left unknown)."""
        logits, known = out.logits, out.argmax
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), dtype=logits.dtype)
        full[:, self.ids] = logits
        if known is not None and (logits.numpy()[np.arange(len(known)), known] > float("-inf")).all():
            return PassOutput(full, [self.id_list[i] for i in known])
        return PassOutput(full)

    def contains(self, tokens: list[int]) -> list[bool]:
        return self.member[torch.tensor(tokens, dtype=torch.long)].tolist() if tokens else []


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (n_heads + 2 n_kv_heads) * head_dim
    o: Linear  # n_heads * head_dim -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 intermediate
    down: Linear  # intermediate -> hidden
    # Gemma only (None in the Llama family)
    post_attn_norm: torch.Tensor | None = None  # [hidden]
    post_mlp_norm: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    sliding: bool = False  # a sliding-window layer
    rope: int = 0  # which RoPE table (0 global, 1 local)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def _rope_table(theta: float, factor: float, head_dim: int, n_pos: int) -> torch.Tensor:
    """[n_pos, head_dim] rotation angles (float64), halves duplicated as transformers lays them out."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)) / factor
    angles = torch.outer(torch.arange(n_pos, dtype=torch.float64), inv_freq)
    return torch.cat([angles, angles], dim=-1)


def _attention(q, k, v, mask, scale: float, softcap: float | None, gqa: bool) -> torch.Tensor:
    """q [1, H, T, d], k/v [1, Hkv, S, d], mask [T, S] bool or None -> [1, H, T, d]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    # SDPA has no soft-capping: the eager product (gemma2)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = _softcap(q @ k.transpose(-1, -2) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
