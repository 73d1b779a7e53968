"""A lean decoder forward pass for the Llama family (llama / SmolLM2, qwen2, mistral) and the Gemma
family (gemma2, gemma3), with routes.

Glossary
- route: which sub-layers of the verifier run. `LayerMask(attn, mlp)`, one bool per layer each; a
  skipped sub-layer leaves the residual stream unchanged. `None` means the full model.
- KV cache: one preallocated buffer per model, `[n_layers, n_kv_heads, max_len, head_dim]`, written
  by position. Rollback sets lengths; it never copies.
- n_full: the number of positions whose K/V is valid in *every* layer (written by a full pass).
  A routed pass writes only its kept attention layers, only at positions >= n_full, and reads
  positions < n_full from the full model's entries. A full pass starts at or before n_full and
  recomputes every layer, overwriting routed entries. `KVCache` enforces this: a pass that would
  read entries its route did not write raises.

The forward pass is written once; architectures differ only in `ModelConfig` fields, read once at
construction (QKV bias for qwen2; for Gemma: embedding scale sqrt(hidden), RMSNorm weights (1 + w)
folded in when the weights are loaded, norms after attention and MLP as well as before, gated tanh-GeLU,
query/key norms (gemma3), attention and final logit soft-capping (gemma2), sliding-window layers
interleaved with global ones, each kind with its own RoPE base, and `query_pre_attn_scalar`).
The Llama path runs none of the Gemma code: each switch is a constant of the model.

Weights in the model file's own format (`native`, the default for a GGUF) run the same pass as one
ggml graph (`models/ggml_forward.py`); `Decoder.forward` still checks the route and the cache
invariant around it. The torch code below is the float path (float32, the reference; bfloat16).
Every row attends row by row in both, in passes of at most ROW_ATTENTION_MAX rows (longer ones are
split), so that a row's result does not depend on the other rows of its pass (what makes lossless
strategies equal `ar` token for token, and a request's tokens the same in any batch).
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from viasd.errors import UnsupportedArchitectureError
from viasd.models import batching, ggml_forward
from viasd.models.ggml_kernels import NativeTensor, QuantEmbedding, QuantLinear
from viasd.models import prefix
from viasd.models.prefix import PrefixCache

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "gemma3_text", "t5")
# model_type -> family: one forward pass per family, switched by ModelConfig fields
FAMILIES = {"llama": "llama", "qwen2": "llama", "mistral": "llama", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma",
            "t5": "t5"}
# what `viasd models` says of each family: (architectures, what the runtime implements, what runs on it)
FAMILY_SUPPORT = {
    "llama": ("llama (SmolLM2), qwen2, mistral", "decoder-only; RoPE, GQA, QKV bias (qwen2)",
              "routes (layer and sub-layer), every strategy, DIMR search"),
    "gemma": ("gemma2, gemma3 (text)", "decoder-only; sqrt(hidden) embedding scale, (1+w) sandwich norms, tanh-GeLU, "
              "q/k norms (3), soft-capping (2), sliding-window layers with a local RoPE base",
              "routes (layer and sub-layer), every strategy, DIMR search"),
    "t5": ("t5 (T5, T5 v1.1 / Flan-T5 gated-GeLU)", "encoder-decoder; transformers' encoder run once per prompt, our "
           "decoder with relative position bias and cross-attention K/V cached once",
           "decoder routes (given as layers or a route file; no DIMR search), every strategy (drafters: a smaller T5, "
           "n-gram lookup over the source, a decoder route)"),
}


def _rope_theta(params: dict | None, default: float) -> tuple[float, float]:
    """(theta, linear scaling factor) from a transformers rope_parameters dict; only default/linear RoPE."""
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", None):
        raise UnsupportedArchitectureError(f"unsupported RoPE scaling {rope_type!r}")
    factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
    return float(params.get("rope_theta", default)), factor


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    qkv_bias: bool
    tied_embeddings: bool
    max_positions: int
    # --- family switches (defaults: the Llama family) ---
    family: str = "llama"
    embed_scale: float | None = None  # multiply embeddings by this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma)
    activation: str = "silu"  # gated MLP activation: "silu" or "gelu_tanh"
    qk_norm: bool = False  # RMSNorm of queries and keys per head (gemma3)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention logits (gemma2)
    final_softcap: float | None = None  # tanh soft-capping of output logits (gemma2)
    sliding_window: int | None = None  # window of the sliding layers (keys q - window < p <= q)
    sliding_layers: tuple[bool, ...] = ()  # per layer: True = sliding-window layer ('local')
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    rope_factor: float = 1.0  # linear RoPE scaling of the global layers

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a transformers `PretrainedConfig`."""
        arch = hf.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {arch!r}: the runtime supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if FAMILIES[arch] == "gemma":
            return cls._gemma_from_hf(getattr(hf, "text_config", None) or hf)
        if FAMILIES[arch] == "t5":
            from viasd.models.t5 import t5_config

            return t5_config(hf)
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedArchitectureError(f"unsupported RoPE scaling {rope_type!r} in {arch} config")
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", arch == "mistral"):
            # Full attention equals sliding-window attention while sequences stay shorter than the window.
            max_pos = min(hf.max_position_embeddings, hf.sliding_window)
        else:
            max_pos = hf.max_position_embeddings
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            architecture=arch,
            n_layers=hf.num_hidden_layers,
            hidden=hf.hidden_size,
            n_heads=hf.num_attention_heads,
            n_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            intermediate=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rope_theta=float(theta),
            rms_eps=float(hf.rms_norm_eps),
            qkv_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            tied_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_positions=int(max_pos),
        )

    @classmethod
    def _gemma_from_hf(cls, hf) -> "ModelConfig":
        arch = hf.model_type
        if getattr(hf, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError(f"{arch} with bidirectional attention is not a decoder")
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedArchitectureError(f"unsupported {arch} activation {act!r}")
        n_layers = hf.num_hidden_layers
        types = list(getattr(hf, "layer_types", None) or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)])
        sliding = tuple(t == "sliding_attention" for t in types)
        rope = getattr(hf, "rope_parameters", None) or {}
        if "full_attention" in rope or "sliding_attention" in rope:  # gemma3: one per layer kind
            theta, factor = _rope_theta(rope.get("full_attention"), getattr(hf, "rope_theta", 1e6))
            local, local_factor = _rope_theta(rope.get("sliding_attention"), getattr(hf, "rope_local_base_freq", 1e4))
            if local_factor != 1.0:
                raise UnsupportedArchitectureError(f"unsupported RoPE scaling of {arch}'s sliding layers")
        else:  # gemma2: one RoPE for both kinds
            theta, factor = _rope_theta(rope, getattr(hf, "rope_theta", 10000.0))
            local = None
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        window = getattr(hf, "sliding_window", None)
        return cls(
            architecture=arch,
            n_layers=n_layers,
            hidden=hf.hidden_size,
            n_heads=hf.num_attention_heads,
            n_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            intermediate=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rope_theta=theta,
            rms_eps=float(hf.rms_norm_eps),
            qkv_bias=bool(getattr(hf, "attention_bias", False)),
            tied_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
            max_positions=int(hf.max_position_embeddings),
            family="gemma",
            embed_scale=float(hf.hidden_size) ** 0.5,
            sandwich_norms=True,
            activation="gelu_tanh",
            qk_norm=arch != "gemma2",
            attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None),
            final_softcap=getattr(hf, "final_logit_softcapping", None),
            sliding_window=int(window) if window and any(sliding) else None,
            sliding_layers=sliding if window else (False,) * n_layers,
            rope_local_theta=local,
            rope_factor=factor,
        )


