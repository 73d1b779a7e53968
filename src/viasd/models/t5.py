"""The T5 family (encoder-decoder) in the lean runtime: the encoder runs once per prompt, the decoder is
ours, with routes over its layers and the same KV cache and invariant as the decoder-only runtime.

- The encoder is transformers' own T5 encoder stack (weights and forward), run once per request by
  `encode(source, cache)`; every decoder layer's cross-attention K/V is computed from its output
  there, once, and kept in the cache (`Seq2SeqCache.cross_k / cross_v`) for the whole request.
- The decoder's forward has the decoder-only signature `forward(tokens, start, cache, route,
  last_only) -> logits`, so `Session`, the drafters and every loop call it unchanged. Its self-attention
  K/V lives in the same preallocated `KVCache` with the same n_full rules.
- A route keeps or skips, per decoder layer, its attention sub-layers (self- and cross-attention
  together: `LayerMask.attn`) and its feed-forward sub-layer (`LayerMask.mlp`).
- T5 specifics: RMSNorm without bias, no 1/sqrt(d) attention scaling, a relative position bias
  (computed from the first layer's table, shared by every layer, so a route that skips layer 0 still
  has it), ReLU or gated-GeLU feed-forward, decoder outputs scaled by d_model^-0.5 before a tied head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from viasd.errors import UnsupportedArchitectureError
from viasd.models.config import ModelConfig, t5_config
from viasd.models.kvcache import KVCache, LayerMask, begin_pass
from viasd.models.layers import PackedLinear, _rms_norm
from viasd.models.logits import PassOutput

T5_ARCHITECTURES = ("t5",)


class Seq2SeqCache(KVCache):
    """The decoder's self-attention KVCache plus the cross-attention K/V of one encoded source."""

    cross_k: torch.Tensor | None = None  # [n_layers, n_heads, source_len, head_dim]
    cross_v: torch.Tensor | None = None


@dataclass
class _T5Layer:
    self_norm: torch.Tensor
    qkv: PackedLinear  # hidden -> 3 * n_heads * head_dim
    o: PackedLinear
    cross_norm: torch.Tensor
    cross_q: PackedLinear
    cross_kv: PackedLinear  # encoder output -> 2 * n_heads * head_dim (used once, at encode)
    cross_o: PackedLinear
    ff_norm: torch.Tensor
    wi: PackedLinear  # hidden -> d_ff, or 2 d_ff (gated: wi_0 then wi_1)
    wo: PackedLinear


