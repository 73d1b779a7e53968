"""A lean decoder forward pass for the Llama family (llama / SmolLM2, qwen2, mistral) and the Gemma
family (gemma2, gemma3), with routes.

Routes and the KV cache's invariant: `models/kvcache.py`. The decoder computes passes and nothing
else: batching, prefix caching and pass timing wrap it from above (`viasd.execution`).

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

from dataclasses import dataclass, field
from typing import ClassVar, Literal, overload

import torch
import torch.nn.functional as F

from viasd.errors import UnsupportedArchitectureError
from viasd.models import ggml_forward
from viasd.models.config import ModelConfig
from viasd.models.ggml_kernels import NativeTensor, QuantEmbedding, QuantLinear
from viasd.models.kvcache import ROW_ATTENTION_MAX, KVCache, LayerMask, begin_pass
from viasd.models.layers import (Embedding, Linear, PackedLinear, ReducedHead, _attention, _Layer, _rms_norm, _rope_table,
                                 _rotate_half, _softcap)
from viasd.models.logits import PassOutput


def token_ids(tokens: torch.Tensor | list[int]) -> list[int]:
    """A pass' token ids as Python ints (the decoding loops give lists: a tensor made right after a
    pass cost 50-80 us, on cold caches; calibration, search and tests give [T] int64 tensors)."""
    return tokens if isinstance(tokens, list) else tokens.tolist()


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
    _graph: ggml_forward.NativeForward | None = field(default=None, repr=False)  # native weights: the pass as a ggml graph
    _head_weight: torch.Tensor | None = field(default=None, repr=False)  # float weights: the head unpacked (reduced heads)
    _weight_bytes: dict[tuple, int] = field(default_factory=dict, repr=False)  # `weight_bytes`, by its arguments
    _reduced_heads: dict[tuple, ReducedHead] = field(default_factory=dict, repr=False)  # `reduced_head`, by its ids
    # seconds of passes by shape, measured and learnt by `execution.timing.pass_times` (per model: its costs)
    pass_times: dict[tuple, list[float]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pack: bool | str = True,
        native: dict[str, NativeTensor] | None = None,
    ) -> Decoder:
        """Build from transformers-named weights (`model.layers.{i}.self_attn.q_proj.weight`, ...).

        `pack=False` keeps plain `F.linear` (MKL) products: slower here, bit-closer to transformers.
        `native`: weights in the model file's own (quantized) format, by the same names; those it holds
        are multiplied and looked up by ggml's kernels (models/ggml_kernels.py), the rest come from `state`.
        """
        device = torch.device(device)
        native = native or {}
        if native and (device.type != "cpu" or dtype != torch.float32):
            raise ValueError("native weights run on the CPU with float32 activations")
        w = _Weights(config, state, dtype, device, pack, native)
        layers = [_layer(w, i) for i in range(config.n_layers)]
        # an untied model's own head, whether it loaded as float weights or as the file's native blocks
        own_head = not config.tied_embeddings and ("lm_head.weight" in w.state or "lm_head.weight" in native)
        head = "lm_head.weight" if own_head else "model.embed_tokens.weight"
        embed: QuantEmbedding | Embedding
        if "model.embed_tokens.weight" in native:
            embed = QuantEmbedding(native["model.embed_tokens.weight"])
        else:
            embed = Embedding(w.get("model.embed_tokens.weight"))
        angles = _rope_angles(config, layers)  # [n_tables, max_positions, head_dim]
        decoder = cls(
            config=config,
            embed=embed,
            layers=layers,
            norm=w.norm("model.norm.weight"),
            lm_head=w.linear([head]),
            _head_weight=None if head in native else w.get(head),
            dtype=dtype,
            device=device,
            _cos=angles.cos().to(device=device, dtype=dtype),
            _sin=angles.sin().to(device=device, dtype=dtype),
        )
        if native and ggml_forward.supports(decoder):
            decoder._graph = ggml_forward.NativeForward(decoder, pack=pack)  # the whole pass as one ggml graph
        return decoder

    def weight_bytes(self, route: LayerMask | None = None, from_layer: int = 0, head: bool | ReducedHead = True) -> int:
        """Bytes of weights a pass along `route` reads (None: the full model): each kept sub-layer's
        products from layer `from_layer` on (a resumed pass) and the LM head (`head`: True the full
        one, a `ReducedHead`, or False: none); norms and the embedding rows of a pass are negligible.
        In the weights' stored format: a native model's file blocks, a float model's floats. What a
        pass costs one token when decoding is bound by weight bandwidth(the cost accounting of `DecodeStats`)."""
        key = (route if route is not None and not route.is_full else None, from_layer, head if isinstance(head, bool) else len(head))
        cached = self._weight_bytes
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
        heads = self._reduced_heads
        if key not in heads:
            vocab = self.lm_head.out_features
            index = torch.tensor(key, dtype=torch.long)
            if not key or any(a >= b for a, b in zip(key, key[1:])) or key[0] < 0 or key[-1] >= vocab:
                raise ValueError(f"a reduced head needs ascending, distinct token ids in [0, {vocab})")
            linear: QuantLinear | PackedLinear
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
                assert self._head_weight is not None  # (float weights keep the head unpacked)
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

    @overload
    def forward(self, tokens: torch.Tensor | list[int], start: int, cache: KVCache, route: LayerMask | None = ...,
                last_only: bool = ..., resume: bool = ..., logits: Literal[True] = ..., head: ReducedHead | None = ...,
                expand: bool = ..., scored: Literal[False] = ...) -> torch.Tensor: ...
    @overload
    def forward(self, tokens: torch.Tensor | list[int], start: int, cache: KVCache, route: LayerMask | None = ...,
                last_only: bool = ..., resume: bool = ..., logits: Literal[True] = ..., head: ReducedHead | None = ...,
                expand: bool = ..., *, scored: Literal[True]) -> PassOutput: ...
    @overload
    def forward(self, tokens: torch.Tensor | list[int], start: int, cache: KVCache, route: LayerMask | None = ...,
                last_only: bool = ..., resume: bool = ..., logits: bool = ..., head: ReducedHead | None = ...,
                expand: bool = ..., scored: bool = ...) -> torch.Tensor | PassOutput | None: ...

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor | list[int],
        start: int,
        cache: KVCache,
        route: LayerMask | None = None,
        last_only: bool = False,
        resume: bool = False,
        logits: bool = True,
        head: ReducedHead | None = None,
        expand: bool = True,
        scored: bool = False,
    ) -> torch.Tensor | PassOutput | None:
        """Logits for `tokens` at positions start .. start+T-1, reading and writing `cache`.

        tokens: [T] int64, or T ids (`token_ids`). Returns [T, vocab] float32 logits ([1, vocab] with `last_only`; None
        without `logits`: no head, the pass only fills the cache). A routed pass runs only the
        sub-layers `route` keeps and writes K/V only for its kept attention layers; see
        `models/kvcache.py` for the n_full invariant. `resume` (a full pass): start at the cache's resume layer
        from the residual streams stored there (`KVCache.enable_resume`); a pass that computes the
        stream entering that layer stores it. `head`: logits over a reduced vocabulary only (-inf
        elsewhere; see `ReducedHead`), or with `expand` False [T, N] over the head's ids alone (a
        greedy drafter's argmax among them: filling a 152k-token row took it 0.25 ms a token).
        `scored`: the logits as a `PassOutput`, with each row's argmax where the LM head found it.
        """
        tokens = token_ids(tokens)
        n_tokens = len(tokens)
        route, end = begin_pass(self.config, cache, route, start, n_tokens, resume)
        first = (cache.resume_layer or 0) if resume else 0  # (a resumed pass has a resume layer)
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
        out = outs[0] if len(outs) == 1 else PassOutput(torch.cat([o.logits for o in outs]))
        out = self._finish(out, head, expand)
        return out if scored else out.logits

    def _finish(self, out: PassOutput, head: ReducedHead | None, expand: bool) -> PassOutput:
        """A pass' raw logits soft-capped (their maxima then unknown) and expanded over a reduced head."""
        if self.config.final_softcap is not None:
            out = PassOutput(_softcap(out.logits, self.config.final_softcap))
        return out if head is None or not expand else head.expand(out)

    @torch.inference_mode()
    def forward_many(self, calls: list[tuple[tuple, dict]], rows: int | None = None) -> list:
        """Several requests' `forward(*args, **kwargs)` calls (native weights, one route and head, at
        most ROW_ATTENTION_MAX rows each, all resumed at one layer or none, all storing the streams
        entering one layer or none: `batching._group_key`) as one pass: every product over all their
        rows, each request's rows attending its own cache (and reading or storing its own streams).
        `rows`: each call padded to that many rows (its last token repeated; those rows' outputs
        dropped, their K/V and streams past its positions). Returns each call's result (a `PassOutput`
        where its `scored` asks), or the exception its checks raised (the others run)."""
        results: list = [None] * len(calls)
        runnable, route, head, first, save = [], None, None, 0, None
        for i, (args, kw) in enumerate(calls):
            tokens, start, cache = args
            tokens = token_ids(tokens)
            n = len(tokens)
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
                tokens = tokens + tokens[-1:] * pad
            want = (0, 0) if not kw.get("logits", True) else (n - 1, 1) if kw.get("last_only") else (0, n)  # its own rows only
            runnable.append((i, tokens, start, cache, want, end))
        if not runnable:
            return results
        assert self._graph is not None, "forward_many runs native weights only"
        outs = self._graph.run([(t, s, c, w) for _, t, s, c, w, _ in runnable], route, first, save, head)
        for (i, _, start, cache, _, end), out in zip(runnable, outs):
            cache._commit(route, start, end)
            kw = calls[i][1]
            if out is not None:
                out = self._finish(out, head, kw.get("expand", True))
                results[i] = out if kw.get("scored") else out.logits
        return results

    def _rows(self, tokens: list[int], start: int, cache: KVCache, route: LayerMask | None, last_only: bool,
              first: int, save: int | None, logits: bool, head: ReducedHead | None) -> PassOutput | None:
        """One chunk of `forward` (at most ROW_ATTENTION_MAX rows; the cache's bookkeeping is the caller's):
        raw logits [T, V] ([1, V] with `last_only`, [T, N] over a reduced head), or None."""
        n_tokens = len(tokens)
        end = start + n_tokens
        cfg = self.config
        if self._graph is not None:
            return self._graph(tokens, start, cache, route, last_only, first, save, logits, head)
        ids = torch.as_tensor(tokens, dtype=torch.long)

        if first:  # a resumed pass
            assert cache.hidden is not None  # (a resumable cache keeps the streams)
            x = cache.hidden[start:end].clone()  # [T, hidden] entering layer `first`
        else:
            x = self.embed(ids)  # [T, hidden]
            if cfg.embed_scale is not None:
                x = x * cfg.embed_scale
        # per RoPE table (global, local): [T, 1, head_dim]
        ropes = [(self._cos[t, start:end, None, :], self._sin[t, start:end, None, :]) for t in range(self._cos.shape[0])]
        for i, layer in enumerate(self.layers[first:], start=first):
            if i == save:
                assert cache.hidden is not None  # (`save`: the cache keeps the streams)
                cache.hidden[start:end] = x
                if not logits and route is not None and not any(route.attn[i:]) and not any(route.mlp[i:]):
                    break  # nothing past here is kept, and no head
            if route is None or route.attn[i]:
                x = x + self._attention_block(i, layer, x, cache, start, ropes[layer.rope])
            if route is None or route.mlp[i]:
                x = x + self._mlp_block(layer, x)
        if not logits:
            return None
        if last_only:
            x = x[-1:]
        return PassOutput((self.lm_head if head is None else head.linear)(_rms_norm(x, self.norm, cfg.rms_eps)).float())

    def _attention_block(self, i: int, layer: _Layer, x: torch.Tensor, cache: KVCache, start: int,
                         rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Layer i's attention sub-layer over rows `x` [T, hidden] at positions start..: its K/V rows
        written into `cache`, then each row's attention; what it adds to the stream, [T, hidden]."""
        cfg = self.config
        n_tokens = x.shape[0]
        # Attention is batch-invariant: each query row attends alone to exactly the keys it sees, so a
        # row's result does not depend on which other rows share its pass (a drafted block or a single
        # token: the same kernel on the same data).
        window = cfg.sliding_window or 0
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        gqa = cfg.n_heads != cfg.n_kv_heads
        nq, nkv, hd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
        h = _rms_norm(x, layer.attn_norm, cfg.rms_eps)
        qkv = layer.qkv(h)  # [T, nq + 2 nkv]
        q = qkv[:, :nq].view(n_tokens, cfg.n_heads, hd)
        k = qkv[:, nq : nq + nkv].view(n_tokens, cfg.n_kv_heads, hd)
        v = qkv[:, nq + nkv :].view(n_tokens, cfg.n_kv_heads, hd)
        if layer.q_norm is not None and layer.k_norm is not None:  # (both or neither)
            q = _rms_norm(q, layer.q_norm, cfg.rms_eps)
            k = _rms_norm(k, layer.k_norm, cfg.rms_eps)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        end = start + n_tokens
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
        return a

    def _mlp_block(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP sub-layer over rows `x` [T, hidden]: what it adds to the stream."""
        cfg = self.config
        h = _rms_norm(x, layer.mlp_norm, cfg.rms_eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        gate = F.silu(gate) if cfg.activation == "silu" else F.gelu(gate, approximate="tanh")
        m_out = layer.down(gate * up)
        if layer.post_mlp_norm is not None:
            m_out = _rms_norm(m_out, layer.post_mlp_norm, cfg.rms_eps)
        return m_out


class _Weights:
    """A checkpoint's tensors as `Decoder.from_state_dict` takes them: on its device and dtype,
    Gemma's norms folded, products on native weights where `native` holds all their parts."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 pack: bool | str, native: dict[str, NativeTensor]):
        self.config, self.dtype, self.device, self.pack, self.native = config, dtype, device, pack, native
        self.gemma = config.family == "gemma"
        if self.gemma and "model.embed_tokens.weight" not in state:  # a multimodal Gemma 3 checkpoint: its text model
            state = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): w
                     for k, w in state.items()}
        self.state = state

    def linear(self, names: list[str], bias: torch.Tensor | None = None) -> Linear:
        if all(n in self.native for n in names):
            return QuantLinear([self.native[n] for n in names], bias)
        return PackedLinear(torch.cat([self.get(n) for n in names]), bias, bool(self.pack))  # ("ggml", "row-exact": native only)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise UnsupportedArchitectureError(f"checkpoint lacks tensor {name!r} expected for {self.config.architecture}")
        return self.state[name].to(device=self.device, dtype=self.dtype)

    def norm(self, name: str) -> torch.Tensor:
        # Gemma's RMSNorm multiplies by (1 + w): folded into the weight once, here
        if not self.gemma:
            return self.get(name)
        self.get(name)  # (a missing tensor: the clear error)
        return (self.state[name].to(device=self.device, dtype=torch.float32) + 1.0).to(self.dtype)


