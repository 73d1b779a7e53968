"""A model's shapes and its family's switches (`ModelConfig`), read once from a transformers config.

The forward pass is written once per family; architectures differ only in these fields (QKV bias for
qwen2; for Gemma: embedding scale sqrt(hidden), (1 + w) RMSNorm weights, sandwich norms, gated
tanh-GeLU, query/key norms (gemma3), soft-capping (gemma2), sliding-window layers with a local RoPE
base, `query_pre_attn_scalar`; for T5: the decoder side of an encoder-decoder).
"""

from __future__ import annotations

from dataclasses import dataclass

from viasd.errors import UnsupportedArchitectureError

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


def _shapes(hf) -> dict:
    """The `ModelConfig` fields every decoder-only family reads alike from a transformers config."""
    return dict(architecture=hf.model_type, n_layers=hf.num_hidden_layers, hidden=hf.hidden_size,
                n_heads=hf.num_attention_heads, n_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                intermediate=hf.intermediate_size, vocab_size=hf.vocab_size, rms_eps=float(hf.rms_norm_eps))


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
    def from_hf(cls, hf) -> ModelConfig:
        """From a transformers `PretrainedConfig`."""
        arch = hf.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {arch!r}: the runtime supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if FAMILIES[arch] == "gemma":
            return cls._gemma_from_hf(getattr(hf, "text_config", None) or hf)
        if FAMILIES[arch] == "t5":
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
        return cls(
            **_shapes(hf),
            rope_theta=float(theta),
            qkv_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            tied_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_positions=int(max_pos),
        )

    @classmethod
    def _gemma_from_hf(cls, hf) -> ModelConfig:
        arch = hf.model_type
        if getattr(hf, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError(f"{arch} with bidirectional attention is not a decoder")
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedArchitectureError(f"unsupported {arch} activation {act!r}")
        n_layers = hf.num_hidden_layers
        types = list(getattr(hf, "layer_types", None)
                     or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)])
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
        window = getattr(hf, "sliding_window", None)
        return cls(
            **_shapes(hf),
            rope_theta=theta,
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



def t5_config(hf) -> ModelConfig:
    """`ModelConfig` of a T5's decoder side (n_layers = decoder layers)."""
    act = hf.dense_act_fn
    if act not in ("relu", "gelu_new", "gelu_pytorch_tanh"):
        raise UnsupportedArchitectureError(f"unsupported t5 feed-forward activation {act!r}")
    return ModelConfig(
        architecture=hf.model_type,
        n_layers=hf.num_decoder_layers,
        hidden=hf.d_model,
        n_heads=hf.num_heads,
        n_kv_heads=hf.num_heads,
        head_dim=hf.d_kv,
        intermediate=hf.d_ff,
        vocab_size=hf.vocab_size,
        rope_theta=0.0,  # relative position bias instead
        rms_eps=float(hf.layer_norm_epsilon),
        qkv_bias=False,
        tied_embeddings=bool(getattr(hf, "scale_decoder_outputs", hf.tie_word_embeddings)),
        max_positions=1 << 16,  # relative positions: no table bounds the length
        family="t5",
        activation=("gated_" if hf.is_gated_act else "") + ("relu" if act == "relu" else "gelu_tanh"),
    )