class EncoderDecoder:
    """A T5 model: transformers' encoder + our routed decoder. Holds no per-request state."""

    is_encoder_decoder = True

    def __init__(self, config: ModelConfig, encoder, state: dict[str, torch.Tensor], start_token: int,
                 rel_buckets: int, rel_max_distance: int, dtype: torch.dtype, device: torch.device, pack: bool):
        self.config, self.encoder, self.dtype, self.device = config, encoder, dtype, device
        self.pass_times: dict[tuple, list[float]] = {}  # measured by `execution.timing.pass_times`
        self.start_token = start_token  # the decoder's first token (T5: the pad id)
        self.rel_buckets, self.rel_max_distance = rel_buckets, rel_max_distance

        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise UnsupportedArchitectureError(f"checkpoint lacks tensor {name!r} expected for t5")
            return state[name].to(device=device, dtype=dtype)

        def linear(w: torch.Tensor) -> PackedLinear:
            return PackedLinear(w, None, pack)

        gated = config.activation.startswith("gated_")
        self.layers = []
        for i in range(config.n_layers):
            p = f"decoder.block.{i}.layer."
            ff = p + "2.DenseReluDense."
            self.layers.append(_T5Layer(
                self_norm=get(p + "0.layer_norm.weight"),
                qkv=linear(torch.cat([get(p + f"0.SelfAttention.{n}.weight") for n in "qkv"])),
                o=linear(get(p + "0.SelfAttention.o.weight")),
                cross_norm=get(p + "1.layer_norm.weight"),
                cross_q=linear(get(p + "1.EncDecAttention.q.weight")),
                cross_kv=linear(torch.cat([get(p + f"1.EncDecAttention.{n}.weight") for n in "kv"])),
                cross_o=linear(get(p + "1.EncDecAttention.o.weight")),
                ff_norm=get(p + "2.layer_norm.weight"),
                wi=linear(torch.cat([get(ff + "wi_0.weight"), get(ff + "wi_1.weight")]) if gated else get(ff + "wi.weight")),
                wo=linear(get(ff + "wo.weight")),
            ))
        self.rel_bias = get("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")  # [buckets, heads]
        self.embed = get("shared.weight")
        self.final_norm = get("decoder.final_layer_norm.weight")
        self.lm_head = linear(get("lm_head.weight") if "lm_head.weight" in state else self.embed)
        self.out_scale = config.hidden ** -0.5 if config.tied_embeddings else None
        self.gated = gated
        self.act = F.relu if config.activation.endswith("relu") else (lambda x: F.gelu(x, approximate="tanh"))

    @classmethod
    def from_pretrained(cls, path, hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", pack: bool = True) -> EncoderDecoder:
        from transformers import T5EncoderModel

        config = t5_config(hf_config)
        # (transformers types `.to` through a decorator mypy reads as taking the model)
        encoder = T5EncoderModel.from_pretrained(path, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
        start = hf_config.decoder_start_token_id if hf_config.decoder_start_token_id is not None else hf_config.pad_token_id
        return cls(config, encoder, state, int(start), hf_config.relative_attention_num_buckets,
                   hf_config.relative_attention_max_distance, dtype, torch.device(device), pack)

    def new_cache(self, max_len: int) -> Seq2SeqCache:
        if max_len > self.config.max_positions:
            raise ValueError(f"sequence of {max_len} positions exceeds the model's {self.config.max_positions}")
        return Seq2SeqCache(self.config, max_len, self.dtype, self.device)

    @torch.inference_mode()
    def encode(self, source: torch.Tensor, cache: Seq2SeqCache) -> None:
        """Run the encoder over `source` ([S] ids) once and store every layer's cross-attention K/V."""
        enc = self.encoder(input_ids=source[None].to(self.device)).last_hidden_state[0]  # [S, hidden]
        cfg = self.config
        shape = (cfg.n_layers, cfg.n_heads, enc.shape[0], cfg.head_dim)
        cache.cross_k = torch.empty(shape, dtype=self.dtype, device=self.device)
        cache.cross_v = torch.empty(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            k, v = layer.cross_kv(enc).view(enc.shape[0], 2, cfg.n_heads, cfg.head_dim).unbind(1)
            cache.cross_k[i], cache.cross_v[i] = k.transpose(0, 1), v.transpose(0, 1)

    def _position_bias(self, start: int, end: int) -> torch.Tensor:
        """[n_heads, T, end] relative position bias of queries start..end-1 over keys 0..end-1, causal."""
        from transformers.models.t5.modeling_t5 import T5Attention

        q = torch.arange(start, end, device=self.device)[:, None]
        k = torch.arange(end, device=self.device)[None, :]
        buckets = T5Attention._relative_position_bucket(k - q, bidirectional=False, num_buckets=self.rel_buckets,
                                                        max_distance=self.rel_max_distance)
        bias = self.rel_bias[buckets].permute(2, 0, 1)  # [H, T, end]
        return bias.masked_fill(k > q, float("-inf"))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: Seq2SeqCache, route: LayerMask | None = None,
                last_only: bool = False, resume: bool = False, head=None, scored: bool = False) -> torch.Tensor | PassOutput:
        """Decoder logits for `tokens` at decoder positions start .. start+T-1 (after `encode`); `scored`:
        as a `PassOutput` (no row maxima known). (`resume` is refused: an encoder-decoder's cache never
        stores resumable streams; so is a reduced `head`: routes of a T5 store no vocabulary.)"""
        if head is not None:
            raise ValueError("an encoder-decoder decoder has no reduced LM heads")
        if cache.cross_k is None or cache.cross_v is None:
            raise ValueError("encoder-decoder model: encode the source into this cache first")
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        n_tokens = tokens.shape[0]
        route, end = begin_pass(self.config, cache, route, start, n_tokens, resume)
        cfg = self.config
        x = self.embed[tokens]  # [T, hidden]
        bias = self._position_bias(start, end)[None].to(self.dtype)  # [1, H, T, end]
        inner = cfg.n_heads * cfg.head_dim
        for i, layer in enumerate(self.layers):
            if route is None or route.attn[i]:
                h = _rms_norm(x, layer.self_norm, cfg.rms_eps)
                q, k, v = layer.qkv(h).view(n_tokens, 3, cfg.n_heads, cfg.head_dim).unbind(1)
                cache.k[i, :, start:end] = k.transpose(0, 1)
                cache.v[i, :, start:end] = v.transpose(0, 1)
                a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], cache.k[i, None, :, :end], cache.v[i, None, :, :end],
                                                   attn_mask=bias, scale=1.0)
                x = x + layer.o(a[0].transpose(0, 1).reshape(n_tokens, inner))
                h = _rms_norm(x, layer.cross_norm, cfg.rms_eps)
                q = layer.cross_q(h).view(n_tokens, cfg.n_heads, cfg.head_dim)
                a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], cache.cross_k[i, None], cache.cross_v[i, None], scale=1.0)
                x = x + layer.cross_o(a[0].transpose(0, 1).reshape(n_tokens, inner))
            if route is None or route.mlp[i]:
                h = _rms_norm(x, layer.ff_norm, cfg.rms_eps)
                if self.gated:
                    g, u = layer.wi(h).chunk(2, dim=-1)
                    h = self.act(g) * u
                else:
                    h = self.act(layer.wi(h))
                x = x + layer.wo(h)
        cache._commit(route, start, end)
        if last_only:
            x = x[-1:]
        x = _rms_norm(x, self.final_norm, cfg.rms_eps)
        if self.out_scale is not None:
            x = x * self.out_scale
        logits = self.lm_head(x).float()
        return PassOutput(logits) if scored else logits