def _layer(w: _Weights, i: int) -> _Layer:
    """Decoder layer i from the checkpoint's `model.layers.{i}.` tensors."""
    config, p = w.config, f"model.layers.{i}."
    qkv_b = torch.cat([w.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
    sliding = bool(config.sliding_layers and config.sliding_layers[i])
    return _Layer(
        attn_norm=w.norm(p + "input_layernorm.weight"),
        qkv=w.linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"], qkv_b),
        o=w.linear([p + "self_attn.o_proj.weight"]),
        # Llama names its pre-MLP norm post_attention_layernorm; Gemma has both
        mlp_norm=w.norm(p + ("pre_feedforward_layernorm.weight" if config.sandwich_norms else "post_attention_layernorm.weight")),
        gate_up=w.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
        down=w.linear([p + "mlp.down_proj.weight"]),
        post_attn_norm=w.norm(p + "post_attention_layernorm.weight") if config.sandwich_norms else None,
        post_mlp_norm=w.norm(p + "post_feedforward_layernorm.weight") if config.sandwich_norms else None,
        q_norm=w.norm(p + "self_attn.q_norm.weight") if config.qk_norm else None,
        k_norm=w.norm(p + "self_attn.k_norm.weight") if config.qk_norm else None,
        sliding=sliding,
        rope=1 if sliding and config.rope_local_theta is not None else 0,
    )


def _rope_angles(config: ModelConfig, layers: list[_Layer]) -> torch.Tensor:
    """[n_tables, max_positions, head_dim] RoPE angles: the global table, then the local one where a layer uses it."""
    tables = [_rope_table(config.rope_theta, config.rope_factor, config.head_dim, config.max_positions)]
    if config.rope_local_theta is not None and any(layer.rope == 1 for layer in layers):
        tables.append(_rope_table(config.rope_local_theta, 1.0, config.head_dim, config.max_positions))
    return torch.stack(tables)