@dataclass(frozen=True)
class LayerMask:
    """Which sub-layers run: `attn[i]` / `mlp[i]` for layer i. Hashable, so it keys cache lengths."""

    attn: tuple[bool, ...]
    mlp: tuple[bool, ...]

    @classmethod
    def from_layers(cls, n_layers: int, kept: "list[int] | tuple[int, ...]") -> "LayerMask":
        keep = tuple(i in set(kept) for i in range(n_layers))
        return cls(attn=keep, mlp=keep)

    @property
    def n_layers(self) -> int:
        return len(self.attn)

    @property
    def fraction(self) -> float:
        """Share of sub-layer work kept (attention and MLP counted alike)."""
        return (sum(self.attn) + sum(self.mlp)) / (2 * len(self.attn))

    @property
    def is_full(self) -> bool:
        return all(self.attn) and all(self.mlp)

    @functools.cached_property
    def prefix(self) -> int:
        """How many leading layers the route keeps whole (attention and MLP). A pass along it computes,
        exactly as the full model does, the residual stream entering layer `prefix` and the K/V of
        every layer below it: what a full pass can resume from (see `KVCache.enable_resume`)."""
        return next((i for i, (a, m) in enumerate(zip(self.attn, self.mlp)) if not (a and m)), self.n_layers)

    @classmethod
    def lower(cls, n_layers: int, m: int) -> "LayerMask":
        """The route of layers 0 .. m-1 only."""
        return cls.from_layers(n_layers, range(m))


