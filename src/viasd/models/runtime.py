"""A lean decoder forward pass for the Llama family (llama / SmolLM2, qwen2, mistral), with routes.

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

The forward pass is written once for the whole family; architectures differ only in
`ModelConfig` fields (QKV bias for qwen2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from viasd.errors import UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


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

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a transformers `PretrainedConfig`."""
        arch = hf.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {arch!r}: the runtime supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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

    def length(self, route: LayerMask | None = None) -> int:
        """Positions a pass along `route` may read: a new pass must start at or before this."""
        if route is None:
            return self.n_full
        return max(self.n_full, self._routed.get(route, 0))

    def rollback(self, n: int) -> None:
        """Forget every position >= n (for every route). Rejected slots are overwritten later."""
        self.n_full = min(self.n_full, n)
        self._routed = {r: min(length, n) for r, length in self._routed.items() if min(length, n) > self.n_full}

    def rollback_route(self, route: LayerMask, n: int) -> None:
        """Forget positions >= n for one route only (its rejected drafts); n_full is untouched."""
        if route in self._routed:
            self._routed[route] = min(self._routed[route], n)
            if self._routed[route] <= self.n_full:
                del self._routed[route]

    def _begin(self, route: LayerMask | None, start: int, n_tokens: int) -> None:
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


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: PackedLinear  # hidden -> (n_heads + 2 n_kv_heads) * head_dim
    o: PackedLinear  # n_heads * head_dim -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: PackedLinear  # hidden -> 2 intermediate
    down: PackedLinear  # intermediate -> hidden


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class Decoder:
    """Weights of one model and its forward pass. Holds no per-request state (that is the KVCache)."""

    config: ModelConfig
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[_Layer]
    norm: torch.Tensor  # [hidden]
    lm_head: PackedLinear  # hidden -> vocab
    dtype: torch.dtype
    device: torch.device
    _cos: torch.Tensor = field(repr=False)  # [max_positions, head_dim]
    _sin: torch.Tensor = field(repr=False)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pack: bool = True,
    ) -> "Decoder":
        """Build from transformers-named weights (`model.layers.{i}.self_attn.q_proj.weight`, ...).

        `pack=False` keeps plain `F.linear` (MKL) products: slower here, bit-closer to transformers.
        """
        device = torch.device(device)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
            return PackedLinear(weight, bias, pack)

        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise UnsupportedArchitectureError(f"checkpoint lacks tensor {name!r} expected for {config.architecture}")
            return state[name].to(device=device, dtype=dtype)

        layers = []
        for i in range(config.n_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
            layers.append(
                _Layer(
                    attn_norm=get(p + "input_layernorm.weight"),
                    qkv=linear(qkv_w, qkv_b),
                    o=linear(get(p + "self_attn.o_proj.weight")),
                    mlp_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=linear(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])),
                    down=linear(get(p + "mlp.down_proj.weight")),
                )
            )
        embed = get("model.embed_tokens.weight")
        head = embed if config.tied_embeddings or "lm_head.weight" not in state else get("lm_head.weight")
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim))
        angles = torch.outer(torch.arange(config.max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return cls(
            config=config,
            embed=embed,
            layers=layers,
            norm=get("model.norm.weight"),
            lm_head=linear(head),
            dtype=dtype,
            device=device,
            _cos=angles.cos().to(device=device, dtype=dtype),
            _sin=angles.sin().to(device=device, dtype=dtype),
        )

    def new_cache(self, max_len: int) -> KVCache:
        if max_len > self.config.max_positions:
            raise ValueError(f"sequence of {max_len} positions exceeds the model's {self.config.max_positions}")
        return KVCache(self.config, max_len, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        cache: KVCache,
        route: LayerMask | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for `tokens` at positions start .. start+T-1, reading and writing `cache`.

        tokens: [T] int64. Returns [T, vocab] float32 logits ([1, vocab] with `last_only`).
        A routed pass runs only the sub-layers `route` keeps and writes K/V only for its kept
        attention layers; see the module docstring for the n_full invariant.
        """
        if route is not None and route.is_full:
            route = None
        if route is not None and route.n_layers != self.config.n_layers:
            raise ValueError(f"route has {route.n_layers} layers, model has {self.config.n_layers}")
        cfg = self.config
        n_tokens = tokens.shape[0]
        end = start + n_tokens
        cache._begin(route, start, n_tokens)

        x = self.embed[tokens]  # [T, hidden]
        cos = self._cos[start:end, None, :]  # [T, 1, head_dim]
        sin = self._sin[start:end, None, :]
        mask = None
        if n_tokens > 1:
            # query i (position start+i) sees keys at positions <= start+i: [T, end]
            mask = torch.arange(end, device=self.device)[None, :] <= torch.arange(start, end, device=self.device)[:, None]
        nq, nkv, hd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
        for i, layer in enumerate(self.layers):
            if route is None or route.attn[i]:
                h = _rms_norm(x, layer.attn_norm, cfg.rms_eps)
                qkv = layer.qkv(h)  # [T, nq + 2 nkv]
                q = qkv[:, :nq].view(n_tokens, cfg.n_heads, hd)
                k = qkv[:, nq : nq + nkv].view(n_tokens, cfg.n_kv_heads, hd)
                v = qkv[:, nq + nkv :].view(n_tokens, cfg.n_kv_heads, hd)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                cache.k[i, :, start:end] = k.transpose(0, 1)
                cache.v[i, :, start:end] = v.transpose(0, 1)
                attn = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],  # [1, n_heads, T, hd]
                    cache.k[i, None, :, :end],  # [1, n_kv_heads, end, hd]
                    cache.v[i, None, :, :end],
                    attn_mask=mask,
                    enable_gqa=cfg.n_heads != cfg.n_kv_heads,
                )  # [1, n_heads, T, hd]
                x = x + layer.o(attn[0].transpose(0, 1).reshape(n_tokens, nq))
            if route is None or route.mlp[i]:
                h = _rms_norm(x, layer.mlp_norm, cfg.rms_eps)
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
                x = x + layer.down(F.silu(gate) * up)
        cache._commit(route, start, end)
        if last_only:
            x = x[-1:]
        return self.lm_head(_rms_norm(x, self.norm, cfg.rms_eps)).float()