class KVCache:
    """Preallocated K/V buffers written by position, with per-route valid lengths.

    k, v: [n_layers, n_kv_heads, max_len, head_dim]
    """

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device | str):
        shape = (config.n_layers, config.n_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.n_full = 0
        # route -> number of leading positions valid for that route (always >= n_full when read)
        self._routed: dict[LayerMask, int] = {}
        self._hidden_size, self._dtype, self._device = config.hidden, dtype, device
        # resumable full passes (off until `enable_resume`): the residual stream entering layer
        # `resume_layer`, per position, [max_len, hidden]; positions < n_exact hold it and the full
        # model's own K/V in every layer below it (n_exact >= n_full)
        self.resume_layer: int | None = None
        self.hidden: torch.Tensor | None = None
        self.n_exact = 0

    def enable_resume(self, layer: int) -> None:
        """Keep, from now on, what a full pass needs to start at `layer` (0 < layer < n_layers) for
        positions a routed pass already processed: a pass along a route with `prefix >= layer` (or a
        full pass) stores the residual stream entering `layer`; its K/V below `layer` are then the full
        model's own. Only on an empty cache."""
        n_layers = self.k.shape[0]
        if not 0 < layer < n_layers:
            raise ValueError(f"resume layer must be in 1 .. {n_layers - 1}, got {layer}")
        if self.n_full or self._routed:
            raise ValueError("resuming is enabled on an empty cache only")
        self.resume_layer = layer
        self.hidden = torch.zeros(self.max_len, self._hidden_size, dtype=self._dtype, device=self._device)
        self.n_exact = 0

    def saves_hidden(self, route: LayerMask | None) -> bool:
        """Whether a pass along `route` (None: full) computes the residual stream entering the resume layer."""
        return self.resume_layer is not None and (route is None or route.prefix >= self.resume_layer)

    def length(self, route: LayerMask | None = None) -> int:
        """Positions a pass along `route` may read: a new pass must start at or before this."""
        if route is None:
            return self.n_full
        length = max(self.n_full, self._routed.get(route, 0))
        if self.resume_layer is not None and not any(route.attn[self.resume_layer :]):
            length = max(length, self.n_exact)  # every layer it reads is the full model's up to n_exact
        return length

    def rollback(self, n: int) -> None:
        """Forget every position >= n (for every route). Rejected slots are overwritten later."""
        self.n_full = min(self.n_full, n)
        self.n_exact = min(self.n_exact, n)
        self._routed = {r: min(length, n) for r, length in self._routed.items() if min(length, n) > self.n_full}

    def rollback_route(self, route: LayerMask, n: int) -> None:
        """Forget positions >= n for one route only (its rejected drafts); n_full is untouched."""
        if route in self._routed:
            self._routed[route] = min(self._routed[route], n)
            if self._routed[route] <= self.n_full:
                del self._routed[route]
        if self.resume_layer is not None and route.prefix >= self.resume_layer:  # its stored states went with them
            self.n_exact = max(self.n_full, min(self.n_exact, n))

    def resumable(self, start: int, end: int) -> bool:
        """Whether a full pass over positions start .. end-1 may start at the resume layer."""
        return self.resume_layer is not None and start <= self.n_full and end <= self.n_exact

    def _begin(self, route: LayerMask | None, start: int, n_tokens: int, resume: bool = False) -> None:
        if resume and (route is not None or not self.resumable(start, start + n_tokens)):
            raise ValueError(f"a full pass over positions {start} .. {start + n_tokens - 1} cannot resume at layer "
                             f"{self.resume_layer}: stored states reach {self.n_exact} (n_full={self.n_full})")
        if start + n_tokens > self.max_len:
            raise ValueError(f"KV cache overflow: positions up to {start + n_tokens} > max_len {self.max_len}")
        if start > self.length(route):
            raise ValueError(
                f"pass along {'full model' if route is None else 'route'} starts at {start} but only "
                f"{self.length(route)} positions are valid for it (n_full={self.n_full})"
            )
        if route is not None and start < self.n_full:
            raise ValueError(f"a routed pass must start at or after n_full={self.n_full} (got {start}): "
                             "it would overwrite the full model's K/V")

    def _commit(self, route: LayerMask | None, start: int, end: int) -> None:
        if self.resume_layer is not None:
            if self.saves_hidden(route):  # [start, end) now hold exact lower layers and stored states
                if start <= self.n_exact:
                    self.n_exact = end
            elif any(route.attn[: self.resume_layer]):  # it wrote lower layers' K/V from a routed stream
                self.n_exact = min(self.n_exact, start)
        if route is None:
            # A full pass makes [start, end) valid in every layer; routed entries past it were
            # computed on routed prefixes and are dropped.
            self.n_full = end
            self._routed = {}
        else:
            # Other routes may share the layers just overwritten: they lose positions >= start.
            self._routed = {r: min(length, start) for r, length in self._routed.items() if r != route}
            self._routed[route] = end
            self._routed = {r: length for r, length in self._routed.items() if length > self.n_full}


_clock = threading.local()  # per thread: seconds spent in `Decoder.forward`


def forward_seconds() -> float:
    """Seconds the calling thread has spent in `Decoder.forward` calls so far (model passes, waiting
    for a batch's pass included): what a decode spends outside them is host time (`DecodeStats`)."""
    return getattr(_clock, "s", 0.0)


ROW_ATTENTION_MAX = 64  # passes of up to this many rows attend row by row (batch-invariant; see Decoder.forward)


def begin_pass(config: ModelConfig, cache: KVCache, route: LayerMask | None, start: int, n_tokens: int,
               resume: bool = False) -> tuple[LayerMask | None, int]:
    """Checks shared by every decoder forward: a route keeping every layer is the full pass, a route
    must fit the model, and the cache must allow a pass along it at `start` (`resume`: a full pass
    starting at the cache's resume layer). Returns (route, end)."""
    if route is not None and route.is_full:
        route = None
    if route is not None and route.n_layers != config.n_layers:
        raise ValueError(f"route has {route.n_layers} layers, model has {config.n_layers}")
    cache._begin(route, start, n_tokens, resume)
    return route, start + n_tokens


class PackedLinear:
    """y = x @ W.T (+ b), with W prepacked for oneDNN on CPU.

    On this project's CPUs, MKL's sgemm takes a slow generic path for the small-M products of
    decoding (M = 1..16 rows); oneDNN on a prepacked weight is 2-5x faster there and never slower.
    Elsewhere (GPU, or a torch without the op) it is plain `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight = weight
        self.packed = None
        if pack and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
                self.weight = None  # the packed copy replaces it
            except (RuntimeError, AttributeError):
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
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
    """The LM head over a subset of the vocabulary (issue 11 item 3): the full head's rows for `ids`,
    multiplied alone, so a slim or drafting pass reads N of the V head rows. Its logits at those ids
    are the full head's (bit for bit on native weights: rows are independent); every other id gets
    -inf (probability 0), so a draft outside the subset is one the pass cannot judge.

    ids: [N] ascending token ids; linear: hidden -> N."""

    def __init__(self, ids: torch.Tensor, linear: Linear, vocab_size: int):
        self.ids, self.linear, self.vocab_size = ids, linear, vocab_size
        self.member = torch.zeros(vocab_size, dtype=torch.bool)  # [V] True inside the subset
        self.member[ids] = True

    def __len__(self) -> int:
        return self.ids.numel()

    def expand(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, N] -> [T, V]: the subset's logits in place, -inf elsewhere."""
        out = torch.full((logits.shape[0], self.vocab_size), float("-inf"), dtype=logits.dtype)
        out[:, self.ids] = logits
        return out

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


@dataclass
class Decoder:
    """Weights of one model and its forward pass. Holds no per-request state (that is the KVCache)."""

    is_encoder_decoder: ClassVar[bool] = False  # see models/t5.py for the encoder-decoder one
    config: ModelConfig
    embed: Embedding | QuantEmbedding  # ids [T] -> [T, hidden]
    layers: list[_Layer]
    norm: torch.Tensor  # [hidden]
    lm_head: Linear  # hidden -> vocab
    dtype: torch.dtype
    device: torch.device
    _cos: torch.Tensor = field(repr=False)  # [n_tables, max_positions, head_dim]: global, then local RoPE
    _sin: torch.Tensor = field(repr=False)
    _graph: "ggml_forward.NativeForward | None" = field(default=None, repr=False)  # native weights: the pass as a ggml graph
    _head_weight: torch.Tensor | None = field(default=None, repr=False)  # float weights: the head unpacked (reduced heads)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pack: bool | str = True,
        native: dict[str, NativeTensor] | None = None,
    ) -> "Decoder":
        """Build from transformers-named weights (`model.layers.{i}.self_attn.q_proj.weight`, ...).

        `pack=False` keeps plain `F.linear` (MKL) products: slower here, bit-closer to transformers.
        `native`: weights in the model file's own (quantized) format, by the same names; those it holds
        are multiplied and looked up by ggml's kernels (models/ggml_kernels.py), the rest come from `state`.
        """
        device = torch.device(device)
        native = native or {}
        if native and (device.type != "cpu" or dtype != torch.float32):
            raise ValueError("native weights run on the CPU with float32 activations")

        def linear(names: list[str], bias: torch.Tensor | None = None) -> Linear:
            if all(n in native for n in names):
                return QuantLinear([native[n] for n in names], bias)
            return PackedLinear(torch.cat([get(n) for n in names]), bias, pack)

        gemma = config.family == "gemma"
        if gemma and "model.embed_tokens.weight" not in state:  # a multimodal Gemma 3 checkpoint: its text model
            state = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): w
                     for k, w in state.items()}

        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise UnsupportedArchitectureError(f"checkpoint lacks tensor {name!r} expected for {config.architecture}")
            return state[name].to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            # Gemma's RMSNorm multiplies by (1 + w): folded into the weight once, here
            if not gemma:
                return get(name)
            get(name)  # (a missing tensor: the clear error)
            return (state[name].to(device=device, dtype=torch.float32) + 1.0).to(dtype)

        layers = []
        for i in range(config.n_layers):
            p = f"model.layers.{i}."
            qkv_b = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
            sliding = bool(config.sliding_layers and config.sliding_layers[i])
            layers.append(
                _Layer(
                    attn_norm=norm(p + "input_layernorm.weight"),
                    qkv=linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"], qkv_b),
                    o=linear([p + "self_attn.o_proj.weight"]),
                    # Llama names its pre-MLP norm post_attention_layernorm; Gemma has both
                    mlp_norm=norm(p + ("pre_feedforward_layernorm.weight" if config.sandwich_norms else "post_attention_layernorm.weight")),
                    gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=linear([p + "mlp.down_proj.weight"]),
                    post_attn_norm=norm(p + "post_attention_layernorm.weight") if config.sandwich_norms else None,
                    post_mlp_norm=norm(p + "post_feedforward_layernorm.weight") if config.sandwich_norms else None,
                    q_norm=norm(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                    k_norm=norm(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                    sliding=sliding,
                    rope=1 if sliding and config.rope_local_theta is not None else 0,
                )
            )
        head = "model.embed_tokens.weight" if config.tied_embeddings or "lm_head.weight" not in state else "lm_head.weight"
        if "model.embed_tokens.weight" in native:
            embed = QuantEmbedding(native["model.embed_tokens.weight"])
        else:
            embed = Embedding(get("model.embed_tokens.weight"))
        tables = [_rope_table(config.rope_theta, config.rope_factor, config.head_dim, config.max_positions)]
        if any(layer.rope == 1 for layer in layers):
            tables.append(_rope_table(config.rope_local_theta, 1.0, config.head_dim, config.max_positions))
        angles = torch.stack(tables)  # [n_tables, max_positions, head_dim]
        decoder = cls(
            config=config,
            embed=embed,
            layers=layers,
            norm=norm("model.norm.weight"),
            lm_head=linear([head]),
            _head_weight=None if head in native else get(head),
            dtype=dtype,
            device=device,
            _cos=angles.cos().to(device=device, dtype=dtype),
            _sin=angles.sin().to(device=device, dtype=dtype),
        )
        if native and ggml_forward.supports(decoder):
            decoder._graph = ggml_forward.NativeForward(decoder, pack=pack)  # the whole pass as one ggml graph
        return decoder

    def weight_bytes(self, route: LayerMask | None = None, from_layer: int = 0, head: "bool | ReducedHead" = True) -> int:
        """Bytes of weights a pass along `route` reads (None: the full model): each kept sub-layer's
        products from layer `from_layer` on (a resumed pass) and the LM head (`head`: True the full
        one, a `ReducedHead`, or False: none); norms and the embedding rows of a pass are negligible.
        In the weights' stored format: a native model's file blocks, a float model's floats. What a
        pass costs one token when decoding is bound by weight bandwidth (issue 11's cost accounting)."""
        key = (route if route is not None and not route.is_full else None, from_layer, head if isinstance(head, bool) else len(head))
        cached = self.__dict__.setdefault("_weight_bytes", {})
        if key not in cached:
            size = lambda lin: lin.nbytes if isinstance(lin, QuantLinear) else (  # noqa: E731
                lin.out_features * lin.in_features * torch.empty((), dtype=self.dtype).element_size())
            mask = key[0]
            total = 0 if head is False else size(self.lm_head if head is True else head.linear)
            for i, layer in enumerate(self.layers[from_layer:], start=from_layer):
                if mask is None or mask.attn[i]:
                    total += size(layer.qkv) + size(layer.o)
                if mask is None or mask.mlp[i]:
                    total += size(layer.gate_up) + size(layer.down)
            cached[key] = total
        return cached[key]

    def reduced_head(self, ids) -> ReducedHead:
        """The LM head over token ids `ids` (kept per id set: built once, packed like the full head)."""
        key = ids if isinstance(ids, tuple) else tuple(int(i) for i in ids)  # (a route's vocabulary: a tuple already)
        heads = self.__dict__.setdefault("_reduced_heads", {})
        if key not in heads:
            vocab = self.lm_head.out_features
            index = torch.tensor(key, dtype=torch.long)
            if not key or any(a >= b for a, b in zip(key, key[1:])) or key[0] < 0 or key[-1] >= vocab:
                raise ValueError(f"a reduced head needs ascending, distinct token ids in [0, {vocab})")
            if isinstance(self.lm_head, QuantLinear):
                parts, offset = [], 0
                for part in self.lm_head.parts:  # each part's own rows among the ids, in order
                    inside = index[(index >= offset) & (index < offset + part.rows)] - offset
                    if inside.numel():
                        parts.append(part.rows_at(inside))
                    offset += part.rows
                linear = QuantLinear(parts, None)
                if self._graph is not None:
                    self._graph.pack_parts(linear, count=False)
            else:
                linear = PackedLinear(self._head_weight.index_select(0, index).contiguous(), None)
            heads[key] = ReducedHead(index, linear, vocab)
        return heads[key]

    @property
    def native(self) -> bool:
        """Whether it runs weights in the model file's own format (ggml kernels)."""
        return isinstance(self.lm_head, QuantLinear) or any(isinstance(layer.qkv, QuantLinear) for layer in self.layers)

    @property
    def graph_build_s(self) -> float:
        """Seconds spent building forward graphs so far (native weights; 0 otherwise)."""
        return self._graph.build_s if self._graph is not None else 0.0

    def new_cache(self, max_len: int) -> KVCache:
        if max_len > self.config.max_positions:
            raise ValueError(f"sequence of {max_len} positions exceeds the model's {self.config.max_positions}")
        if self._graph is not None:  # rounded up: graphs are built per cache length
            max_len = ggml_forward.cache_length(max_len, self.config.max_positions)
        return KVCache(self.config, max_len, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        cache: KVCache,
        route: LayerMask | None = None,
        last_only: bool = False,
        resume: bool = False,
        logits: bool = True,
        head: ReducedHead | None = None,
    ) -> torch.Tensor | None:
        """Logits for `tokens` at positions start .. start+T-1, reading and writing `cache`.

        tokens: [T] int64. Returns [T, vocab] float32 logits ([1, vocab] with `last_only`; None
        without `logits`: no head, the pass only fills the cache). A routed pass runs only the
        sub-layers `route` keeps and writes K/V only for its kept attention layers; see the module
        docstring for the n_full invariant. `resume` (a full pass): start at the cache's resume layer
        from the residual streams stored there (`KVCache.enable_resume`); a pass that computes the
        stream entering that layer stores it. `head`: logits over a reduced vocabulary only (-inf
        elsewhere; see `ReducedHead`).
        """
        t0 = time.perf_counter()
        try:
            if (start == 0 and route is None and not resume and (last_only or not logits) and cache.n_full == 0
                    and not cache._routed and (kept := prefix.active(self)) is not None):
                return self._prefill(kept, tokens, cache, last_only, logits, head)
            if (session := batching.current()) is not None:  # a request of a batch: the compute thread runs it with others
                return session.forward(self, tokens, start, cache, route=route, last_only=last_only, resume=resume,
                                       logits=logits, head=head)
            return self._forward(tokens, start, cache, route, last_only, resume, logits, head)
        finally:
            _clock.s = getattr(_clock, "s", 0.0) + time.perf_counter() - t0

    def _prefill(self, kept: PrefixCache, tokens: torch.Tensor, cache: KVCache, last_only: bool, logits: bool,
                 head: ReducedHead | None) -> torch.Tensor | None:
        """A prompt's pass from position 0 through the prefix cache: the longest cached prefix's K/V
        copied in, the rest computed, the whole prompt's K/V kept for the next one."""
        ids = tokens.tolist()
        n = 0
        if (hit := kept.lookup(ids, cache.resume_layer)) is not None:
            n, k, v, hidden = hit
            cache.k[:, :, :n].copy_(k[:, :, :n])
            cache.v[:, :, :n].copy_(v[:, :, :n])
            if hidden is not None:
                cache.hidden[:n].copy_(hidden[:n])
            cache._commit(None, 0, n)
        rest = tokens[n:]
        if (session := batching.current()) is not None:
            out = session.forward(self, rest, n, cache, last_only=last_only, logits=logits, head=head)
        else:
            out = self._forward(rest, n, cache, None, last_only, False, logits, head)
        kept.store(ids, cache.k, cache.v, cache.hidden, cache.resume_layer)
        return out

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, start: int, cache: KVCache, route: LayerMask | None = None,
                 last_only: bool = False, resume: bool = False, logits: bool = True,
                 head: ReducedHead | None = None) -> torch.Tensor | None:
        """`forward` itself, on this thread (no batch session, no prefix cache)."""
        n_tokens = tokens.shape[0]
        route, end = begin_pass(self.config, cache, route, start, n_tokens, resume)
        first = cache.resume_layer if resume else 0
        save = cache.resume_layer if cache.saves_hidden(route) and not resume else None
        # No pass attends more than ROW_ATTENTION_MAX rows at once: longer ones (a prompt, tiered mode's
        # pending run) go in chunks, each attending row by row, so that every row comes out as it does
        # decoded alone or in any batch (a long pending run checked in one tiled pass made correction
        # mode differ from `ar`). One logical pass: the cache records it once, at the end.
        outs = []
        for a in range(start, end, ROW_ATTENTION_MAX):
            b = min(a + ROW_ATTENTION_MAX, end)
            out = self._rows(tokens[a - start : b - start], a, cache, route, last_only, first, save,
                             logits and (not last_only or b == end), head)
            if out is not None:
                outs.append(out)
        cache._commit(route, start, end)
        if not outs:
            return None
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.config.final_softcap is not None:
            out = _softcap(out, self.config.final_softcap)
        return out if head is None else head.expand(out)

    @torch.inference_mode()
    def forward_many(self, calls: list[tuple[tuple, dict]], rows: int | None = None) -> list:
        """Several requests' `forward(*args, **kwargs)` calls (native weights, one route and head, at
        most ROW_ATTENTION_MAX rows each, all resumed at one layer or none, all storing the streams
        entering one layer or none: `batching._group_key`) as one pass: every product over all their
        rows, each request's rows attending its own cache (and reading or storing its own streams).
        `rows`: each call padded to that many rows (its last token repeated; those rows' outputs
        dropped, their K/V and streams past its positions). Returns each call's result, or the
        exception its checks raised (the others run)."""
        results: list = [None] * len(calls)
        runnable, route, head, first, save = [], None, None, 0, None
        for i, (args, kw) in enumerate(calls):
            tokens, start, cache = args
            n = tokens.shape[0]
            resume = kw.get("resume", False)
            try:
                route, end = begin_pass(self.config, cache, kw.get("route"), start, n, resume)
            except Exception as e:
                results[i] = e
                continue
            first = cache.resume_layer if resume else 0
            save = cache.resume_layer if cache.saves_hidden(route) and not resume else None
            head = kw.get("head")
            pad = (rows or n) - n
            if pad:
                tokens = torch.cat([tokens, tokens[-1:].expand(pad)])
            want = (0, 0) if not kw.get("logits", True) else (n - 1, 1) if kw.get("last_only") else (0, n)  # its own rows only
            runnable.append((i, tokens, start, cache, want, end))
        if not runnable:
            return results
        outs = self._graph.run([(t, s, c, w) for _, t, s, c, w, _ in runnable], route, first, save, head)
        for (i, _, start, cache, _, end), out in zip(runnable, outs):
            cache._commit(route, start, end)
            if out is not None and self.config.final_softcap is not None:
                out = _softcap(out, self.config.final_softcap)
            results[i] = out if out is None or head is None else head.expand(out)
        return results

    def _rows(self, tokens: torch.Tensor, start: int, cache: KVCache, route: LayerMask | None, last_only: bool,
              first: int, save: int | None, logits: bool, head: ReducedHead | None) -> torch.Tensor | None:
        """One chunk of `forward` (at most ROW_ATTENTION_MAX rows; the cache's bookkeeping is the caller's):
        raw logits [T, V] ([1, V] with `last_only`, [T, N] over a reduced head), or None."""
        n_tokens = tokens.shape[0]
        end = start + n_tokens
        cfg = self.config
        if self._graph is not None:
            return self._graph(tokens, start, cache, route, last_only, first, save, logits, head)

        if first:  # a resumed pass
            x = cache.hidden[start:end].clone()  # [T, hidden] entering layer `first`
        else:
            x = self.embed(tokens)  # [T, hidden]
            if cfg.embed_scale is not None:
                x = x * cfg.embed_scale
        # per RoPE table (global, local): [T, 1, head_dim]
        ropes = [(self._cos[t, start:end, None, :], self._sin[t, start:end, None, :]) for t in range(self._cos.shape[0])]
        # Attention is batch-invariant: each query row attends alone to exactly the keys it sees, so a
        # row's result does not depend on which other rows share its pass (a drafted block or a single
        # token: the same kernel on the same data).
        window = cfg.sliding_window or 0
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        gqa = cfg.n_heads != cfg.n_kv_heads
        nq, nkv, hd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
        for i, layer in enumerate(self.layers[first:], start=first):
            if i == save:
                cache.hidden[start:end] = x
                if not logits and route is not None and not any(route.attn[i:]) and not any(route.mlp[i:]):
                    break  # nothing past here is kept, and no head
            if route is None or route.attn[i]:
                h = _rms_norm(x, layer.attn_norm, cfg.rms_eps)
                qkv = layer.qkv(h)  # [T, nq + 2 nkv]
                q = qkv[:, :nq].view(n_tokens, cfg.n_heads, hd)
                k = qkv[:, nq : nq + nkv].view(n_tokens, cfg.n_kv_heads, hd)
                v = qkv[:, nq + nkv :].view(n_tokens, cfg.n_kv_heads, hd)
                if layer.q_norm is not None:
                    q = _rms_norm(q, layer.q_norm, cfg.rms_eps)
                    k = _rms_norm(k, layer.k_norm, cfg.rms_eps)
                cos, sin = ropes[layer.rope]
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                cache.k[i, :, start:end] = k.transpose(0, 1)
                cache.v[i, :, start:end] = v.transpose(0, 1)
                qh = q.transpose(0, 1)[None]  # [1, n_heads, T, hd]
                rows = []
                for j in range(n_tokens):  # position p = start + j sees keys lo .. p
                    p = start + j
                    lo = max(0, p - window + 1) if layer.sliding else 0
                    rows.append(_attention(qh[:, :, j : j + 1], cache.k[i, None, :, lo : p + 1], cache.v[i, None, :, lo : p + 1],
                                           None, scale, cfg.attn_softcap, gqa))  # [1, n_heads, 1, hd]
                attn = rows[0] if n_tokens == 1 else torch.cat(rows, dim=2)  # [1, n_heads, T, hd]
                a = layer.o(attn[0].transpose(0, 1).reshape(n_tokens, nq))
                if layer.post_attn_norm is not None:
                    a = _rms_norm(a, layer.post_attn_norm, cfg.rms_eps)
                x = x + a
            if route is None or route.mlp[i]:
                h = _rms_norm(x, layer.mlp_norm, cfg.rms_eps)
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
                gate = F.silu(gate) if cfg.activation == "silu" else F.gelu(gate, approximate="tanh")
                m_out = layer.down(gate * up)
                if layer.post_mlp_norm is not None:
                    m_out = _rms_norm(m_out, layer.post_mlp_norm, cfg.rms_eps)
                x = x + m_out
        if not logits:
            return None
        if last_only:
            x = x[-1:]
        return (self.lm_head if head is None else head.linear)(_rms_norm(x, self.norm, cfg.rms_eps)).float()
